"""A Llama's sizes and switches (Qwen2, Qwen3, Mistral, mixture of experts), checked when
made: ``LlamaConfig``, and the rotary scalings it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshwise.models.moe import check_moe_config

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
