"""Dropout whose masks do not depend on the layout: each element's draw is a hash
(SplitMix64's finaliser, Steele et al. 2014) of what it is (seed, step, global sample,
site, head, global position), computed on the device, so any layout drops exactly what
one process drops, beyond what Megatron-LM's RNG tracker guarantees.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from meshwise.geometry.sequence import SequenceShard
from meshwise.models.context import WHOLE, ForwardContext

# SplitMix64's constants, as the signed 64-bit integers torch computes with.
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of ``z + gamma``, elementwise (a new tensor)."""
    z = z + _GAMMA
    z = (z ^ _shift_right(z, 30)).mul_(_MIX1)
    z = (z ^ _shift_right(z, 27)).mul_(_MIX2)
    return z.bitwise_xor_(_shift_right(z, 31))


def keep_mask(
    context: ForwardContext,
    site: str,
    shape: torch.Size,
    p: float,
    device,
    per_head: bool = False,
    elements: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep-mask, scaled by 1/(1-p), of ``context``'s samples at ``site``, shape (B, ...); with
    ``per_head`` dim 1 holds this rank's attention heads.

    ``elements``: each element's int64 index in its sample (and head), broadcastable to
    ``shape`` without its leading dims; default: whole (B, H, T, T) weights for ``per_head``,
    else a residual-stream activation (B, T, ...) of this rank's tokens (``stream_elements``).
    """
    base = zlib.crc32(f"{context.seed}:{context.step}:{site}".encode())
    first = context.first_sample
    samples = torch.arange(first, first + shape[0], device=device)
    key = _splitmix(_splitmix(samples) ^ base)  # (B,)
    lead = 1
    if per_head:  # local head i is global head tp_rank * local_heads + i
        heads = torch.arange(
            context.tp_rank * shape[1], (context.tp_rank + 1) * shape[1], device=device
        )
        key = _splitmix(key[:, None] ^ _splitmix(heads)[None, :])  # (B, H)
        lead = 2
    if elements is None and per_head:
        elements = torch.arange(math.prod(shape[lead:]), device=device).view(shape[lead:])
    elif elements is None:
        elements = stream_elements(context.tokens, shape, device)
    elements = elements.expand(shape[lead:]).reshape(-1)  # place in its slice
    bits = _splitmix(key.reshape(*key.shape, 1) ^ _splitmix(elements))
    uniform = _shift_right(bits, 40).to(torch.float32) * 2.0**-24  # 24 random bits
    keep = (uniform >= p).view(shape)
    return keep.to(torch.float32) / (1.0 - p)


def stream_elements(tokens: SequenceShard, shape: torch.Size, device) -> torch.Tensor:
    """Indices in their sample of the elements of a (B, T_held, ...) activation of the
    residual stream: ``position * inner + i``, as one process numbers them."""
    inner = math.prod(shape[2:])
    rows = tokens.stream_positions(shape[1], device)  # (T_held,)
    return (rows[:, None] * inner + torch.arange(inner, device=device)).view(shape[1:])


def attention_elements(
    q_positions: torch.Tensor, k_positions: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Indices of attention weights (query, key) in their sample and head: the place of
    ``(q, k)`` in the (T, T) matrix one process forms (Tq, Tk)."""
    return q_positions[:, None] * seq_len + k_positions[None, :]


class KeyedDropout(nn.Module):
    """Dropout of the activations at ``site`` with layout-independent masks, drawn for
    the elements the forward's ``context`` names."""

    def __init__(self, p: float, site: str):
        super().__init__()
        self.p, self.site = p, site

    def forward(self, x: torch.Tensor, context: ForwardContext | None = None) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        mask = keep_mask(context or WHOLE, self.site, x.shape, self.p, x.device)
        return x * mask.to(x.dtype)  # autograd saves the mask for the backward: never redrawn

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"
