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
PyTorch operations over ``KV_TILE`` keys at a time keep the memory O(Lq x tile).
"""

from __future__ import annotations

import torch

from meshwise.layout.documents import additive_mask

KV_TILE = 1024  # keys per tile in the plain formulation: (B, H, Lq, KV_TILE) scores at once

_aten = torch.ops.aten


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What outputs, log-sum-exps and gradients are summed in: at least fp32."""
    return torch.promote_types(dtype, torch.float32)


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
    return _plain_forward(q, k, v, causal, scale, keep, mask)


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
    return _plain_backward(dout, q, k, v, out, lse, causal, scale, keep, mask)


# ---------------------------------------------------------------- plain formulation
def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    B, H, L, d = x.shape
    return x.reshape(B, groups, H // groups, L, d)  # (B, G, H / G, L, d)


def _scores(qg, k_tile, start: int, causal: bool, scale: float, mask=None) -> torch.Tensor:
    """(B, G, H / G, Lq, tile) scores of keys ``start ..`` with the causal mask (or
    ``mask``'s columns of the tile) applied."""
    s = (qg @ k_tile.unsqueeze(2).transpose(-2, -1)) * scale
    if mask is not None:
        tile = mask[..., start:start + k_tile.shape[2]].unsqueeze(2)  # (B, 1, 1, Lq, tile)
        s = s.masked_fill(~tile, float("-inf"))
    elif causal:
        rows = torch.arange(qg.shape[3], device=qg.device)[:, None]
        cols = torch.arange(start, start + k_tile.shape[2], device=qg.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _plain_forward(q, k, v, causal: bool, scale: float, keep, mask=None):
    acc = accumulation_dtype(q.dtype)
    groups = k.shape[1]
    qg = _grouped(q.to(acc), groups)                      # (B, G, R, Lq, d)
    out = torch.zeros_like(qg)
    lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    for start in range(0, k.shape[2], KV_TILE):
        end = min(start + KV_TILE, k.shape[2])
        s = _scores(qg, k[:, :, start:end].to(acc), start, causal, scale, mask)
        m = s.amax(-1)                                    # (B, G, R, Lq)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no key here
        p = torch.exp(s - m.unsqueeze(-1))
        tile_lse = m + torch.log(p.sum(-1))               # -inf where no key is seen
        if keep is not None:
            p = p * _grouped(keep(start, end), groups).to(acc)
        o = p @ v[:, :, start:end].to(acc).unsqueeze(2)   # unnormalised, relative to m
        merge(out, lse, o, m, tile_lse)
    B, H, Lq, d = q.shape
    return out.reshape(B, H, Lq, d).to(q.dtype), lse.reshape(B, H, Lq)


def merge(out, lse, o, o_scale, o_lse) -> None:
    """In place: ``out``/``lse`` become the softmax over their keys and ``o``'s.

    ``out`` is normalised by ``exp(lse)``; ``o`` by ``exp(o_scale)`` (so a
    normalised block output has ``o_scale == o_lse``). Rows where both sides
    saw no key stay zero."""
    new = torch.logaddexp(lse, o_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    keep_old = torch.exp(lse - safe).unsqueeze(-1)
    take_new = torch.exp(o_scale - safe).unsqueeze(-1)
    out.mul_(keep_old).add_(o * take_new)
    lse.copy_(new)


def _plain_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep, mask=None):
    acc = accumulation_dtype(q.dtype)
    groups = k.shape[1]
    qg = _grouped(q.to(acc), groups)                      # (B, G, R, Lq, d)
    dog = _grouped(dout.to(acc), groups)
    lse_g = _grouped(lse.to(acc).unsqueeze(-1), groups)   # (B, G, R, Lq, 1)
    rowdot = (dog * _grouped(out.to(acc), groups)).sum(-1, keepdim=True)  # rowsum(dO * O)
    dq = torch.zeros_like(qg)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for start in range(0, k.shape[2], KV_TILE):
        end = min(start + KV_TILE, k.shape[2])
        k_tile, v_tile = k[:, :, start:end].to(acc), v[:, :, start:end].to(acc)
        p = torch.exp(_scores(qg, k_tile, start, causal, scale, mask) - lse_g)  # (B,G,R,Lq,t)
        dp = dog @ v_tile.unsqueeze(2).transpose(-2, -1)
        if keep is not None:
            mask = _grouped(keep(start, end), groups).to(acc)
            dv[:, :, start:end] = ((p * mask).transpose(-2, -1) @ dog).sum(2)
            dp = dp * mask
        else:
            dv[:, :, start:end] = (p.transpose(-2, -1) @ dog).sum(2)
        ds = p * (dp - rowdot) * scale
        dq += ds @ k_tile.unsqueeze(2)
        dk[:, :, start:end] = (ds.transpose(-2, -1) @ qg).sum(2)
    B, H, Lq, d = q.shape
    return dq.reshape(B, H, Lq, d), dk, dv
