"""Hugging Face's Mixtral, Qwen3-MoE and Qwen2-MoE: their ``config.json`` MoE keys and their
expert tensor names, to and from ours (pure).

Files hold each expert as its own tensors, under the names published on the Hub and written
by ``save_pretrained`` (Mixtral: ``block_sparse_moe.experts.{j}.w1/w3/w2``, gate/up/down;
Qwen: ``mlp.experts.{j}.{gate,up,down}_proj``); meshwise stacks an MoE layer's experts into
one (E, F, D) tensor per projection. transformers 5's in-memory form (``experts.gate_up_proj``,
gate rows then up rows) is read too, where a folder stores it.
"""

from __future__ import annotations

import dataclasses
import re

# model_type -> the architecture transformers builds for it
MOE_ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
# Mixture-of-experts families meshwise does not compute, with what it lacks for each.
UNSUPPORTED_MOE = {
    "deepseek_v2": "multi-head latent attention (kv_lora_rank) and group-limited routing",
    "deepseek_v3": "multi-head latent attention (kv_lora_rank) and group-limited routing",
    "gpt_oss": "attention sinks, biased experts and the clamped SwiGLU",
    "llama4": "chunked attention and the sigmoid top-1 router with interleaved experts",
    "olmoe": "q/k norms over all heads at once",
    "dbrx": "fused qkv with clipping and its own expert layout",
    "phimoe": "sparsemixer routing",
    "granitemoe": "its multipliers on embeddings, attention and logits",
    "jamba": "Mamba layers",
}
# config.json keys of the MoE families, with their JSON types (see llama.check_types).
MOE_KEY_TYPES = {
    "num_experts_per_tok": "int",
    "moe_intermediate_size": "int",
    "shared_expert_intermediate_size": "int",
    "norm_topk_prob": "bool",
    "decoder_sparse_step": "int",
    "mlp_only_layers": "list?",
    "router_aux_loss_coef": "number",
    "output_router_logits": "bool",
    "router_jitter_noise": "number",
    "qkv_bias": "bool",
}
# Our stacked expert tensors, by projection: (Mixtral's name, Qwen's name)
EXPERT_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_STACKED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")


def is_moe_type(kind) -> bool:
    return kind in MOE_ARCHITECTURES


def moe_sizes(config: dict, where: str) -> dict:
    """Our MoE settings (``LlamaConfig`` fields) from an MoE family's ``config.json``.

    Raises ValueError naming what meshwise does not compute (router noise, dense layers
    that are not a leading run, a missing size)."""
    kind = config["model_type"]
    n_experts = config.get("num_local_experts") or config.get("num_experts")
    top_k = config.get("num_experts_per_tok")
    if not n_experts or not top_k:
        raise ValueError(
            f"--init-from {where}: config.json of a {kind} model lacks "
            f"{'num_experts_per_tok' if n_experts else 'num_local_experts (or num_experts)'}"
        )
    if config.get("router_jitter_noise"):
        raise ValueError(
            f"--init-from {where}: config.json has router_jitter_noise "
            f"{config['router_jitter_noise']} (random noise on the router's inputs), which "
            "meshwise does not compute; valid: 0"
        )
    # transformers trains with the aux loss only with output_router_logits: the loss we train
    # is the loss transformers computes from the same folder.
    trains_aux = config.get("output_router_logits", False)
    coef = float(config.get("router_aux_loss_coef", 0.001)) if trains_aux else 0.0
    sizes = {
        "n_experts": n_experts,
        "experts_per_token": top_k,
        "router_score": "softmax",
        "aux_loss_coef": coef,
        "aux_loss_formula": "hf-concatenated",
    }
    if kind == "mixtral":  # every layer MoE, experts as wide as intermediate_size, renormalised
        return {**sizes, "moe_ffn_hidden_size": 0, "norm_topk_prob": True}
    if "moe_intermediate_size" not in config:
        raise ValueError(
            f"--init-from {where}: config.json of a {kind} model lacks moe_intermediate_size"
        )
    sizes.update(
        moe_ffn_hidden_size=config["moe_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),  # transformers' default
        moe_every=config.get("decoder_sparse_step", 1),
        first_dense_layers=_first_dense_layers(config.get("mlp_only_layers") or [], where),
    )
    if kind == "qwen2_moe":
        width = config.get("shared_expert_intermediate_size")
        if not width:
            raise ValueError(
                f"--init-from {where}: a qwen2_moe config.json with "
                f"shared_expert_intermediate_size {width}; valid: the shared expert's "
                "width, a positive integer"
            )
        sizes.update(shared_expert_size=width, shared_expert_gate=True)
    return sizes


def _first_dense_layers(dense: list, where: str) -> int:
    """``mlp_only_layers`` as our count of leading dense layers: only a run 0..k-1 is one."""
    if sorted(dense) != list(range(len(dense))):
        raise ValueError(
            f"--init-from {where}: config.json has mlp_only_layers {dense}, dense layers that "
            "meshwise does not place; valid: [] or the leading layers [0, 1, ..., k-1]"
        )
    return len(dense)


def unsupported_moe(kind, where: str) -> None:
    """ValueError naming what a known MoE family needs that meshwise does not compute."""
    if kind in UNSUPPORTED_MOE:
        valid = ", ".join(f"{t} ({a})" for t, a in MOE_ARCHITECTURES.items())
        raise ValueError(
            f"--init-from {where}: model_type {kind!r} needs {UNSUPPORTED_MOE[kind]}, which "
            f"meshwise does not compute; valid MoE families: {valid}"
        )


def moe_config(cfg) -> dict:
    """The MoE keys of ``cfg``'s ``config.json`` (its ``hf_type`` one of MOE_ARCHITECTURES)."""
    keys = {
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": cfg.aux_loss_coef > 0,
    }
    if cfg.hf_type == "mixtral":
        return {**keys, "num_local_experts": cfg.n_experts, "router_jitter_noise": 0.0}
    keys.update(
        num_experts=cfg.n_experts,
        moe_intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.moe_every,
        mlp_only_layers=list(range(cfg.first_dense_layers)),
    )
    if cfg.hf_type == "qwen2_moe":
        keys.update(shared_expert_intermediate_size=cfg.shared_expert_size, qkv_bias=cfg.qkv_bias)
    return keys


def export_family(cfg):
    """``cfg`` under the MoE family that holds it (a model of meshwise's own with experts as
    Qwen3-MoE with q/k norms, Qwen2-MoE with a gated shared expert, else Mixtral); a dense
    model unchanged. ValueError naming what that family cannot hold."""
    if not cfg.n_experts:
        return cfg
    kind = cfg.hf_type
    if kind not in MOE_ARCHITECTURES:
        kind = "qwen3_moe" if cfg.qk_norm else "qwen2_moe" if cfg.shared_expert_gate else "mixtral"
        cfg = dataclasses.replace(cfg, hf_type=kind)
    wrong = []
    if cfg.router_score != "softmax":
        wrong.append(f"router_score {cfg.router_score!r} (valid: 'softmax')")
    if kind == "mixtral":
        uniform = cfg.first_dense_layers == 0 and cfg.moe_every == 1 and cfg.shared_expert_size == 0
        if not uniform or cfg.moe_ffn_hidden_size not in (0, cfg.ffn_hidden_size):
            wrong.append("dense layers, a shared expert or experts of another width (valid: none)")
        if not cfg.norm_topk_prob:
            wrong.append("norm_topk_prob false (valid: true)")
    if kind == "qwen2_moe" and not (cfg.shared_expert_size and cfg.shared_expert_gate):
        wrong.append("no gated shared expert (valid: one)")
    if kind == "qwen3_moe" and cfg.shared_expert_size:
        wrong.append(f"a shared expert of width {cfg.shared_expert_size} (valid: none)")
    if cfg.qk_norm != (kind == "qwen3_moe") or (cfg.qkv_bias and kind != "qwen2_moe"):
        wrong.append(f"qk_norm {cfg.qk_norm} with qkv_bias {cfg.qkv_bias}")
    if wrong:
        raise ValueError(
            f"--format hf: a {kind} model cannot hold {'; '.join(wrong)}; "
            "valid: --format safetensors"
        )
    return cfg


def stacked_expert(name: str) -> tuple[int, str] | None:
    """(layer, projection) of our stacked expert tensor ``name``; None for any other name."""
    match = _STACKED.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def expert_name(cfg, layer: int, projection: str, expert: int) -> str:
    """The stored name of expert ``expert``'s ``projection`` weight in ``layer``."""
    if cfg.hf_type == "mixtral":
        w = EXPERT_PROJECTIONS[projection]
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def fused_name(layer: int, projection: str) -> str:
    """transformers 5's in-memory name of a layer's stacked experts (``gate_up_proj`` holds
    gate_proj's rows then up_proj's)."""
    stored = "down_proj" if projection == "down_proj" else "gate_up_proj"
    return f"model.layers.{layer}.mlp.experts.{stored}"


def router_name(cfg, name: str) -> str:
    """The stored name of a non-stacked tensor of an MoE model (Mixtral's router and
    experts sit under ``block_sparse_moe``, every other family's under ``mlp``)."""
    full = name if name.startswith("lm_head.") else f"model.{name}"
    if cfg.hf_type == "mixtral":
        return re.sub(r"^(model\.layers\.\d+)\.mlp\.gate\.", r"\1.block_sparse_moe.gate.", full)
    return full


def moe_shapes(cfg, layer: int) -> dict[str, tuple[int, ...]]:
    """The tensors an MoE ``layer`` stores, by stored name, with their shapes."""
    d, e = cfg.d_model, cfg.n_experts
    f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        router_name(cfg, f"layers.{layer}.mlp.gate.weight"): (e, d)
    }
    projections = {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
    for j in range(e):
        for projection, shape in projections.items():
            shapes[expert_name(cfg, layer, projection, j)] = shape
    if cfg.shared_expert_size:
        s, prefix = cfg.shared_expert_size, f"model.layers.{layer}.mlp.shared_expert."
        shapes.update(
            {
                prefix + "gate_proj.weight": (s, d),
                prefix + "up_proj.weight": (s, d),
                prefix + "down_proj.weight": (d, s),
            }
        )
    if cfg.shared_expert_gate:
        shapes[f"model.layers.{layer}.mlp.shared_expert_gate.weight"] = (1, d)
    return shapes
