"""What one forward computes, handed to the model as an argument (``context=``).

A model's forward takes its inputs and a ``ForwardContext`` that says which
elements those inputs are: which global samples (for keyed dropout), which
tokens of each sequence this rank holds (context and sequence parallelism),
which attention heads (tensor parallelism) and, under document masking, the
sequences' documents. The families pass it down to the places that read it:
positions, attention and dropout. Nothing is set on a module per batch
(torchtitan's pipeline hands its stages positions and masks as keyword
arguments in the same way).

Every rank draws the whole global batch, so every rank can make the context
of any micro-batch on its own: a pipeline hands each stage its micro-batch's
context with nothing sent between stages, and activation checkpointing's
recompute gets the same object back, so it draws the same dropout masks and
reads the same documents as the forward it repeats. A model called without a
context (tests, generation, Hugging Face parity) computes whole sequences of
one process: ``ForwardContext()``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from meshwise.layout.sequence import SequenceShard
from meshwise.models.attention_masks import DocumentMask


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """Which elements one forward computes.

    ``seed``, ``step``, ``first_sample``: its rows are global samples
    ``first_sample ..`` of global batch ``step`` of the run seeded ``seed`` (the
    identity keyed dropout draws each element's mask from). ``tokens``: which
    tokens of each sequence this rank holds (``meshwise.layout.sequence``).
    ``tp_rank``: which heads: local head ``i`` is global head ``tp_rank *
    local_heads + i``. ``documents``: the rows' documents under document
    masking, or None (each sequence one document).
    """

    seed: int = 0
    step: int = 0
    first_sample: int = 0
    tokens: SequenceShard = field(default_factory=SequenceShard)
    tp_rank: int = 0
    documents: DocumentMask | None = None


WHOLE = ForwardContext()  # one process, whole sequences: a forward called without a context


def takes_context(module) -> bool:
    """Whether ``module``'s forward takes ``context=`` (meshwise's families do; a model of
    one's own may not, and is then called with its inputs alone)."""
    parameters = inspect.signature(module.forward).parameters.values()
    return any(p.name == "context" or p.kind is inspect.Parameter.VAR_KEYWORD
               for p in parameters)
