"""A Llama decoder (Touvron et al. 2023), plain single-device code: RMSNorm (Zhang &
Sennrich 2019), rotary positions (Su et al. 2021) in Hugging Face's rotate-half layout,
SwiGLU (Shazeer 2020), grouped-query attention (Ainslie et al. 2023); Qwen2, Qwen3 and
Mistral as switches. Modules carry Hugging Face's names without ``model.``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshwise.geometry.init import init_module
from meshwise.models.attention import Positions, ScaledDotProductAttention
from meshwise.models.attention_masks import window_mask  # noqa: F401 - the window's rule
from meshwise.models.context import ForwardContext
from meshwise.models.kv_cache import LayerCache

# Re-exported: the config, the rotary embedding and the plan are imported from here too.
from meshwise.models.llama_config import ROPE_TYPES, LlamaConfig, rope_type_of  # noqa: F401
from meshwise.models.llama_plan import (  # noqa: F401
    check_llama_tp,
    llama_init,
    llama_plan,
    valid_llama_tp,
)
from meshwise.models.moe import MoE, is_moe_layer
from meshwise.models.rotary import (  # noqa: F401
    Rotary,
    apply_rotary,
    rope_inverse_frequencies,
    rotate_half,
)


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
