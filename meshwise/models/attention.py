"""The two pieces of a transformer that see where its tokens are in their sequence.

On one process a forward holds whole sequences; under context parallelism a
rank holds some chunks of each (``meshwise.layout.sequence``). Both families
therefore ask two small modules, which a plan may swap for their
context-parallel forms (``meshwise.context_parallel``), instead of assuming
``arange(T)``:

- ``Positions``: the global positions of the tokens a forward holds (learned
  position embeddings and rotary angles are looked up at them);
- ``ScaledDotProductAttention``: causal attention of the queries a forward
  holds over the keys of the whole sequence, with grouped-query attention
  (fewer key/value heads than query heads, never repeated in memory) and
  keyed attention dropout (``meshwise.models.dropout``).

Neither holds parameters, so swapping them changes no name a checkpoint knows.
Both read the sequences' documents when they are given a ``DocumentContext``
(``documents``, set from outside by ``meshwise.apply.documents``): positions
then count from each document's first token and attention stays inside each
document (``meshwise.layout.documents``): each document attended on its own
(``documents_attention``), or with dropout, whose keep-masks are keyed by
position in the whole sequence, under a block-diagonal mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.models.documents import DocumentContext
from meshwise.models.dropout import DropoutContext


class Positions(nn.Module):
    """Positions ``start .. start + length`` of a forward over whole sequences: (T,), or
    (B, T) inside each sequence's documents under document masking."""

    documents: DocumentContext | None = None

    def forward(self, start: int, length: int, device) -> torch.Tensor:
        held = self.held(start, length, device)  # (T,) global positions
        documents = self.documents.current() if self.documents is not None else None
        return held if documents is None else documents.positions[:, held]  # (B, T)

    def held(self, start: int, length: int, device) -> torch.Tensor:
        """Global positions of the tokens this forward holds."""
        return torch.arange(start, start + length, device=device)  # (T,)


class ScaledDotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over whole sequences.

    ``q``: (B, H, Tq, d); ``k``, ``v``: (B, G, Tk, d) with G dividing H (query
    head i reads key/value head i // (H / G), as Ainslie et al. 2023 group
    them). ``p``: dropout on the attention weights, drawn from ``dropout`` at
    ``site`` (per sample, head and (query, key) pair).
    """

    documents: DocumentContext | None = None

    def __init__(self, p: float = 0.0, site: str = "", dropout: DropoutContext | None = None):
        super().__init__()
        if p and dropout is None:
            raise ValueError("attention dropout needs a DropoutContext")
        self.p, self.site, self.dropout = p, site, dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool = True) -> torch.Tensor:
        check_heads(q.shape[1], k.shape[1])
        dropout = self.training and self.p
        documents = self.documents is not None and causal and q.shape[2] == k.shape[2]
        lengths = self.documents.lengths() if documents and not dropout else None
        if lengths is not None:
            return documents_attention(q, k, v, lengths)
        mask = self.documents.attention_mask(q.shape[2], q.dtype) if documents else None
        if dropout:
            return self._with_dropout(q, k, v, causal, mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                              enable_gqa=k.shape[1] != q.shape[1])  # (B,H,Tq,d)

    def _with_dropout(self, q, k, v, causal: bool, mask=None) -> torch.Tensor:
        """The weights formed explicitly, dropped per (sample, head), then applied.
        ``mask``: an additive (B, 1, Tq, Tk) mask in place of the causal one."""
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # (B, H, Tk, d)
        v = v.repeat_interleave(group, dim=1)
        t_q, t_k = q.shape[2], k.shape[2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        if mask is not None:
            att = att + mask
        elif causal:
            mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
        att = torch.softmax(att, dim=-1)
        keep = self.dropout.mask(self.site, att.shape, self.p, att.device, per_head=True)
        return (att * keep.to(att.dtype)) @ v  # (B, H, Tq, d)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}" if self.p else ""


def documents_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        lengths: list[list[int]]) -> torch.Tensor:
    """Causal attention inside each document, each computed on its own (what
    flash attention's varlen kernels do in one launch): no work across documents,
    no (T, T) mask. ``lengths``: each row's document lengths, in order (host
    integers, summing to T); q (B, H, T, d), k and v (B, G, T, d)."""
    grouped = k.shape[1] != q.shape[1]
    rows = []
    for b, row in enumerate(lengths):
        parts = zip(q[b].split(row, dim=1), k[b].split(row, dim=1), v[b].split(row, dim=1))
        rows.append(torch.cat([F.scaled_dot_product_attention(
            qd[None], kd[None], vd[None], is_causal=True, enable_gqa=grouped)[0]
            for qd, kd, vd in parts], dim=1))  # (H, T, d)
    return torch.stack(rows)  # (B, H, T, d)


def check_heads(n_head: int, n_kv_head: int) -> None:
    """Each key/value head must serve a whole group of query heads."""
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"{n_head} query heads do not split into groups over {n_kv_head} "
                         "key/value heads (grouped-query attention needs n_kv_head to "
                         "divide n_head)")
