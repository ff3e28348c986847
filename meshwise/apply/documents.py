"""Document masking applied from outside the model (``--document-mask``).

A model's positions and attention are the modules of ``meshwise.models.attention``
(or their context-parallel forms); ``apply_document_mask`` hands each of them
the rank's ``DocumentContext``, after which positions count from each
document's first token and attention stays inside each document
(``meshwise.layout.documents``). The model's code and parameters are
untouched, as for the other styles a plan applies.
"""

from __future__ import annotations

from torch import nn

from meshwise.context_parallel.ring import RingAttention
from meshwise.models.attention import Positions, ScaledDotProductAttention
from meshwise.models.documents import DocumentContext

_ATTENTION = (ScaledDotProductAttention, RingAttention)


def apply_document_mask(chunks: list[nn.Module], documents: DocumentContext) -> None:
    """Point every positions and attention module of ``chunks`` at ``documents``.

    Raises ``ValueError`` when the model has no such attention (the mask could not
    reach it) or no such positions (they would run on across documents).
    """
    found = {"attention": 0, "positions": 0}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, _ATTENTION):
                module.documents = documents
                found["attention"] += 1
            elif isinstance(module, Positions):
                module.documents = documents
                found["positions"] += 1
    if not found["attention"] or not found["positions"]:
        missing = ("ScaledDotProductAttention modules (the plan's ring_attention style)"
                   if not found["attention"] else "a Positions module (the plan's positions "
                   "style; one that is never called serves a model without positions)")
        raise ValueError("document masking needs the model's attention and positions to be "
                         f"meshwise.models.attention modules; this model has no {missing}")
