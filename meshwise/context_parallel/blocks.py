"""Attention of one block of queries over one block of keys with its log-sum-exp, and its
backward from the row's final out and lse (Dao et al. 2022, algorithm 4), for the ring:
PyTorch's fused kernels without dropout, ``tiled_attention`` with it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from meshwise.geometry.documents import additive_mask
from meshwise.models.attention_kernels import expand_heads
from meshwise.models.tiled_attention import (
    accumulation_dtype,
    merge,  # noqa: F401 - the ring merges with it
    tiled_backward,
    tiled_forward,
)

KV_TILE = 1024  # keys per tile in the plain formulation: (B, H, Lq, KV_TILE) scores at once
_FUSED_CUDA = (torch.float16, torch.bfloat16, torch.float32)
_LSE_ALIGN = 32  # the memory-efficient kernel's log-sum-exp rows are padded to this
_BIAS_ALIGN = 16  # and the rows of its bias must start at multiples of this many elements

_aten = torch.ops.aten


def _fused(q: torch.Tensor, keep) -> bool:
    if keep is not None:
        return False
    return q.device.type == "cpu" or (q.device.type == "cuda" and q.dtype in _FUSED_CUDA)


def block_forward(q, k, v, causal: bool, scale: float, keep=None, mask=None):
    """``(out, lse)``: out (B, H, Lq, d) in q's dtype, lse (B, H, Lq) accumulated.

    q (B, H, Lq, d); k, v (B, G, Lk, d), G dividing H. ``causal`` masks key j for query i when
    j > i (equal, aligned blocks); ``mask`` (B or 1, 1, Lq, Lk) bool in its place (documents,
    a window): a query that sees no key gets a zero output and lse -inf, which merging
    ignores. ``keep``: the dropout keep-mask of key columns, scaled by 1/(1-p).
    """
    if not _fused(q, keep):
        return tiled_forward(q, k, v, causal, scale, keep, _columns(mask), KV_TILE)
    if q.device.type == "cuda":
        return _cuda_forward(q, k, v, causal, scale, mask)
    extra = {} if mask is None else {"attn_mask": additive_mask(mask, q.dtype)}
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal and mask is None, scale=scale, **extra
    )
    lse = lse.to(accumulation_dtype(q.dtype))
    if mask is not None:  # the kernel gives rows without a key a log-sum-exp of 0
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep=None, mask=None):
    """``(dq, dk, dv)`` of this block, in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    if not _fused(q, keep):
        return tiled_backward(dout, q, k, v, out, lse, causal, scale, keep, _columns(mask), KV_TILE)
    if q.device.type == "cuda":
        return _cuda_backward(dout, q, k, v, out, lse, causal, scale, mask)
    extra = {} if mask is None else {"attn_mask": additive_mask(mask, q.dtype)}
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.to(acc), 0.0, causal and mask is None, scale=scale, **extra
    )  # any strides
    return dq.to(acc), dk.to(acc), dv.to(acc)


def _columns(mask):
    """``mask`` as the plain formulation asks for it: the columns of a tile of keys."""
    if mask is None:
        return None
    return lambda start, end: mask[..., start:end]


# ---------------------------------------------------------------- CUDA's fused kernels
# The fused kernels that return their log-sum-exp and whose backward takes a given out and
# lse are private aten operators, the ones PyTorch's own context parallelism calls: no
# public API has both (flex_attention's return_lse has no gradient input for it). On the
# CPU, its flash kernel (grouped heads as they are); on CUDA, flash (bf16 / fp16, no mask)
# or memory-efficient (fp32, or a mask as an additive bias), with equal head counts: the
# key/value heads are expanded and their gradients summed over each group.
def _flash(q: torch.Tensor, mask) -> bool:
    """Whether the flash kernel serves the block (else the memory-efficient one)."""
    d = q.shape[-1]
    return mask is None and q.dtype != torch.float32 and d % 8 == 0 and d <= 256


def _bias(mask: torch.Tensor, q: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``mask`` as the memory-efficient kernel's additive bias: (B, H, Lq, Lk) in q's
    dtype, each row starting at a multiple of ``_BIAS_ALIGN`` elements (as SDPA pads
    a mask for it), broadcast over the heads without a copy."""
    B, H, Lq = q.shape[:3]
    padded = math.ceil(num_keys / _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.zeros(*mask.shape[:-1], padded, dtype=q.dtype, device=q.device)
    bias[..., :num_keys].masked_fill_(~mask, float("-inf"))
    return bias[..., :num_keys].expand(B, H, Lq, num_keys)


def _no_rng() -> torch.Tensor:
    # The kernels' dropout seed and offset, unread at dropout 0: what their forwards
    # return then (an empty CPU scalar).
    return torch.empty((), dtype=torch.long)


def _cuda_forward(q, k, v, causal: bool, scale: float, mask):
    heads = q.shape[1]
    q, k, v = q.contiguous(), expand_heads(k, heads), expand_heads(v, heads)  # (B, H, L, d)
    if _flash(q, mask):
        out, lse = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
        return out, lse.float()  # (B, H, Lq), natural log
    bias = None if mask is None else _bias(mask, q, k.shape[2])
    out, lse = _aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal and mask is None, scale=scale
    )[:2]
    lse = lse[..., : q.shape[2]].float()  # (B, H, Lq): the rows past Lq are padding
    if mask is not None:  # rows that see no key of the block: nothing, whatever the kernel
        seen = mask.any(-1)  # (B or 1, 1, Lq)
        out = torch.where(seen[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        lse = lse.masked_fill(~seen, float("-inf"))
    return out, lse


def _cuda_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask):
    acc = accumulation_dtype(q.dtype)
    B, heads, Lq = q.shape[:3]
    groups, Lk = k.shape[1], k.shape[2]
    q, dout, out = q.contiguous(), dout.contiguous(), out.contiguous()
    k, v = expand_heads(k, heads), expand_heads(v, heads)  # (B, H, Lk, d)
    lse = lse.float().contiguous()
    if _flash(q, mask):
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            Lq,
            Lk,
            0.0,
            causal,
            _no_rng(),
            _no_rng(),
            scale=scale,
        )
    else:
        if mask is not None and q.dtype != torch.float32:
            # Under a mask the kernel's bf16 backward gave NaN gradients on an H200
            # (torch 2.11) where its fp32 backward is exact: the backward runs in fp32.
            q, k, v, dout, out = (t.float() for t in (q, k, v, dout, out))
        bias = None if mask is None else _bias(mask, q, Lk)
        padded = math.ceil(Lq / _LSE_ALIGN) * _LSE_ALIGN
        lse = F.pad(lse, (0, padded - Lq), value=float("inf"))  # as its forward pads it
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            k,
            v,
            bias,
            out,
            lse,
            _no_rng(),
            _no_rng(),
            0.0,
            [True, True, True, False],
            causal and mask is None,
            scale=scale,
        )

    def per_group(grad):  # (B, H, Lk, d) -> (B, G, Lk, d): each group's heads summed
        return grad.to(acc).view(B, groups, heads // groups, Lk, -1).sum(2)

    return dq.to(acc), per_group(dk), per_group(dv)
