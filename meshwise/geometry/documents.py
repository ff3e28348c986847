"""Documents packed into sequences (pure): each token's document and its position in it,
for document masking (Krell et al. 2021; Megatron-LM's ``--reset-attention-mask
--reset-position-ids``), asked for by global positions so a cp rank sees what one
process does. See docs/fine-tuning.md "Packing with document masks".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

if TYPE_CHECKING:  # for the host form's type only: geometry imports only torch
    import numpy as np

Array = TypeVar("Array", torch.Tensor, "np.ndarray")  # on a device, or a host array


@dataclass(frozen=True)
class Documents(Generic[Array]):
    """Documents of ``B`` whole sequences of ``T`` tokens.

    ``ids``: (B, T) int64, the same for the tokens of one document, increasing
    from one document to the next; ``positions``: (B, T) int64, each token's
    place in its document (0 at its first token). Tensors on a device, or host
    arrays (``meshwise.data.packing.documents_from_starts`` makes them from
    where documents start).
    """

    ids: Array
    positions: Array

    def rows(self, first: int, count: int) -> Documents[Array]:
        """Rows ``[first, first + count)`` (the sequences one forward computes)."""
        return Documents(self.ids[first : first + count], self.positions[first : first + count])

    def to(self, device) -> Documents[torch.Tensor]:
        """As tensors on ``device`` (from host arrays or tensors)."""
        return Documents(
            torch.as_tensor(self.ids, device=device), torch.as_tensor(self.positions, device=device)
        )

    def allowed(
        self: Documents[torch.Tensor],
        q_positions: torch.Tensor,
        k_positions: torch.Tensor,
        causal: bool = True,
    ) -> torch.Tensor:
        """(B, 1, Lq, Lk) bool: which keys each query may see, by global positions
        ``q_positions`` (Lq,) and ``k_positions`` (Lk,): those of its own document, and
        with ``causal`` none after it. Dim 1 broadcasts over the heads."""
        same = self.ids[:, q_positions, None] == self.ids[:, None, k_positions]  # (B, Lq, Lk)
        if causal:
            same = same & (k_positions[None, :] <= q_positions[:, None])
        return same.unsqueeze(1)


def shares_a_document(ids, last_key: int, first_query: int) -> bool:
    """Whether, in any row of ``ids`` ((B, T), never decreasing along a row), a query at or
    after ``first_query`` can see a key at or before ``last_key`` (< ``first_query``):
    only when the document of ``last_key`` runs on to ``first_query``. ``ids`` is a host
    array (numpy): deciding reads nothing from a device."""
    return bool((ids[:, last_key] == ids[:, first_query]).any())


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` as an additive mask of ``dtype``: 0 where allowed, -inf elsewhere
    (what fused attention kernels take; a row with no key allowed gives zeros)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )
