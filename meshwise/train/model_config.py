"""The model section of the configuration: each family's presets and sizes (flags override
them); ``ModelConfig.sizes`` defines a model whatever the layout, checked on resume.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# A plain Llama; --init-from's config.json sets these for Mistral, Qwen2 and Qwen3.
LLAMA_VARIANT = {
    "qkv_bias": False,
    "qk_norm": False,
    "head_size": 0,
    "sliding_window": 0,
    "hf_type": "llama",
    # mixture of experts (docs/moe.md): none by default
    "n_experts": 0,
    "experts_per_token": 2,
    "moe_ffn_hidden_size": 0,
    "norm_topk_prob": True,
    "router_score": "softmax",
    "shared_expert_size": 0,
    "shared_expert_gate": False,
    "first_dense_layers": 0,
    "moe_every": 1,
    "aux_loss_coef": 0.0,
    "aux_loss_formula": "per-layer",
    "bias_update_rate": 0.0,
}
MODEL_PRESETS: dict[str, dict[str, Any]] = {  # values of each field's own type
    # name: the model family (meshwise.models.families) and its sizes
    "tiny": {"family": "gpt", "n_layer": 4, "n_head": 4, "d_model": 128, "block_size": 256},
    "small": {"family": "gpt", "n_layer": 6, "n_head": 6, "d_model": 384, "block_size": 512},
    "medium": {"family": "gpt", "n_layer": 12, "n_head": 12, "d_model": 768, "block_size": 1024},
    # Llama (Touvron et al. 2023): grouped-query attention, SwiGLU width about 8/3 d
    # rounded to a multiple of 128, so that tp up to the kv heads divides it.
    "llama-tiny": {
        "family": "llama",
        "n_layer": 4,
        "n_head": 4,
        "n_kv_head": 2,
        "d_model": 128,
        "ffn_hidden_size": 384,
        "block_size": 256,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
        "rope_scaling": None,
        **LLAMA_VARIANT,
    },
    "llama-small": {
        "family": "llama",
        "n_layer": 6,
        "n_head": 6,
        "n_kv_head": 2,
        "d_model": 384,
        "ffn_hidden_size": 1024,
        "block_size": 512,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
        "rope_scaling": None,
        **LLAMA_VARIANT,
    },
    # Llama-3.2-1B's sizes (its head is tied to the embedding); its 8192-token
    # pre-training context, without the llama3 rope scaling that extends it.
    "llama-1b": {
        "family": "llama",
        "n_layer": 16,
        "n_head": 32,
        "n_kv_head": 8,
        "d_model": 2048,
        "ffn_hidden_size": 8192,
        "block_size": 8192,
        "rope_theta": 500000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": True,
        "rope_scaling": None,
        **LLAMA_VARIANT,
    },
}
# Settings of the llama family only; None: the preset's (or --init-from's config.json).
LLAMA_ONLY = ("n_kv_head", "ffn_hidden_size", "rope_theta", "norm_eps")
# Llama-family settings that may be 0 (or a string), so checked by the family's config.
MOE_SETTINGS = (
    "n_experts",
    "experts_per_token",
    "moe_ffn_hidden_size",
    "shared_expert_size",
    "first_dense_layers",
    "moe_every",
    "router_score",
    "aux_loss_coef",
    "bias_update_rate",
)


@dataclass
class ModelConfig:
    preset: str = "tiny"
    n_layer: int = 0  # 0: from the preset
    n_head: int = 0
    d_model: int = 0
    block_size: int = 0
    vocab_size: int = 0  # 0: from the tokenizer, else the data (byte-level: 256)
    dropout: float = 0.0
    # llama family (None: the preset's, or --init-from's config.json)
    n_kv_head: int | None = None
    ffn_hidden_size: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None  # no flag: a preset's, or config.json's
    rope_scaling: dict | None = None  # no flag: config.json's (llama3 scaling)
    init_from: str | None = None  # a Hugging Face directory (Llama family or GPT-2)
    # no flags: a preset's, or config.json's (Mistral, Qwen2, Qwen3 variants)
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    head_size: int | None = None
    sliding_window: int | None = None
    hf_type: str | None = None
    # mixture of experts (None: the preset's, which has none, or config.json's)
    n_experts: int | None = None
    experts_per_token: int | None = None
    moe_ffn_hidden_size: int | None = None
    norm_topk_prob: bool | None = None
    router_score: str | None = None
    shared_expert_size: int | None = None
    shared_expert_gate: bool | None = None
    first_dense_layers: int | None = None
    moe_every: int | None = None
    aux_loss_coef: float | None = None
    aux_loss_formula: str | None = None
    bias_update_rate: float | None = None

    def resolved(self) -> "ModelConfig":
        """A copy with every size the preset defines filled in where it is unset."""
        preset = MODEL_PRESETS[self.preset]
        sizes = {
            f.name: preset[f.name] if _unset(getattr(self, f.name)) else getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name in preset
        }
        return dataclasses.replace(self, **sizes)

    @property
    def family(self) -> str:
        return MODEL_PRESETS[self.preset]["family"]

    def sizes(self, vocab_size: int) -> dict:
        """What defines the model whatever the layout (a checkpoint must match it):
        the sizes its preset lists, resolved."""
        m = self.resolved()
        sizes = {name: getattr(m, name) for name in MODEL_PRESETS[self.preset] if name != "family"}
        return {"family": self.family, **sizes, "vocab_size": vocab_size}


def _unset(value) -> bool:
    """Whether a model setting is left to the preset: None, or 0 for the sizes."""
    return value is None or (not isinstance(value, bool) and value == 0)
