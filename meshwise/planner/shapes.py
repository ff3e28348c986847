"""A model's shapes as the planner needs them, read from the model itself: built on the
meta device with one layer (a family's layers are alike), each parameter sorted by its
family's plan into split over tp or replicated. A 70B model costs what one layer does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

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
    layer_matmul: int  # weights a layer multiplies by (FLOPs: 6 per token each)

    @property
    def num_params(self) -> int:
        """Parameters of the whole model (a tied head counted once)."""
        return (
            self.n_layer * (self.layer_split + self.layer_replicated)
            + self.embed_split
            + self.embed_replicated
            + self.final_replicated
            + (0 if self.tied else self.head_split)
        )

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_head * self.head_dim

    def model_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token of a training step, by ``meshwise.train.flops``'s
        convention (6 per matmul weight, the head included; attention's 12 L d T)."""
        return (
            6.0 * (self.n_layer * self.layer_matmul + self.head_split)
            + 12.0 * self.n_layer * self.d_model * seq_len
        )


def model_shape(cfg: TrainConfig) -> ModelShape:
    """The shape of ``cfg``'s model (its vocabulary: ``--vocab-size``, else byte-level)."""
    sizes = cfg.model.sizes(cfg.model.vocab_size or DEFAULT_VOCAB)
    return _shape(tuple(sorted((k, _hashable(v)) for k, v in sizes.items())))


def parameter_count(cfg: TrainConfig, vocab_size: int) -> int:
    """The parameters of ``cfg``'s model with ``vocab_size`` ids."""
    sizes = cfg.model.sizes(vocab_size)
    return _shape(tuple(sorted((k, _hashable(v)) for k, v in sizes.items()))).num_params


def _hashable(value):
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


@functools.lru_cache(maxsize=64)
def _shape(items: tuple) -> ModelShape:
    from meshwise.geometry.init import on_meta
    from meshwise.models.families import family

    sizes: dict[str, Any] = {k: dict(v) if isinstance(v, tuple) else v for k, v in items}
    fam = family(sizes["family"])
    full = fam.make_config(sizes)
    one = fam.make_config({**sizes, "n_layer": 1})
    plan = fam.plan(one)
    with on_meta():
        model = fam.build(one)
    layers = getattr(model, plan.layers)
    ((layer_key, layer),) = layers.items()
    counts = {
        "layer_split": 0,
        "layer_replicated": 0,
        "embed_split": 0,
        "embed_replicated": 0,
        "final_replicated": 0,
        "head_split": 0,
    }
    tied = bool(plan.ties)
    seen = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        module, _, kind = name.rpartition(".")
        style = plan.tp_style(module)
        split = style in ("colwise", "vocab_embedding", "vocab_head") or (
            style == "rowwise" and kind == "weight"
        )
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
        tied=tied,
        layer_matmul=matmul_params(layer),
        **counts,
    )
