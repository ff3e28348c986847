"""A GPT (pre-LayerNorm, causal attention) that can be cut into pipeline chunks.

Every parameter is initialised from a generator seeded by ``(seed, name)``, so a
parameter starts the same whatever the layout: a pipeline chunk that builds only
layers 4..7, or a rank that keeps a slice of a matrix, gets exactly the values
the single-process model would have (DESIGN section 1).

Blocks live in ``self.blocks`` (a ModuleList); ``layer_ids`` holds their global
indices, which name their parameters (``blocks.5.attn.qkv.weight``) whatever
chunk they are in.

With a tensor-parallel group (Megatron-LM, Shoeybi et al. 2019, section 3) the
heads are split across tp ranks (QKV column-parallel, output projection
row-parallel), the MLP is column then row parallel, and the tied embedding /
head is vocab-parallel with a loss that never gathers the logits. Without one,
the same layers are plain ``F.linear`` / ``F.embedding``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshwise.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                             VocabParallelEmbedding,
                                             vocab_parallel_cross_entropy)
from meshwise.models.dropout import DropoutContext, KeyedDropout
from meshwise.tensor_parallel.mappings import tp_rank_of, tp_size_of


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    block_size: int = 256
    vocab_size: int = 256
    dropout: float = 0.0  # embeddings, residual branches and attention weights


def param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed (not Python's salted ``hash``)."""
    return zlib.crc32(f"{seed}:{name}".encode())


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, name: str, seed: int, tp_group, residual_std: float,
                 dropout: DropoutContext | None = None):
        super().__init__()
        tp = tp_size_of(tp_group)
        if cfg.n_head % tp:
            raise ValueError(f"n_head {cfg.n_head} is not divisible by tp {tp}")
        self.head_dim = cfg.d_model // cfg.n_head
        local_heads = cfg.n_head // tp
        first = tp_rank_of(tp_group) * local_heads
        self.heads = list(range(first, first + local_heads))  # global indices of ours
        self.p_attn, self.site, self.dropout = cfg.dropout, f"{name}.weights", dropout
        # Output rows laid out head by head, (n_head, 3, head_dim), so the
        # column split gives each tensor-parallel rank whole heads.
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.d_model, tp_group,
                                        init_seed=param_seed(seed, f"{name}.qkv.weight"))
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, tp_group, init_std=residual_std,
                                      init_seed=param_seed(seed, f"{name}.proj.weight"))

    def forward(self, x: torch.Tensor, cache: "LayerCache | None" = None) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)  # (B, T, nh/tp, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, nh/tp, T, hd)
        causal = True
        if cache is not None:
            # Decoding one token after the cached prefix: it may see every key.
            causal = cache.k is None
            if not causal and T != 1:
                raise ValueError("with a filled KV cache, feed one token at a time")
            k, v = cache.append(k, v)  # (B, nh/tp, P + T, hd)
        if self.training and self.p_attn:
            y = self._attend_with_dropout(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, nh/tp, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C/tp)
        return self.proj(y)


    def _attend_with_dropout(self, q, k, v) -> torch.Tensor:
        """Causal attention with the weights dropped per (sample, global head)."""
        T = q.shape[2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh/tp, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = torch.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        keep = self.dropout.mask(self.site, att.shape, self.p_attn, att.device, self.heads)
        return (att * keep.to(att.dtype)) @ v  # (B, nh/tp, T, hd)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, name: str, seed: int, tp_group, residual_std: float):
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.d_model, 4 * cfg.d_model, tp_group,
                                       init_seed=param_seed(seed, f"{name}.fc.weight"))
        self.proj = RowParallelLinear(4 * cfg.d_model, cfg.d_model, tp_group,
                                      init_std=residual_std,
                                      init_seed=param_seed(seed, f"{name}.proj.weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_id: int, seed: int, tp_group,
                 dropout: DropoutContext | None = None):
        super().__init__()
        name = f"blocks.{layer_id}"
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scaled residual init
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, f"{name}.attn", seed, tp_group, residual_std,
                                        dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, f"{name}.mlp", seed, tp_group, residual_std)
        self.drop_attn = KeyedDropout(cfg.dropout, f"{name}.attn.out", dropout)
        self.drop_mlp = KeyedDropout(cfg.dropout, f"{name}.mlp.out", dropout)

    def forward(self, x: torch.Tensor, cache: "LayerCache | None" = None) -> torch.Tensor:
        x = x + self.drop_attn(self.attn(self.ln1(x), cache))
        return x + self.drop_mlp(self.mlp(self.ln2(x)))


class LayerCache:
    """One layer's keys and values so far, for decoding without recomputing the prefix."""

    def __init__(self):
        self.k: torch.Tensor | None = None  # (B, nh/tp, P, hd)
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class GPT(nn.Module):
    """GPT-2 style decoder. A chunk holds ``layers`` (global indices), plus the
    embeddings when ``has_embedding`` and the final norm, head and loss when
    ``has_head``. The head reuses the token embedding matrix (tied weights); a
    pipeline's last stage holds its own copy, kept in sync by the trainer."""

    def __init__(self, cfg: GPTConfig, seed: int = 0, layers: range | None = None,
                 has_embedding: bool = True, has_head: bool = True, tp_group=None,
                 dropout: DropoutContext | None = None):
        super().__init__()
        self.cfg, self.tp_group = cfg, tp_group
        if cfg.dropout and dropout is None:
            dropout = DropoutContext(seed)  # one process: steps and samples from 0
        self.dropout = dropout
        self.layer_ids = list(range(cfg.n_layer) if layers is None else layers)
        self.has_embedding, self.has_head = has_embedding, has_head
        if has_embedding or has_head:
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group,
                                              init_seed=param_seed(seed, "wte.weight"))
        if has_embedding:
            self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
            with torch.no_grad():
                gen = torch.Generator().manual_seed(param_seed(seed, "wpe.weight"))
                self.wpe.weight.normal_(0.0, 0.02, generator=gen)
        self.blocks = nn.ModuleList(Block(cfg, i, seed, tp_group, dropout)
                                    for i in self.layer_ids)
        self.drop_embed = KeyedDropout(cfg.dropout, "embed", dropout)
        if has_head:
            self.ln_f = nn.LayerNorm(cfg.d_model)

    def global_name(self, local_name: str) -> str:
        """``blocks.0.x`` in a chunk starting at layer 4 is ``blocks.4.x`` globally."""
        if local_name.startswith("blocks."):
            _, idx, rest = local_name.split(".", 2)
            return f"blocks.{self.layer_ids[int(idx)]}.{rest}"
        return local_name

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                cache: list[LayerCache] | None = None) -> torch.Tensor:
        """``x``: token ids (B, T) on the first chunk, else hidden states (B, T, C).

        Returns hidden states, or with ``has_head`` the full logits (B, T, V), or
        with ``targets`` the SUM of token losses (callers divide by global tokens).
        ``cache``: one ``LayerCache`` per block, filled as tokens go through
        (generation); positions continue after what it holds.
        """
        if self.has_embedding:
            start = cache[0].length if cache else 0
            pos = torch.arange(start, start + x.shape[1], device=x.device)
            x = self.drop_embed(self.wte(x) + self.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cache[i] if cache else None)
        if not self.has_head:
            return x
        x = self.ln_f(x)
        if targets is None:
            return self.wte.logits(x, gather_output=True)  # (B, T, V)
        logits = self.wte.logits(x)  # (B, T, V_padded/tp)
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group,
                                            vocab_size=self.cfg.vocab_size, reduction="sum")
