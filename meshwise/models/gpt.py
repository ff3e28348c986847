"""A GPT (pre-LayerNorm, causal attention) that can be cut into pipeline chunks.

Every parameter is initialised from a generator seeded by ``(seed, name)``, so a
parameter starts the same whatever the layout: a pipeline chunk that builds only
layers 4..7, or a rank that keeps a slice of a matrix, gets exactly the values
the single-process model would have (DESIGN section 1).

Blocks live in ``self.blocks`` (a ModuleList); ``layer_ids`` holds their global
indices, which name their parameters (``blocks.5.attn.qkv.weight``) whatever
chunk they are in.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    block_size: int = 256
    vocab_size: int = 256


def param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed (not Python's salted ``hash``)."""
    return zlib.crc32(f"{seed}:{name}".encode())


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        # Output rows laid out head by head, (n_head, 3, head_dim), so a
        # contiguous split of the rows gives each tensor-parallel rank whole heads.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)  # (B, T, nh, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 style decoder. A chunk holds ``layers`` (global indices), plus the
    embeddings when ``has_embedding`` and the final norm, head and loss when
    ``has_head``. The head reuses the token embedding matrix (tied weights)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0, layers: range | None = None,
                 has_embedding: bool = True, has_head: bool = True):
        super().__init__()
        self.cfg = cfg
        self.layer_ids = list(range(cfg.n_layer) if layers is None else layers)
        self.has_embedding, self.has_head = has_embedding, has_head
        if has_embedding or has_head:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if has_embedding:
            self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in self.layer_ids)
        if has_head:
            self.ln_f = nn.LayerNorm(cfg.d_model)
        self.init_weights(seed)

    def global_name(self, local_name: str) -> str:
        """``blocks.0.x`` in a chunk starting at layer 4 is ``blocks.4.x`` globally."""
        if local_name.startswith("blocks."):
            _, idx, rest = local_name.split(".", 2)
            return f"blocks.{self.layer_ids[int(idx)]}.{rest}"
        return local_name

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            name = self.global_name(name)
            if name.endswith("bias") or ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            std = residual_std if name.endswith("proj.weight") else 0.02
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            full = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            p.copy_(full)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: token ids (B, T) on the first chunk, else hidden states (B, T, C).

        Returns hidden states, or with ``has_head`` the logits (B, T, V), or with
        ``targets`` the SUM of token losses (callers divide by global tokens).
        """
        if self.has_embedding:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if not self.has_head:
            return x
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
