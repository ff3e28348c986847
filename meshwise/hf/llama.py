"""Hugging Face's Llama, Mistral, Qwen2 and Qwen3 (and, with ``meshwise.hf.moe``, Mixtral,
Qwen3-MoE and Qwen2-MoE) ``config.json`` and tensor names, to and from ours (pure).
``config.json`` is read as transformers 4 writes it (``rope_theta``, ``rope_scaling``) and
as 5 does (``rope_parameters``); exports use the first, read by both.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshwise.hf.moe import (
    MOE_ARCHITECTURES,
    MOE_KEY_TYPES,
    is_moe_type,
    moe_config,
    moe_shapes,
    moe_sizes,
    unsupported_moe,
)
from meshwise.models.llama import LlamaConfig, rope_type_of
from meshwise.models.moe import is_moe_layer

ARCHITECTURE = "LlamaForCausalLM"
# What --init-from reads (GPT-2 through meshwise.hf.gpt2), for messages.
FAMILIES_READ = "Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE or GPT-2"
# model_type -> the architecture transformers builds for it
ARCHITECTURES = {
    "llama": ARCHITECTURE,
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **MOE_ARCHITECTURES,
}
# Mixture-of-experts keys of transformers' configs: a value > 0 means MoE blocks.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# Our LlamaConfig field <- config.json key.
SIZES = {
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_kv_head": "num_key_value_heads",
    "d_model": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "block_size": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DEFAULT_ROPE_THETA = 10000.0  # what transformers assumes when config.json names none
# The JSON type of every config.json key meshwise reads ("?": null allowed, as
# transformers reads null there as "not given").
KEY_TYPES = {
    **{key: "int" for key in SIZES.values()},
    "rms_norm_eps": "number",
    "num_key_value_heads": "int?",
    "head_dim": "int?",
    "rope_theta": "number",
    "tie_word_embeddings": "bool",
    "attention_bias": "bool",
    "mlp_bias": "bool",
    "hidden_act": "str",
    "model_type": "str",
    "architectures": "list?",
    "rope_scaling": "object?",
    "rope_parameters": "object?",
    "sliding_window": "int?",
    "use_sliding_window": "bool",
    **{key: "int?" for key in MOE_KEYS},
    **MOE_KEY_TYPES,
}
ROPE_KEY_TYPES = {
    "factor": "number",
    "low_freq_factor": "number",
    "high_freq_factor": "number",
    "original_max_position_embeddings": "int",
    "rope_type": "str",
    "type": "str",
    "rope_theta": "number",
}
_WANTED = {
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "str": "a string",
    "list": "a list",
    "object": "an object",
}


def hf_name(name: str) -> str:
    """The ``LlamaForCausalLM`` name of our parameter ``name``."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def read_config(directory: str | Path) -> dict:
    """``DIR/config.json`` as a dict; ValueError when missing or unreadable."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise ValueError(
            f"--init-from {directory}: no such directory; expected a Hugging Face "
            f"{FAMILIES_READ} directory (config.json + model.safetensors)"
        )
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"--init-from {directory}: no config.json there; expected a Hugging "
            f"Face {FAMILIES_READ} directory (config.json + model.safetensors)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--init-from {path}: not a readable JSON file ({exc})") from None


def llama_sizes(config: dict, where: str) -> dict:
    """Our model settings (``LlamaConfig`` fields) from a ``config.json`` dict.

    Raises ValueError naming ``where`` for a value of the wrong type, another
    architecture or a Llama variant meshwise does not compute (biases, another
    activation, head size)."""
    check_types(config, KEY_TYPES, f"{where}/config.json")
    for key in ("rope_scaling", "rope_parameters"):
        check_types(config.get(key) or {}, ROPE_KEY_TYPES, f"{where}/config.json: {key}")
    kind = config.get("model_type")
    expected = ARCHITECTURES.get(kind) if isinstance(kind, str) else None
    architectures = config.get("architectures") or [expected or ""]
    unsupported_moe(kind, where)
    if expected is None or expected not in architectures:
        valid = ", ".join(f"{t} ({a})" for t, a in ARCHITECTURES.items())
        raise ValueError(
            f"--init-from {where}: config.json describes model_type "
            f"{kind!r} ({', '.join(architectures)}); valid: {valid}"
        )
    missing = [key for key in SIZES.values() if key not in config and key != "num_key_value_heads"]
    if missing:
        raise ValueError(f"--init-from {where}: config.json lacks {', '.join(missing)}")
    sizes = {ours: config[theirs] for ours, theirs in SIZES.items() if theirs in config}
    if sizes.get("n_kv_head") is None:  # no key (or null): multi-head attention
        sizes["n_kv_head"] = sizes["n_head"]
    _check_supported(config, sizes, where)
    sizes.update(_variant(config, sizes, where))
    if is_moe_type(kind):
        sizes.update(moe_sizes(config, where))
    rope = dict(config.get("rope_parameters") or {})
    theta = (
        config["rope_theta"]
        if "rope_theta" in config
        else rope.get("rope_theta", DEFAULT_ROPE_THETA)
    )
    scaling = config.get("rope_scaling") or rope
    sizes.update(
        rope_theta=float(theta),
        norm_eps=float(sizes["norm_eps"]),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling(scaling, where),
    )
    try:
        LlamaConfig(**sizes)
    except ValueError as exc:
        raise ValueError(f"--init-from {where}: {exc}") from None
    return sizes


def check_types(config: dict, types: dict[str, str], where: str) -> None:
    """Each key of ``types`` present in ``config`` has its JSON type (ValueError naming it):
    ``"false"`` is a string, not a boolean, and 2.0 layers are not a count."""
    if not isinstance(config, dict):
        raise ValueError(f"--init-from {where}: not a JSON object")
    for key, kind in types.items():
        if key not in config:
            continue
        value, base = config[key], kind.rstrip("?")
        if value is None and kind.endswith("?"):
            continue
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
            "list": isinstance(value, list),
            "object": isinstance(value, dict),
        }[base]
        if not ok:
            raise ValueError(
                f"--init-from {where}: {key} = {json.dumps(value)} is not {_WANTED[base]}"
            )


def _check_supported(config: dict, sizes: dict, where: str) -> None:
    dense = not is_moe_type(config["model_type"])
    moe = [key for key in MOE_KEYS if config.get(key) and dense]
    unsupported = [
        (moe, f"MoE blocks ({moe[0]} {config.get(moe[0])})" if moe else "", "a dense model"),
        (config.get("attention_bias", False), "attention_bias true", "false"),
        (config.get("mlp_bias", False), "mlp_bias true", "false"),
        (
            config.get("hidden_act", "silu") != "silu",
            f"hidden_act {config.get('hidden_act')!r}",
            "'silu'",
        ),
        (
            config.get("use_sliding_window", False),
            "use_sliding_window true (Qwen's sliding-window layers)",
            "false",
        ),
    ]
    for bad, what, valid in unsupported:
        if bad:
            raise ValueError(
                f"--init-from {where}: config.json has {what}, which meshwise "
                f"does not compute; valid: {valid}"
            )


def _variant(config: dict, sizes: dict, where: str) -> dict:
    """The switches of the model_type: Qwen2's biases (Qwen2-MoE's by its qkv_bias),
    Qwen3's q/k norms, a head size of its own, Mistral's and Mixtral's sliding window."""
    kind = config["model_type"]
    head_dim = config.get("head_dim") or sizes["d_model"] // sizes["n_head"]
    own_head = head_dim if head_dim * sizes["n_head"] != sizes["d_model"] else 0
    window = config.get("sliding_window") if kind in ("mistral", "mixtral") else None
    return {
        "qkv_bias": kind == "qwen2" or (kind == "qwen2_moe" and config.get("qkv_bias", True)),
        "qk_norm": kind in ("qwen3", "qwen3_moe"),
        "head_size": own_head,
        "sliding_window": window or 0,
        "hf_type": kind,
    }


def _rope_scaling(scaling: dict, where: str) -> dict | None:
    """None for plain RoPE, else the llama3 parameters (other types are refused)."""
    kind = rope_type_of(scaling)
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(
            f"--init-from {where}: rope_scaling type {kind!r} is not supported; "
            "valid: llama3, or no rope_scaling"
        )
    missing = [key for key in LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"--init-from {where}: llama3 rope_scaling lacks {', '.join(missing)}")
    return {"rope_type": "llama3", **{key: scaling[key] for key in LLAMA3_KEYS}}


def hf_config(cfg: LlamaConfig) -> dict:
    """The ``config.json`` of ``cfg`` for its family's architecture (``LlamaForCausalLM``...)."""
    config = {
        "architectures": [ARCHITECTURES[cfg.hf_type]],
        "model_type": cfg.hf_type,
        **{theirs: getattr(cfg, ours) for ours, theirs in SIZES.items()},
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if cfg.hf_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None)
    if cfg.hf_type in MOE_ARCHITECTURES:
        config.update(moe_config(cfg))
    if cfg.hf_type in ("mistral", "mixtral"):
        config["sliding_window"] = cfg.sliding_window or None
    if cfg.rope_scaling:
        config["rope_scaling"] = dict(cfg.rope_scaling)
    return config


def hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor ``LlamaForCausalLM`` stores for ``cfg``, by its name, with its shape
    (``lm_head.weight`` included only when it is not tied to the embedding)."""
    d, ffn, hd = cfg.d_model, cfg.ffn_hidden_size, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_kv_head * hd
    shapes = {"embed_tokens.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    for i in range(cfg.n_layer):
        layer, attn = f"layers.{i}.", f"layers.{i}.self_attn."
        shapes.update(
            {
                layer + "input_layernorm.weight": (d,),
                layer + "post_attention_layernorm.weight": (d,),
                attn + "q_proj.weight": (q, d),
                attn + "k_proj.weight": (kv, d),
                attn + "v_proj.weight": (kv, d),
                attn + "o_proj.weight": (d, q),
            }
        )
        if not is_moe_layer(cfg, i):
            shapes.update(
                {
                    layer + "mlp.gate_proj.weight": (ffn, d),
                    layer + "mlp.up_proj.weight": (ffn, d),
                    layer + "mlp.down_proj.weight": (d, ffn),
                }
            )
        if cfg.qkv_bias:
            shapes.update(
                {
                    attn + "q_proj.bias": (q,),
                    attn + "k_proj.bias": (kv,),
                    attn + "v_proj.bias": (kv,),
                }
            )
        if cfg.qk_norm:
            shapes.update({attn + "q_norm.weight": (hd,), attn + "k_norm.weight": (hd,)})
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    stored = {hf_name(name): shape for name, shape in shapes.items()}
    for i in range(cfg.n_layer):
        if is_moe_layer(cfg, i):
            stored.update(moe_shapes(cfg, i))
    return stored
