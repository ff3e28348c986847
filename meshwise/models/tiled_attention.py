"""Attention over a tile of keys at a time, with its log-sum-exp, in plain PyTorch: the
online softmax (Milakov & Gimelshein 2018) as FlashAttention computes it (Dao et al.
2022, algorithm 4 for the backward). It keeps attention dropout exact at O(Lq x tile)
memory and serves ring attention's blocks where no fused kernel does.
"""

from __future__ import annotations

import torch

KV_TILE = 1024  # keys per tile: (B, H, Lq, KV_TILE) scores at once


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What outputs, log-sum-exps and gradients are summed in: at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    B, H, L, d = x.shape
    return x.reshape(B, groups, H // groups, L, d)  # (B, G, H / G, L, d)


def _scores(qg, k_tile, start: int, causal: bool, scale: float, allowed=None) -> torch.Tensor:
    """(B, G, H / G, Lq, tile) scores of keys ``start ..`` with the causal mask (or
    ``allowed``'s columns of the tile) applied."""
    s = (qg @ k_tile.unsqueeze(2).transpose(-2, -1)) * scale
    end = start + k_tile.shape[2]
    if allowed is not None:
        s = s.masked_fill(~allowed(start, end).unsqueeze(2), float("-inf"))  # (B,1,1,Lq,t)
    elif causal:
        rows = torch.arange(qg.shape[3], device=qg.device)[:, None]
        cols = torch.arange(start, end, device=qg.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def tiled_forward(
    q, k, v, causal: bool, scale: float, keep=None, allowed=None, tile: int = KV_TILE
):
    """``(out, lse)``: out (B, H, Lq, d) in q's dtype, lse (B, H, Lq) accumulated.

    q (B, H, Lq, d); k, v (B, G, Lk, d), G dividing H (never repeated). ``causal`` masks key
    j for query i when j > i; ``allowed(start, end)`` in its place gives the keys each query
    sees ((B or 1, 1, Lq, end - start) bool); a query that sees none gets a zero output and
    lse -inf. ``keep``: the keep-mask of key columns ``start .. end``, scaled, applied to P.
    """
    acc = accumulation_dtype(q.dtype)
    groups = k.shape[1]
    qg = _grouped(q.to(acc), groups)  # (B, G, R, Lq, d)
    out = torch.zeros_like(qg)
    lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    for start in range(0, k.shape[2], tile):
        end = min(start + tile, k.shape[2])
        s = _scores(qg, k[:, :, start:end].to(acc), start, causal, scale, allowed)
        m = s.amax(-1)  # (B, G, R, Lq)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no key here
        p = torch.exp(s - m.unsqueeze(-1))
        tile_lse = m + torch.log(p.sum(-1))  # -inf where no key is seen
        if keep is not None:
            p = p * _grouped(keep(start, end), groups).to(acc)
        o = p @ v[:, :, start:end].to(acc).unsqueeze(2)  # unnormalised, relative to m
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


def tiled_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    causal: bool,
    scale: float,
    keep=None,
    allowed=None,
    tile: int = KV_TILE,
):
    """``(dq, dk, dv)`` in the accumulation dtype, given the final ``out`` and ``lse``."""
    # Per tile, from the final out and lse: P = exp(S - lse), dS = P (dP - rowsum(dout * out)).
    acc = accumulation_dtype(q.dtype)
    groups = k.shape[1]
    qg = _grouped(q.to(acc), groups)  # (B, G, R, Lq, d)
    dog = _grouped(dout.to(acc), groups)
    lse_g = _grouped(lse.to(acc).unsqueeze(-1), groups)  # (B, G, R, Lq, 1)
    rowdot = (dog * _grouped(out.to(acc), groups)).sum(-1, keepdim=True)  # rowsum(dO * O)
    dq = torch.zeros_like(qg)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for start in range(0, k.shape[2], tile):
        end = min(start + tile, k.shape[2])
        k_tile, v_tile = k[:, :, start:end].to(acc), v[:, :, start:end].to(acc)
        p = torch.exp(_scores(qg, k_tile, start, causal, scale, allowed) - lse_g)  # (B,G,R,Lq,t)
        dp = dog @ v_tile.unsqueeze(2).transpose(-2, -1)
        if keep is not None:
            kept = _grouped(keep(start, end), groups).to(acc)
            dv[:, :, start:end] = ((p * kept).transpose(-2, -1) @ dog).sum(2)
            dp = dp * kept
        else:
            dv[:, :, start:end] = (p.transpose(-2, -1) @ dog).sum(2)
        ds = p * (dp - rowdot) * scale
        dq += ds @ k_tile.unsqueeze(2)
        dk[:, :, start:end] = (ds.transpose(-2, -1) @ qg).sum(2)
    B, H, Lq, d = q.shape
    return dq.reshape(B, H, Lq, d), dk, dv


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, keep, allowed, tile):
        out, lse = tiled_forward(q, k, v, causal, scale, keep, allowed, tile)
        ctx.args = causal, scale, keep, allowed, tile
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = tiled_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def tiled_attention(
    q, k, v, causal: bool, scale: float, keep=None, allowed=None, tile: int = KV_TILE
) -> torch.Tensor:
    """Attention of whole rows, differentiable, holding (B, H, Lq, tile) scores at a
    time in the forward and in the backward. ``keep`` is called again in the
    backward (the masks are keyed: drawing them again gives the same ones)."""
    return _TiledAttention.apply(q, k, v, causal, scale, keep, allowed, tile)
