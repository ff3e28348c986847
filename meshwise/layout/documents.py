"""Documents packed into sequences: which document each token belongs to (pure).

A packed sequence holds several documents, or pieces of them, one after
another. Under document masking each token attends only to the tokens of its
own document up to itself (block-diagonal causal attention) and its position
counts from its document's first token, so every document is computed as if
it were alone (Megatron-LM's ``--reset-attention-mask --reset-position-ids``,
torchtitan's document mask; Krell et al. 2021, "Efficient sequence packing
without cross-contamination").

``Documents`` holds, for whole sequences, each token's document (ids that
never decrease along a row) and its position inside it. Attention masks are
asked for by global positions (``allowed``), so a context-parallel rank, which
holds some chunks of every sequence (``meshwise.layout.sequence``), asks for
the (query, key) pairs it computes and gets what one process would use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    """Documents of ``B`` whole sequences of ``T`` tokens.

    ``ids``: (B, T) int64, the same for the tokens of one document, increasing
    from one document to the next; ``positions``: (B, T) int64, each token's
    place in its document (0 at its first token).
    """

    ids: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> "Documents":
        """From ``starts`` (B, T) bool, true where a document begins (the first token of
        every row begins one, marked or not)."""
        starts = starts.clone()
        starts[:, 0] = True
        ids = starts.long().cumsum(1)  # (B, T)
        index = torch.arange(starts.shape[1], device=starts.device).expand_as(ids)
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
        return cls(ids, index - first)

    def rows(self, first: int, count: int) -> "Documents":
        """Rows ``[first, first + count)`` (the sequences one forward computes)."""
        return Documents(self.ids[first:first + count], self.positions[first:first + count])

    def to(self, device) -> "Documents":
        return Documents(self.ids.to(device), self.positions.to(device))

    def allowed(self, q_positions: torch.Tensor, k_positions: torch.Tensor,
                causal: bool = True) -> torch.Tensor:
        """(B, 1, Lq, Lk) bool: which keys each query may see, by global positions
        ``q_positions`` (Lq,) and ``k_positions`` (Lk,): those of its own document, and
        with ``causal`` none after it. Dim 1 broadcasts over the heads."""
        same = self.ids[:, q_positions, None] == self.ids[:, None, k_positions]  # (B, Lq, Lk)
        if causal:
            same = same & (k_positions[None, :] <= q_positions[:, None])
        return same.unsqueeze(1)

    def shares_a_document(self, last_key: int, first_query: int) -> bool:
        """Whether a query at or after ``first_query`` can see a key at or before
        ``last_key`` (< ``first_query``) in any row: ids never decrease, so only when the
        document of ``last_key`` runs on to ``first_query``. Read on the host: call it on
        a CPU copy."""
        return bool((self.ids[:, last_key] == self.ids[:, first_query]).any())


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` as an additive mask of ``dtype``: 0 where allowed, -inf elsewhere
    (what fused attention kernels take; a row with no key allowed gives zeros)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))
