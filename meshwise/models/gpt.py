"""A GPT-2 style decoder (pre-LayerNorm, causal attention), plain single-device code.

``gpt_plan`` lays it out and ``gpt_init`` gives its initial values. It returns logits
(hidden states on a stage without the head), so a tp head keeps its logits split; its
layers live in ``blocks`` keyed by global index, so names never depend on the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshwise.geometry.init import ONES, ZEROS, Init, init_module, normal
from meshwise.geometry.plan import ParallelPlan
from meshwise.models.attention import Positions, ScaledDotProductAttention
from meshwise.models.context import ForwardContext
from meshwise.models.dropout import KeyedDropout
from meshwise.models.kv_cache import LayerCache


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    block_size: int = 256
    vocab_size: int = 256
    dropout: float = 0.0  # embeddings, residual branches and attention weights


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, site: str):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        # Output rows laid out head by head, (n_head, 3, head_dim), so a split of the
        # rows (a column-parallel layer) gives each rank whole heads.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.sdpa = ScaledDotProductAttention(cfg.dropout, f"{site}.weights")
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        context: ForwardContext | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3 C): T of the output (more than x's under --sp)
        B, T = qkv.shape[:2]
        qkv = qkv.view(B, T, -1, 3, self.head_dim)  # (B, T, nh, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, nh, T, hd)
        causal = True
        if cache is not None:
            # Decoding one token after the cached prefix: it may see every key.
            causal = cache.k is None
            if not causal and T != 1:
                raise ValueError("with a filled KV cache, feed one token at a time")
            k, v = cache.append(k, v)  # (B, nh, P + T, hd)
        y = self.sdpa(q, k, v, causal, context=context)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_id: int):
        super().__init__()
        site = f"blocks.{layer_id}"
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, f"{site}.attn")
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop_attn = KeyedDropout(cfg.dropout, f"{site}.attn.out")
        self.drop_mlp = KeyedDropout(cfg.dropout, f"{site}.mlp.out")

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        context: ForwardContext | None = None,
    ) -> torch.Tensor:
        x = x + self.drop_attn(self.attn(self.ln1(x), cache, context), context)
        return x + self.drop_mlp(self.mlp(self.ln2(x)), context)


class GPT(nn.Module):
    """GPT-2 style decoder with a head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.positions = Positions()
        self.drop_embed = KeyedDropout(cfg.dropout, "embed")
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def init_weights(self, seed: int = 0) -> "GPT":
        """GPT-2's initial values (``gpt_init``), drawn as every layout draws them."""
        init_module(self, lambda name: gpt_init(self.cfg, name), seed)
        return self

    def forward(
        self,
        x: torch.Tensor,
        cache: list[LayerCache] | None = None,
        context: ForwardContext | None = None,
    ) -> torch.Tensor:
        """``x``: token ids (B, T) where the embedding is held, else hidden states
        (B, T, C). Returns logits (B, T, V) where the head is held, else hidden
        states. ``cache``: one ``LayerCache`` per layer (generation); ``context``:
        which samples, tokens and documents these are (default: whole sequences)."""
        if self.wte is not None:
            start = cache[0].length if cache else 0
            pos = self.positions(start, x.shape[1], x.device, context)  # (T,) or (B, T)
            x = self.wte(x) + self.wpe(pos)  # (B, T, C)
            if self.drop_embed is not None:
                x = self.drop_embed(x, context)
        for i, block in enumerate(self.blocks.values()):
            x = block(x, cache[i] if cache else None, context)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)  # (B, T, V)
        return x


def gpt_plan(cfg: GPTConfig) -> ParallelPlan:
    """Megatron-LM's layout (Shoeybi et al. 2019, section 3): heads and the MLP split over tp,
    the vocabulary for the tied embedding and head; under cp, positions and a ring.
    """
    return ParallelPlan(
        layers="blocks",
        first_stage=("wte", "wpe", "drop_embed"),
        last_stage=("ln_f", "lm_head"),
        tp=(
            ("wte", "vocab_embedding"),
            ("wpe", "position_embedding"),
            ("blocks.*.attn.qkv", "colwise"),
            ("blocks.*.attn.proj", "rowwise"),
            ("blocks.*.mlp.fc", "colwise"),
            ("blocks.*.mlp.proj", "rowwise"),
            ("lm_head", "vocab_head"),
        ),
        cp=(("positions", "positions"), ("blocks.*.attn.sdpa", "ring_attention")),
        ties=(("wte.weight", "lm_head.weight"),),
    )


def gpt_init(cfg: GPTConfig, name: str) -> Init:
    """GPT-2's initialisation: N(0, 0.02), residual projections scaled by
    1/sqrt(2 n_layer), biases zero, LayerNorms one/zero."""
    if name.endswith(".bias"):
        return ZEROS
    if ".ln" in name or name.startswith("ln_f"):
        return ONES
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        return normal(0.02 / math.sqrt(2 * cfg.n_layer))
    return normal(0.02)


def check_gpt_tp(cfg: GPTConfig, tp: int) -> None:
    """Tensor parallelism splits whole attention heads."""
    if cfg.n_head % tp:
        raise ValueError(
            f"--n-head {cfg.n_head} is not divisible by --tp {tp}: tensor "
            "parallelism splits whole attention heads"
        )
