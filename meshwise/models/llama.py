"""A Llama decoder (Touvron et al. 2023), plain single-device code: RMSNorm (Zhang &
Sennrich 2019), rotary positions (Su et al. 2021) in Hugging Face's rotate-half layout,
SwiGLU (Shazeer 2020), grouped-query attention (Ainslie et al. 2023); Qwen2, Qwen3 and
Mistral as switches. Modules carry Hugging Face's names without ``model.``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshwise.geometry.init import ONES, ZEROS, Init, init_module, normal
from meshwise.geometry.plan import ParallelPlan
from meshwise.models.attention import Positions, ScaledDotProductAttention
from meshwise.models.attention_masks import window_mask  # noqa: F401 - the window's rule
from meshwise.models.context import ForwardContext
from meshwise.models.kv_cache import LayerCache
from meshwise.models.moe import MoE, check_moe_config, is_moe_layer

ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a Llama; ``rope_scaling``: None, or Hugging Face's ``llama3`` dict."""

    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 128
    ffn_hidden_size: int = 384
    block_size: int = 256  # the longest context (rotary positions need no table)
    vocab_size: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    rope_scaling: dict | None = field(default=None, hash=False)
    dropout: float = 0.0
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    head_size: int = 0  # 0: d_model / n_head
    sliding_window: int = 0  # 0: full causal attention (Mistral: its window)
    hf_type: str = "llama"  # the Hugging Face model_type it reads from and exports to
    # Mixture of experts (docs/moe.md): 0 experts is a dense MLP in every layer.
    n_experts: int = 0
    experts_per_token: int = 2  # top-k
    moe_ffn_hidden_size: int = 0  # each expert's SwiGLU width (0: ffn_hidden_size)
    norm_topk_prob: bool = True  # the top-k weights renormalised to sum 1
    router_score: str = "softmax"  # or "sigmoid" (DeepSeek-V3, with a routing bias)
    shared_expert_size: int = 0  # a shared SwiGLU expert on every token (0: none)
    shared_expert_gate: bool = False  # Qwen2-MoE: its output times sigmoid(Linear(x))
    first_dense_layers: int = 0
    moe_every: int = 1  # layer i is MoE iff i >= first_dense_layers and (i + 1) % moe_every == 0
    aux_loss_coef: float = 0.0
    aux_loss_formula: str = "per-layer"  # or "hf-concatenated" (transformers', pp 1 only)
    bias_update_rate: float = 0.0

    def __post_init__(self):
        if not self.head_size and self.d_model % self.n_head:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --n-head {self.n_head}")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            valid = [k for k in range(1, self.n_head + 1) if self.n_head % k == 0]
            raise ValueError(
                f"--n-kv-head {self.n_kv_head} does not divide --n-head "
                f"{self.n_head} (each key/value head serves a whole group of "
                f"query heads); valid: {', '.join(map(str, valid))}"
            )
        if self.dropout:
            raise ValueError(
                f"--dropout {self.dropout}: the llama family trains without "
                "dropout, as Llama does; valid: 0"
            )
        if self.n_experts:
            check_moe_config(self)
        rope_type = rope_type_of(self.rope_scaling)
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; valid: "
                f"{', '.join(ROPE_TYPES)} (or no rope_scaling)"
            )

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_head


def rope_type_of(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


# ---------------------------------------------------------------- rotary embedding
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


# ---------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean of squares taken in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim, self.window = cfg.head_dim, cfg.sliding_window
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, q, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, kv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, kv, bias=cfg.qkv_bias)
        if cfg.qk_norm:  # one weight over a head's dims, shared by every head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        # Query head i reads key/value head i // (n_head / n_kv_head); a tp shard holds
        # whole groups, and the key/value heads reach attention unrepeated (only a
        # kernel that needs equal head counts repeats them, inside the call).
        self.sdpa = ScaledDotProductAttention()
        self.o_proj = nn.Linear(q, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope,
        cache: LayerCache | None = None,
        context: ForwardContext | None = None,
    ) -> torch.Tensor:
        """``rope(length, device, dtype)``: cos and sin at the positions of the
        ``length`` tokens whose queries this forward holds; ``context``: the forward's
        (its documents)."""
        q = self.q_proj(x)  # (B, T, C): T of the output (more than x's under --sp)
        B, T = q.shape[:2]
        q = q.view(B, T, -1, self.head_dim)  # (B, T, nh, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, nkv, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh or nkv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        cos, sin = rope(T, x.device, x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        causal = True
        if cache is not None:
            # Decoding one token after the cached prefix: it may see every key.
            causal = cache.k is None
            if not causal and T != 1:
                raise ValueError("with a filled KV cache, feed one token at a time")
            k, v = cache.append(k, v)  # (B, nkv, P + T, hd)
        y = self.sdpa(q, k, v, causal, window=self.window, context=context)  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); ``width``: its hidden size (default the
    config's ``ffn_hidden_size``)."""

    def __init__(self, cfg: LlamaConfig, width: int = 0):
        super().__init__()
        width = width or cfg.ffn_hidden_size
        self.gate_proj = nn.Linear(cfg.d_model, width, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))  # (B, T, C)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, keeping only ``gate`` and ``up`` for the backward."""
    if not torch.is_grad_enabled():
        return F.silu(gate) * up
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    """SwiGLU that recomputes ``silu(gate)`` in backward (as Megatron-LM's fused SwiGLU does):
    one (tokens, ffn) activation less per layer, gradients equal to autograd's bit for bit.
    """

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_up = F.silu(gate).mul_(grad)
        grad_gate = grad * up
        # autograd's own kernels (grad * up, grad * silu, ATen's silu_backward) plus the
        # recomputed silu: the fourth kernel is the price of the activation not kept.
        # In place: silu_backward reads each element before writing it.
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, grad_up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if is_moe_layer(cfg, layer):
            shared = MLP(cfg, cfg.shared_expert_size) if cfg.shared_expert_size else None
            self.mlp: nn.Module = MoE(cfg, layer, shared)
        else:
            self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope,
        cache: LayerCache | None = None,
        context: ForwardContext | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, context)
        if isinstance(self.mlp, MoE):
            router = context.router if context is not None else None
            return x + self.mlp(self.post_attention_layernorm(x), router)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """A Llama decoder: token ids in, logits out (``LlamaForCausalLM``'s computation)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.positions = Positions()
        self.rotary = Rotary(cfg)

    def init_weights(self, seed: int = 0) -> "Llama":
        """Hugging Face's initial values (``llama_init``), drawn as every layout draws them."""
        init_module(
            self, lambda name: llama_init(self.cfg, name), seed, llama_plan(self.cfg).logical_name
        )
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
        which tokens and documents these are (default: whole sequences)."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (B, T, C)
        start = cache[0].length if cache else 0
        tables = {}

        def rope(length: int, device, dtype):
            # Asked by each attention for the tokens of its queries (under sequence
            # parallelism more than the layers' input holds); computed once per forward.
            if torch.compiler.is_compiling():  # in each layer's graph, fused: no memo to guard
                return self.rotary(self.positions(start, length, device, context), dtype)
            key = (length, str(device), dtype)
            if key not in tables:
                tables[key] = self.rotary(self.positions(start, length, device, context), dtype)
            return tables[key]

        for i, layer in enumerate(self.layers.values()):
            x = layer(x, rope, cache[i] if cache else None, context)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)  # (B, T, V)
        return x


def llama_plan(cfg: LlamaConfig) -> ParallelPlan:
    """Megatron-LM's layout (Shoeybi et al. 2019, section 3) for Llama: whole query and
    key/value heads per tp rank, the vocabulary split; under cp, positions and a ring.
    """
    return ParallelPlan(
        layers="layers",
        first_stage=("embed_tokens",),
        last_stage=("norm", "lm_head"),
        tp=(
            ("embed_tokens", "vocab_embedding"),
            ("layers.*.self_attn.q_proj", "colwise"),
            ("layers.*.self_attn.k_proj", "colwise"),
            ("layers.*.self_attn.v_proj", "colwise"),
            ("layers.*.self_attn.o_proj", "rowwise"),
            *(
                (
                    ("layers.*.mlp.gate_proj", "colwise"),
                    ("layers.*.mlp.up_proj", "colwise"),
                    ("layers.*.mlp.down_proj", "rowwise"),
                )
                if any(not is_moe_layer(cfg, i) for i in range(cfg.n_layer))
                else ()
            ),
            *(
                (
                    ("layers.*.mlp.shared_expert.gate_proj", "colwise"),
                    ("layers.*.mlp.shared_expert.up_proj", "colwise"),
                    ("layers.*.mlp.shared_expert.down_proj", "rowwise"),
                )
                if cfg.n_experts and cfg.shared_expert_size
                else ()
            ),
            ("lm_head", "vocab_head"),
            *(
                (
                    ("layers.*.self_attn.q_norm", "shard_norm"),
                    ("layers.*.self_attn.k_norm", "shard_norm"),
                )
                if cfg.qk_norm
                else ()
            ),
        ),
        cp=(("positions", "positions"), ("layers.*.self_attn.sdpa", "ring_attention")),
        ties=(("embed_tokens.weight", "lm_head.weight"),) if cfg.tie_embeddings else (),
        ep=(("layers.*.mlp.experts", "experts"),) if cfg.n_experts else (),
    )


def llama_init(cfg: LlamaConfig, name: str) -> Init:
    """Hugging Face's ``LlamaForCausalLM`` initialisation: N(0, 0.02) for every
    linear and embedding weight, ones for the RMSNorm weights, zeros for biases."""
    if name.endswith("norm.weight"):
        return ONES
    if name.endswith(".bias") or name.endswith("expert_bias"):
        return ZEROS
    return normal(0.02)  # the router and the stacked expert weights too


def valid_llama_tp(cfg: LlamaConfig) -> list[int]:
    """Tensor-parallel degrees that split whole query and key/value heads and the MLP."""
    return [
        t
        for t in range(1, cfg.n_kv_head + 1)
        if cfg.n_kv_head % t == 0
        and cfg.n_head % t == 0
        and cfg.ffn_hidden_size % t == 0
        and cfg.shared_expert_size % t == 0
    ]


def check_llama_tp(cfg: LlamaConfig, tp: int) -> None:
    """Each tp rank holds whole key/value heads with their query groups, so tp must
    divide the key/value heads (a fortiori the query heads) and the MLP width.
    Replicating key/value heads across ranks (as some frameworks do when tp
    exceeds them) is not supported."""
    if tp in valid_llama_tp(cfg):
        return
    valid = ", ".join(map(str, valid_llama_tp(cfg)))
    raise ValueError(
        f"--tp {tp} cannot split the model's {cfg.n_kv_head} key/value heads, "
        f"{cfg.n_head} query heads and MLP width {cfg.ffn_hidden_size}: each tp "
        f"rank must hold whole key/value heads; valid: --tp {valid}"
    )
