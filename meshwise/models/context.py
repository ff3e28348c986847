"""What one forward computes (its global samples, tokens, heads and documents), handed to
the model as ``context=`` rather than set on modules (as torchtitan's pipeline passes
positions and masks). Every rank draws the whole global batch, so every stage and
recompute makes the same context with nothing sent.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from meshwise.geometry.sequence import SequenceShard
from meshwise.models.attention_masks import DocumentMask
from meshwise.models.router_stats import RouterTally


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """Which elements one forward computes.

    ``seed``, ``step``, ``first_sample``: its rows are global samples ``first_sample ..`` of
    batch ``step`` (dropout's identity); ``tokens``: the tokens of each sequence this rank
    holds; ``tp_rank``: local head ``i`` is global head ``tp_rank * local_heads + i``;
    ``documents``: the rows' documents, or None.
    """

    seed: int = 0
    step: int = 0
    first_sample: int = 0
    tokens: SequenceShard = field(default_factory=SequenceShard)
    tp_rank: int = 0
    documents: DocumentMask | None = None
    router: RouterTally | None = None  # where MoE layers note their routing, or None


WHOLE = ForwardContext()  # one process, whole sequences: a forward called without a context


def takes_context(module) -> bool:
    """Whether ``module``'s forward takes ``context=`` (meshwise's families do; a model of
    one's own may not, and is then called with its inputs alone)."""
    parameters = inspect.signature(module.forward).parameters.values()
    return any(p.name == "context" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
