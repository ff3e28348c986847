"""A model's shapes as the planner needs them, read from the model itself: built on the
meta device with one layer (a family's layers are alike; a mixture of experts: one dense
and one MoE layer), each parameter sorted by its family's plan into split over tp,
replicated, or (routed experts) split over ep. A 70B model costs what one layer does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from meshwise.apply.lora import ALL_LINEAR, LoraConfig
from meshwise.planner.lora import PER_LAYER, LoraShape, layer_counts, lora_key, lora_shape
from meshwise.train.config import TrainConfig
from meshwise.train.flops import matmul_params

DEFAULT_VOCAB = 256  # byte-level, what ``meshwise train`` uses without a tokenizer


@dataclass(frozen=True)
class ModelShape:
    """Sizes of one model. ``*_split``: parameters tensor parallelism divides by tp;
    ``*_replicated``: parameters every tp rank holds whole."""

    family: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn: int  # the MLP's hidden width
    vocab: int
    tied: bool
    layer_split: int  # per layer
    layer_replicated: int
    embed_split: int  # the token embedding (first stage)
    embed_replicated: int  # learned positions (GPT)
    final_replicated: int  # the final norm (last stage)
    head_split: int  # the output head's own weight; with a tie, a copy under a pipeline
    layer_matmul: float  # weights a layer multiplies by per token (FLOPs: 6 per token each)
    # Mixture of experts; the layer_* counts above are then averages over the layers, the
    # routed experts left out (their own count, split over ep, not tp).
    n_experts: int = 0
    experts_per_token: int = 0
    moe_layers: int = 0
    expert_params: int = 0  # one MoE layer's routed experts, all of them
    # LoRA: the adapters (trained) and NF4 weights beside the frozen base; None: full training
    lora: LoraShape | None = None

    @property
    def num_params(self) -> int:
        """Parameters of the whole model (a tied head counted once)."""
        return round(
            self.n_layer * (self.layer_split + self.layer_replicated)
            + self.moe_layers * self.expert_params
            + self.embed_split
            + self.embed_replicated
            + self.final_replicated
            + (0 if self.tied else self.head_split)
        )

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: of each MoE layer's routed experts only
        its top-k (the router and a shared expert always)."""
        if not self.n_experts:
            return self.num_params
        idle = self.moe_layers * self.expert_params * (1 - self.experts_per_token / self.n_experts)
        return self.num_params - round(idle)

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_head * self.head_dim

    def model_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token of a training step, by ``meshwise.train.flops``'s
        convention (6 per matmul weight, the head included, 4 per frozen one under LoRA,
        whose adapters count 6; attention's 12 L d T): of the active parameters (a token's
        top-k experts, not all of them)."""
        weights = self.n_layer * self.layer_matmul + self.head_split
        per_weight, adapters = 6.0, 0.0
        if self.lora is not None:
            per_layer = self.lora.adapter_split + self.lora.adapter_replicated
            per_weight, adapters = 4.0, self.n_layer * per_layer + self.lora.adapter_root
        return per_weight * weights + 6.0 * adapters + 12.0 * self.n_layer * self.d_model * seq_len


def model_shape(cfg: TrainConfig) -> ModelShape:
    """The shape of ``cfg``'s model (its vocabulary: ``--vocab-size``, else byte-level), with
    its LoRA adapters."""
    return shape_of(cfg.model.sizes(cfg.model.vocab_size or DEFAULT_VOCAB), cfg.lora)


def parameter_count(cfg: TrainConfig, vocab_size: int) -> int:
    """The parameters of ``cfg``'s model with ``vocab_size`` ids."""
    return shape_of(cfg.model.sizes(vocab_size)).num_params


def shape_of(sizes: dict, lora: LoraConfig | None = None) -> ModelShape:
    """The shape of the model ``sizes`` defines (``ModelConfig.sizes``: its family and the
    family config's fields), with ``lora``'s adapters where given."""
    items = tuple(sorted((k, _hashable(v)) for k, v in sizes.items()))
    return _shape(items, lora_key(lora) if lora is not None else None)


def _hashable(value):
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


@functools.lru_cache(maxsize=64)
def _shape(items: tuple, lora: tuple | None = None) -> ModelShape:
    from meshwise.models.families import family

    sizes: dict[str, Any] = {k: dict(v) if isinstance(v, tuple) else v for k, v in items}
    fam = family(sizes["family"])
    full = fam.make_config(sizes)
    n_experts = getattr(full, "n_experts", 0)
    dense_one = fam.make_config({**sizes, "n_layer": 1, "n_experts": 0})
    counts = _counts(fam, dense_one, lora, strict=not n_experts)
    moe = {"n_experts": 0, "experts_per_token": 0, "moe_layers": 0, "expert_params": 0}
    if n_experts:
        from meshwise.models.moe import is_moe_layer

        one = {**sizes, "n_layer": 1, "first_dense_layers": 0, "moe_every": 1}
        sparse = _counts(fam, fam.make_config(one), lora, strict=False)
        moe_layers = sum(is_moe_layer(full, i) for i in range(full.n_layer))
        dense = full.n_layer - moe_layers
        for key in ("layer_split", "layer_replicated", "layer_matmul"):
            counts[key] = (dense * counts[key] + moe_layers * sparse[key]) / full.n_layer
        if lora:
            counts["lora"] = _merged(counts["lora"], sparse["lora"], dense / full.n_layer, lora)
        moe = {
            "n_experts": n_experts,
            "experts_per_token": full.experts_per_token,
            "moe_layers": moe_layers,
            "expert_params": sparse["layer_experts"],
        }
        # a token multiplies by its top-k experts' weights only
        active = sparse["layer_experts"] * full.experts_per_token / n_experts
        counts["layer_matmul"] += moe_layers * active / full.n_layer
    del counts["layer_experts"]
    adapters = lora_shape(lora, counts.pop("lora")) if lora else None
    head_dim = getattr(full, "head_dim", full.d_model // full.n_head)
    return ModelShape(
        family=sizes["family"],
        n_layer=full.n_layer,
        d_model=full.d_model,
        n_head=full.n_head,
        n_kv_head=getattr(full, "n_kv_head", full.n_head),
        head_dim=head_dim,
        ffn=getattr(full, "ffn_hidden_size", 4 * full.d_model),
        vocab=full.vocab_size,
        tied=bool(fam.plan(full).ties),
        **counts,
        **moe,
        lora=adapters,
    )


def _merged(dense: dict[str, Any], moe: dict[str, Any], share: float, key: tuple) -> dict:
    """A mixture of experts' LoRA counts from its dense and MoE layers' (``share``: the
    dense layers' share of the layers); a target neither has is an error."""
    merged = {name: share * dense[name] + (1 - share) * moe[name] for name in PER_LAYER}
    merged["adapter_root"] = dense["adapter_root"]
    merged["nf4_largest"] = max(dense["nf4_largest"], moe["nf4_largest"])
    merged["nf4_rows"] = dense["nf4_rows"] | moe["nf4_rows"]
    if not merged["adapter_split"] + merged["adapter_replicated"] + merged["adapter_root"]:
        raise ValueError(
            f"--lora-targets {key[1]!r} matches no linear layer; valid: {ALL_LINEAR} or "
            "names of the model's linear layers"
        )
    return merged


def _counts(fam, one, lora: tuple | None = None, strict: bool = True) -> dict[str, Any]:
    """Parameters of the one-layer model ``one`` by where they sit and how tp splits them;
    ``layer_experts``: its routed experts (split over ep); ``layer_matmul``: what its
    layer multiplies by as ``nn.Linear`` weights (not the routed experts); ``lora``: its
    LoRA counts under that setting (``meshwise.planner.lora.layer_counts``)."""
    from meshwise.geometry.init import on_meta

    plan = fam.plan(one)
    with on_meta():
        model = fam.build(one)
    layers = getattr(model, plan.layers)
    ((layer_key, layer),) = layers.items()
    counts: dict[str, Any] = {
        "layer_split": 0,
        "layer_replicated": 0,
        "layer_experts": 0,
        "embed_split": 0,
        "embed_replicated": 0,
        "final_replicated": 0,
        "head_split": 0,
    }
    seen = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        module, _, kind = name.rpartition(".")
        style = plan.tp_style(module)
        split = style in ("colwise", "vocab_embedding", "vocab_head") or (
            style == "rowwise" and kind == "weight"
        )
        if plan.ep_style(module) == "experts":
            counts["layer_experts"] += param.numel()
            continue
        if name.startswith(f"{plan.layers}."):
            where = "layer"
        elif any(name.startswith(m + ".") for m in plan.first_stage):
            where = "embed"
        else:
            where = "head" if style == "vocab_head" else "final"
        if id(param) in seen and where != "head":
            continue
        seen.add(id(param))
        key = "head_split" if where == "head" else f"{where}_{'split' if split else 'replicated'}"
        counts[key] += param.numel()
    counts["layer_matmul"] = matmul_params(layer)
    if lora:
        counts["lora"] = layer_counts(model, plan, lora, strict)
    return counts
