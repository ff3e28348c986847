"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") as a
transform of a laid-out model: each targeted linear layer keeps its weight W frozen and
gains A (r x in) and B (out x r), ``y = W x + (B (A dropout(x))) * alpha / r``, PEFT's
parametrisation, names and default initialisation; every other parameter is frozen.

Under tensor parallelism the adapter follows its layer's split, so that no rank ever
holds a full-width adapter matrix and the sums stay exact:
- column-parallel (W's rows split): B's rows are split with W's and A is replicated. A's
  output ``h = A x`` enters the tp region (``copy_to_tp``), so the gradient reaching A,
  a partial sum over tp (each rank's slice of B sees its own output columns), is summed.
- row-parallel (W's columns split): A's columns are split with W's and B is replicated.
  Each rank's ``A_i x_i`` is a partial sum of the rank-r ``h``; it is summed over tp
  (all-reduced, or reduce-scattered along the sequence under sequence parallelism)
  before B, so ``B h`` is the single-process product and B's gradient is whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.apply.nf4 import QUANTIZE_BASE, quantized_bytes
from meshwise.geometry.init import ZEROS, Init, init_values, normal, uniform
from meshwise.geometry.params import mark_tp
from meshwise.sharding.binding import param_owners, rebind
from meshwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from meshwise.tensor_parallel.mappings import (
    copy_to_tp,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    tp_size_of,
)

ALL_LINEAR = "all-linear"
LORA_INITS = ("kaiming", "gaussian")
ADAPTER_NAMES = ("lora_A", "lora_B")
_LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
LinearLayer = nn.Linear | ColumnParallelLinear | RowParallelLinear  # what an adapter attaches to


@dataclass
class LoraConfig:
    """``--lora-*``: rank 0 turns LoRA off."""

    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0  # on the adapters' input
    lora_targets: str = ALL_LINEAR  # comma-separated module names (PEFT's suffix match)
    lora_init: str = "kaiming"  # PEFT's default: A Kaiming-uniform; gaussian: A ~ N(0, 1/r^2)
    lora_from: str = ""  # a PEFT adapter to start from (its config sets the fields above)
    quantize_base: str = "none"  # nf4: the frozen linear weights held as 4-bit (QLoRA)

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.lora_rank

    @property
    def target_names(self) -> list[str]:
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]

    def check(self) -> None:
        """ValueError naming the first bad setting."""
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank {self.lora_rank}; valid: 0 (off) or a positive rank")
        if self.quantize_base not in QUANTIZE_BASE:
            raise ValueError(
                f"--quantize-base {self.quantize_base!r}; valid: {', '.join(QUANTIZE_BASE)}"
            )
        if not self.enabled:
            if self.quantize_base != "none":
                raise ValueError(
                    f"--quantize-base {self.quantize_base} quantises the frozen base of a LoRA "
                    "run; valid: with --lora-rank > 0, or --quantize-base none"
                )
            return
        if self.lora_alpha <= 0:
            raise ValueError(f"--lora-alpha {self.lora_alpha:g}; valid: a positive number")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout {self.lora_dropout:g}; valid: 0 <= p < 1")
        if self.lora_init not in LORA_INITS:
            raise ValueError(f"--lora-init {self.lora_init!r}; valid: {', '.join(LORA_INITS)}")
        if not self.target_names:
            raise ValueError(
                f"--lora-targets {self.lora_targets!r} names no module; valid: {ALL_LINEAR} or "
                "names such as q_proj,k_proj,v_proj,o_proj"
            )


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA matrix."""
    return name.rpartition(".")[2] in ADAPTER_NAMES


def targeted_layers(model: nn.Module, cfg: LoraConfig, skip=()) -> list[tuple[str, LinearLayer]]:
    """``(path, module)`` of each linear layer ``cfg`` targets (``all-linear``: every one
    but the modules in ``skip``, the output head, as PEFT leaves it). ValueError for a
    target that matches none, or a rank above a targeted layer's smallest dimension."""
    linears: list[tuple[str, LinearLayer]] = [
        (p, m) for p, m in model.named_modules() if isinstance(m, _LINEARS)
    ]
    names = cfg.target_names
    if names == [ALL_LINEAR]:
        chosen = [(p, m) for p, m in linears if p not in skip]
    else:
        chosen = [(p, m) for p, m in linears if any(_matches(p, t) for t in names)]
        for target in names:
            if not any(_matches(p, target) for p, _ in linears):
                found = sorted({p.rpartition(".")[2] for p, _ in linears})
                raise ValueError(
                    f"--lora-targets {target!r} matches no linear layer; valid: "
                    f"{ALL_LINEAR} or names among {', '.join(found)}"
                )
    for path, module in chosen:
        smallest = min(module.in_features, module.out_features)
        if cfg.lora_rank > smallest:
            raise ValueError(
                f"--lora-rank {cfg.lora_rank} is above the smallest dimension of {path} "
                f"({module.in_features} -> {module.out_features}); valid: 1 to {smallest}"
            )
    return chosen


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def add_adapters(chunks: list[nn.Module], cfg: LoraConfig, skip=()) -> list[str]:
    """Freeze every parameter of ``chunks`` and give each targeted linear layer its
    adapter (on the layer's device, shapes only on meta). Returns the adapters' names."""
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
    names = []
    for chunk in chunks:
        for path, module in targeted_layers(chunk, cfg, skip):
            _attach(module, cfg)
            names += [f"{path}.{a}" for a in ADAPTER_NAMES]
    return names


def _attach(module: LinearLayer, cfg: LoraConfig) -> None:
    kind, group, sequence_parallel = "plain", None, False
    if isinstance(module, ColumnParallelLinear):
        kind, group, sequence_parallel = "colwise", module.tp_group, module.sequence is not None
    elif isinstance(module, RowParallelLinear):
        if not module.input_is_parallel:
            raise ValueError("LoRA on a row-parallel layer takes its input already split")
        kind, group, sequence_parallel = "rowwise", module.tp_group, module.sequence_parallel
    tp = tp_size_of(group)
    in_local = module.in_features // (tp if kind == "rowwise" else 1)
    out_local = module.out_features // (tp if kind == "colwise" else 1)
    weight = module.weight
    make = partial(torch.zeros, dtype=weight.dtype, device=weight.device)
    module.lora_A = mark_tp(nn.Parameter(make(cfg.lora_rank, in_local)), kind == "rowwise", 1)
    module.lora_B = mark_tp(nn.Parameter(make(out_local, cfg.lora_rank)), kind == "colwise", 0)
    module.register_forward_hook(
        partial(
            _adapter_forward,
            kind=kind,
            group=group,
            sequence_parallel=sequence_parallel,
            scaling=cfg.scaling,
            dropout=cfg.lora_dropout,
        )
    )


def _adapter_forward(module, args, output, *, kind, group, sequence_parallel, scaling, dropout):
    x = args[0]
    if dropout:
        x = F.dropout(x, dropout, module.training)
    h = F.linear(x, module.lora_A)  # (..., r); row-parallel: a partial sum over tp
    if kind == "colwise":
        h = gather_sequence(h, group) if sequence_parallel else copy_to_tp(h, group)
    elif kind == "rowwise":
        h = reduce_scatter_sequence(h, group) if sequence_parallel else reduce_from_tp(h, group)
    return output + F.linear(h, module.lora_B) * scaling


def adapter_init(cfg: LoraConfig, shapes: dict[str, tuple[int, ...]]):
    """``init_of(name)`` for the adapters, from their logical ``shapes``: A as PEFT draws
    it (``kaiming_uniform_(a=sqrt(5))`` reduces to U(-1/sqrt(in), 1/sqrt(in)), or
    N(0, 1/r^2)), B zeros, so the adapted model starts as the base model."""

    def init_of(name: str) -> Init:
        if name.endswith("lora_B"):
            return ZEROS
        if cfg.lora_init == "gaussian":
            return normal(1.0 / cfg.lora_rank)
        return uniform(1.0 / math.sqrt(shapes[name][1]))

    return init_of


def with_adapter_values(model, base_values, cfg: LoraConfig, seed: int, read=None):
    """The engines' ``values(name, start, end)``: the adapters' from ``read(piece)``
    (a PEFT adapter) or drawn from ``seed`` under their logical names, every other
    parameter's from ``base_values``."""
    pieces = model.pieces()
    shapes = {n: tuple(piece.shape) for n, piece in pieces.items() if is_adapter(n)}
    init_of = adapter_init(cfg, shapes)
    if read is None:
        read = lambda piece: init_values(init_of(piece.name), seed, piece)  # noqa: E731
    adapters = model.values_from(read)

    def values(name: str, start: int, end: int) -> torch.Tensor:
        return (adapters if is_adapter(name) else base_values)(name, start, end)

    return values


@torch.no_grad()
def hold_frozen(model, values, dtype: torch.dtype, device, which=None) -> int:
    """Give each frozen parameter still on the meta device (no engine holds it; with
    ``which``, those it picks) its values, on ``device`` in the compute ``dtype``: this
    rank's tp piece, whole. Returns the number of elements held."""
    owners = param_owners(model.chunks)
    held = 0
    for name, p in model.named_parameters():
        if p.requires_grad or p.device.type != "meta" or (which and not which(p)):
            continue
        data = values(name, 0, p.numel()).view(p.shape).to(device=device, dtype=dtype)
        rebind(p, data, owners)  # a new parameter in every module that registers it
        held += p.numel()
    return held


def frozen_bytes(chunks: list[nn.Module]) -> int:
    """Bytes of the frozen parameters held (outside any engine), each storage once, and
    of the NF4 codes and scales of a quantised base."""
    storages = {}
    for chunk in chunks:
        for p in chunk.parameters():
            if not p.requires_grad and p.device.type != "meta":
                storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(storages.values()) + quantized_bytes(chunks)
