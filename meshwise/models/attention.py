"""The two pieces of a transformer that see where its tokens are: ``Positions`` and
``ScaledDotProductAttention``. They hold no parameters, so a plan swaps them for their
context-parallel forms without renaming anything; both read the ``ForwardContext``.
"""

from __future__ import annotations

import torch
from torch import nn

from meshwise.geometry.sequence import SequenceShard
from meshwise.models.attention_kernels import (
    attention,
    documents_attention,
    explicit_attention,
)
from meshwise.models.context import WHOLE, ForwardContext
from meshwise.models.dropout import attention_elements, keep_mask

__all__ = ["Positions", "ScaledDotProductAttention", "check_heads", "documents_attention"]


class Positions(nn.Module):
    """Positions ``start .. start + length`` of a forward over whole sequences: (T,), or
    (B, T) inside each sequence's documents under document masking.

    ``tokens``: which tokens of each sequence this rank holds (a cp rank's
    zigzag chunks, given by the plan's ``positions`` style; default: all)."""

    def __init__(self, tokens: SequenceShard | None = None):
        super().__init__()
        self.tokens = tokens or SequenceShard()

    @classmethod
    def for_cp(cls, module: "Positions", cp_group) -> "Positions":
        """The ``positions`` style: the positions of this cp rank's chunks."""
        return cls(SequenceShard(cp_group.rank, cp_group.size))

    def forward(
        self, start: int, length: int, device, context: ForwardContext | None = None
    ) -> torch.Tensor:
        held = self.held(start, length, device)  # (T,) global positions
        documents = (context or WHOLE).documents
        return held if documents is None else documents.positions(held)  # (B, T)

    def held(self, start: int, length: int, device) -> torch.Tensor:
        """Global positions of the tokens this forward holds."""
        if self.tokens.cp_size == 1:
            return torch.arange(start, start + length, device=device)  # (T,)
        if start:
            raise ValueError(
                "a context-parallel forward holds chunks of whole sequences "
                "from position 0; decoding after a KV cache runs at cp 1"
            )
        return self.tokens.local_positions(length, device)  # (T / cp,)

    def extra_repr(self) -> str:
        t = self.tokens
        return f"cp_rank={t.cp_rank}, cp_size={t.cp_size}" if t.cp_size > 1 else ""


class ScaledDotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over whole sequences, by the kernel
    ``attention_kernels`` chooses.

    ``q``: (B, H, Tq, d); ``k``, ``v``: (B, G, Tk, d), query head i reading key/value head
    i // (H / G) (Ainslie et al. 2023). ``window``: sliding window (0: none); ``p``: dropout
    on the weights, keyed at ``site``; ``context``: the forward's ``ForwardContext``.
    """

    def __init__(self, p: float = 0.0, site: str = ""):
        super().__init__()
        self.p, self.site = p, site

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = True,
        window: int = 0,
        context: ForwardContext | None = None,
    ) -> torch.Tensor:
        check_heads(q.shape[1], k.shape[1])
        context = context or WHOLE
        whole = causal and q.shape[2] == k.shape[2]
        documents = context.documents if whole else None
        keep = self._keep(q, k.shape[2], context) if self.training and self.p else None
        return attention(q, k, v, causal, window, documents, keep)  # (B, H, Tq, d)

    def _with_dropout(
        self, q, k, v, causal: bool, mask=None, context: ForwardContext | None = None
    ) -> torch.Tensor:
        """The weights formed explicitly, dropped per (sample, head), then applied.
        ``mask``: an additive (B, 1, Tq, Tk) mask in place of the causal one."""
        return explicit_attention(
            q, k, v, causal, self._keep(q, k.shape[2], context or WHOLE), mask
        )

    def _keep(self, q: torch.Tensor, num_keys: int, context: ForwardContext):
        """The keep-mask of key columns ``start .. end`` (B, H, Tq, end - start), keyed
        by the weight's place (query, key) in the (Tq, Tk) matrix. A kernel that
        draws it again in the backward gets this forward's masks: the context is
        the forward's, whatever training has moved on to since."""
        B, H, t_q = q.shape[:3]

        def keep(start: int, end: int) -> torch.Tensor:
            rows = torch.arange(t_q, device=q.device)
            cols = torch.arange(start, end, device=q.device)
            return keep_mask(
                context,
                self.site,
                torch.Size([B, H, t_q, end - start]),
                self.p,
                q.device,
                per_head=True,
                elements=attention_elements(rows, cols, num_keys),
            )

        return keep

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}" if self.p else ""


def check_heads(n_head: int, n_kv_head: int) -> None:
    """Each key/value head must serve a whole group of query heads."""
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(
            f"{n_head} query heads do not split into groups over {n_kv_head} "
            "key/value heads (grouped-query attention needs n_kv_head to "
            "divide n_head)"
        )
