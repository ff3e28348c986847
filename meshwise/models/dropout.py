"""Dropout whose masks do not depend on the layout.

A dropout mask drawn from a process's RNG depends on which rank draws it and in
what order, so the same run laid out differently would drop different elements.
Here every mask is drawn from a generator seeded by what the element *is*: the
run's seed, the step, the sample's index in the global batch, the site in the
model (``blocks.3.attn``), and for attention weights the head. So:

- tp ranks holding replicated activations (the residual stream, embeddings)
  draw the same mask, and those holding different heads draw different ones,
  as Megatron-LM's RNG tracker arranges;
- dp ranks draw different masks because they hold different samples;
- and beyond what Megatron guarantees, any layout (dp, tp, pp, micro-batches,
  accumulation, ZeRO stage) draws exactly the masks one process would, so the
  loss curve stays layout-independent with dropout on.

The trainer says which step and samples a forward computes with
``DropoutContext.at(step, first_sample)``; the masks are saved by autograd for
the backward, never redrawn.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn


class DropoutContext:
    """Where in training the next forward is: the seed, the step, its first sample.

    ``tp_rank``: this rank's place on the tensor-parallel axis (the trainer sets
    it): a rank holding heads 4..7 draws their masks.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self.step = 0
        self.first_sample = 0
        self.tp_rank = 0

    def __deepcopy__(self, memo):
        # One context per rank, shared by every copy of the model (pipeline chunks).
        return self

    def at(self, step: int, first_sample: int) -> None:
        self.step, self.first_sample = step, first_sample

    def mask(self, site: str, shape: torch.Size, p: float, device,
             per_head: bool = False) -> torch.Tensor:
        """Keep-mask scaled by 1/(1-p), shape ``shape`` = (B, ...); with ``per_head``
        dim 1 holds this rank's attention heads (for attention weights)."""
        heads = None
        if per_head:  # local head i is global head tp_rank * local_heads + i
            heads = range(self.tp_rank * shape[1], (self.tp_rank + 1) * shape[1])
        rows = []
        for b in range(shape[0]):
            sample = self.first_sample + b
            parts = [None] if heads is None else heads
            draws = []
            for head in parts:
                key = zlib.crc32(f"{self.seed}:{self.step}:{sample}:{site}:{head}".encode())
                gen = torch.Generator(device=device).manual_seed(key)
                size = shape[1:] if heads is None else shape[2:]
                draws.append(torch.rand(size, generator=gen, device=device))
            rows.append(draws[0] if heads is None else torch.stack(draws))
        keep = torch.stack(rows) >= p
        return keep.to(torch.float32) / (1.0 - p)


class KeyedDropout(nn.Module):
    """Dropout of the activations at ``site`` with layout-independent masks."""

    def __init__(self, p: float, site: str, context: DropoutContext | None):
        super().__init__()
        if p and context is None:
            raise ValueError("dropout needs a DropoutContext")
        self.p, self.site, self.context = p, site, context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return x * self.context.mask(self.site, x.shape, self.p, x.device).to(x.dtype)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"
