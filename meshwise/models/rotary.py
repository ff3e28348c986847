"""Rotary position embedding (Su et al. 2021, RoFormer) in Hugging Face's rotate-half
layout, with Llama 3.1's context extension: each position's cos and sin, and their
rotation of queries and keys.
"""

from __future__ import annotations

import math

import torch

from meshwise.models.llama_config import LlamaConfig, rope_type_of


def rope_inverse_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """theta^(-2i/d) per pair of dimensions (RoFormer, eq. 15), in float32 on the CPU,
    computed as Hugging Face computes them so that imported models match it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if cfg.rope_scaling and rope_type_of(cfg.rope_scaling) == "llama3":
        inv_freq = _llama3_scaled(inv_freq, cfg.rope_scaling)
    return inv_freq  # (head_dim / 2,)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's context extension (Meta, "The Llama 3 Herd of Models", 2024):
    wavelengths longer than ``original / low_freq_factor`` are stretched by
    ``factor``, those shorter than ``original / high_freq_factor`` are kept, and
    the band between is interpolated linearly in ``original / wavelength``."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    blend = (original / wavelength - low) / (high - low)  # 0 at the long end, 1 at the short
    between = (1 - blend) * stretched / factor + blend * stretched
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(in_band, between, stretched)


class Rotary:
    """cos and sin of each position's rotation angles (not a module: it holds no
    parameters, and models hold no buffers). The inverse frequencies are
    computed once per device."""

    def __init__(self, cfg: LlamaConfig):
        self.cfg = cfg
        self._inv_freq: dict[str, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, ...]:
        """``positions``: (T,) positions of the tokens, or (B, T) per sequence (inside
        each document under document masking); returns (T, hd) each, or (B, 1, T, hd)."""
        key = str(positions.device)
        if torch.compiler.is_compiling():
            # In the graph, not memoised: a memo filled by the first call would change the
            # compiled code's guards and recompile it at the next step (--compile).
            inv_freq = rope_inverse_frequencies(self.cfg).to(positions.device)
        else:
            if key not in self._inv_freq:
                self._inv_freq[key] = rope_inverse_frequencies(self.cfg).to(positions.device)
            inv_freq = self._inv_freq[key]
        angles = positions.float()[..., None] * inv_freq  # (..., T, hd / 2)
        angles = torch.cat([angles, angles], dim=-1)  # (..., T, hd): both halves rotate alike
        if angles.dim() == 3:
            angles = angles.unsqueeze(1)  # (B, 1, T, hd): the same for every head
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Pairs dimension i with i + hd/2 (the layout of Hugging Face's Llama weights,
    not RoFormer's interleaved pairs): (x1, x2) -> (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # (B, h, T, hd) with (T, hd) or (B, 1, T, hd)
