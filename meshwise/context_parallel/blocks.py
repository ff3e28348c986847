"""Attention of one block of queries over one block of keys, with its log-sum-exp.

Ring attention (``meshwise.context_parallel.ring``) computes a rank's attention
block by block as the keys and values come by, and merges the blocks' results
with their log-sum-exp (the online softmax of Milakov & Gimelshein 2018, as
FlashAttention does across tiles, Dao et al. 2022). Each block needs:

- ``block_forward(q, k, v, causal, scale)``: ``out = softmax(q k^T scale) v``
  and ``lse = log sum exp(q k^T scale)`` per query;
- ``block_backward(dout, q, k, v, out, lse, ...)``: the block's part of dq, dk,
  dv, given the *final* ``out`` and ``lse`` of the whole row (FlashAttention's
  backward, Dao et al. 2022, algorithm 4: ``P = exp(S - lse)``,
  ``dS = P (dP - rowsum(dout * out))``).

Queries are (B, H, Lq, d); keys and values (B, G, Lk, d) with G dividing H
(grouped-query attention: never repeated here). ``causal`` masks key j for
query i when j > i (blocks of equal, aligned positions only); ``mask`` (B, 1,
Lq, Lk) bool, in its place, says which keys each query sees (document
masking, ``meshwise.layout.documents``): a query that sees none of the block's
keys gets a zero output and a log-sum-exp of -inf, so merging ignores it.

On the CPU with no dropout the block runs as PyTorch's fused flash-attention
kernel for the CPU, which takes grouped heads as they are and whose memory is
O(Lq x tile). Elsewhere, and with dropout (``keep``: the keep-mask of a range of
key columns, scaled by 1/(1-p), as FlashAttention applies it to P), plain
PyTorch operations over ``KV_TILE`` keys at a time keep the memory O(Lq x tile)
(``meshwise.models.tiled_attention``).
"""

from __future__ import annotations

import torch

from meshwise.layout.documents import additive_mask
from meshwise.models.tiled_attention import (
    accumulation_dtype,
    merge,  # noqa: F401 - the ring merges with it
    tiled_backward,
    tiled_forward,
)

KV_TILE = 1024  # keys per tile in the plain formulation: (B, H, Lq, KV_TILE) scores at once

_aten = torch.ops.aten


def _fused(q: torch.Tensor, keep) -> bool:
    return keep is None and q.device.type == "cpu"


def block_forward(q, k, v, causal: bool, scale: float, keep=None, mask=None):
    """``(out, lse)``: out (B, H, Lq, d) in q's dtype, lse (B, H, Lq) accumulated."""
    if _fused(q, keep):
        extra = {} if mask is None else {"attn_mask": additive_mask(mask, q.dtype)}
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and mask is None, scale=scale, **extra)
        lse = lse.to(accumulation_dtype(q.dtype))
        if mask is not None:  # the kernel gives rows without a key a log-sum-exp of 0
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out, lse
    return tiled_forward(q, k, v, causal, scale, keep, _columns(mask), KV_TILE)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep=None,
                   mask=None):
    """``(dq, dk, dv)`` of this block, in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    if _fused(q, keep):
        extra = {} if mask is None else {"attn_mask": additive_mask(mask, q.dtype)}
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(acc), 0.0, causal and mask is None, scale=scale,
            **extra)  # any strides
        return dq.to(acc), dk.to(acc), dv.to(acc)
    return tiled_backward(dout, q, k, v, out, lse, causal, scale, keep, _columns(mask),
                          KV_TILE)


def _columns(mask):
    """``mask`` as the plain formulation asks for it: the columns of a tile of keys."""
    if mask is None:
        return None
    return lambda start, end: mask[..., start:end]
