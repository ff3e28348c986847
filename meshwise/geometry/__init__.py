"""Layout geometry, the bottom floor: how a model's tensors are laid out, as pure data.

Pieces of logical tensors, tensor-parallel marks, flat runs, layout-independent
initial values and ``ParallelPlan``. It imports only torch; every package may use it.
"""
