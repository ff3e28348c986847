"""Layout geometry, the bottom floor: how a model's tensors are laid out, as pure data.

- ``pieces``: a piece of a logical tensor (a tensor-parallel box plus a flat
  range inside it), and copying between pieces;
- ``params``: the tensor-parallel marks on a parameter, and its logical piece;
- ``flat_runs``: a flat buffer of parameters as checkpoints see it;
- ``init``: layout-independent initial values, drawn piece by piece;
- ``plan``: ``ParallelPlan``, what a model family splits, cuts and ties.

It imports only torch, and nothing else of meshwise: every other package may
use it.
"""
