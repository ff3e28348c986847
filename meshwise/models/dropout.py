"""Dropout whose masks do not depend on the layout.

A dropout mask drawn from a process's RNG depends on which rank draws it and in
what order, so the same run laid out differently would drop different elements.
Here every element's draw is a hash of what the element *is*: the run's seed,
the step, the sample's index in the global batch, the site in the model
(``blocks.3.attn``), for attention weights the head, and the element's place
in its sample (and head), counted in global positions of the sequence: a rank
that holds only some tokens of each sequence (context parallelism's zigzag
chunks, sequence parallelism's slices; ``meshwise.layout.sequence``) draws the
masks of those tokens as one process draws them. The hash (SplitMix64's finaliser, Steele et al.
2014) runs as a few integer kernels over the whole activation on its device:
no generator per sample or head, nothing read on the host. So:

- tp ranks holding replicated activations (the residual stream, embeddings)
  draw the same mask, and those holding different heads draw different ones,
  as Megatron-LM's RNG tracker arranges;
- dp ranks draw different masks because they hold different samples;
- cp and sp ranks draw different masks because they hold different tokens;
- and beyond what Megatron guarantees, any layout (dp, tp, pp, cp, sp,
  micro-batches, accumulation, ZeRO stage) draws exactly the masks one process
  would, so the loss curve stays layout-independent with dropout on.

Which step, samples, tokens and heads a forward computes comes with it, in its
``ForwardContext`` (``meshwise.models.context``); the masks are saved by
autograd for the backward, never redrawn.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from meshwise.layout.sequence import SequenceShard
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


def keep_mask(context: ForwardContext, site: str, shape: torch.Size, p: float, device,
              per_head: bool = False, elements: torch.Tensor | None = None) -> torch.Tensor:
    """Keep-mask scaled by 1/(1-p) of the elements of ``context``'s samples at ``site``,
    shape ``shape`` = (B, ...); with ``per_head`` dim 1 holds this rank's attention
    heads (for attention weights).

    ``elements``: each element's index in its sample (or sample and head), int64,
    broadcastable to ``shape`` without its leading dims; default: for
    ``per_head``, the weights of whole sequences (B, H, T, T) in order; else a
    residual-stream activation (B, T, ...) whose dim 1 holds the tokens this rank
    keeps between the tensor-parallel layers (``stream_elements``)."""
    base = zlib.crc32(f"{context.seed}:{context.step}:{site}".encode())
    first = context.first_sample
    samples = torch.arange(first, first + shape[0], device=device)
    key = _splitmix(_splitmix(samples) ^ base)  # (B,)
    lead = 1
    if per_head:  # local head i is global head tp_rank * local_heads + i
        heads = torch.arange(context.tp_rank * shape[1], (context.tp_rank + 1) * shape[1],
                             device=device)
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


def attention_elements(q_positions: torch.Tensor, k_positions: torch.Tensor,
                       seq_len: int) -> torch.Tensor:
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
        return x * mask.to(x.dtype)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"
