"""LoRA and QLoRA in the planner (pure): the adapters and NF4 weights a model's layer holds
(counted from the layer itself, as ``meshwise.apply.lora`` and ``meshwise.apply.nf4``
choose them), the share of them a rank holds (``shape``: a ``ModelShape``, which holds
a ``LoraShape``), and what dequantising costs.

Under LoRA only the adapters train (Hu et al. 2021): A (r x in) and B (out x r) per
targeted linear layer. Under tp a column-parallel layer's B is split and its A
replicated; a row-parallel layer's A is split and its B replicated. QLoRA (Dettmers et
al. 2023) holds every frozen linear weight of the blocks as NF4: half a byte of code per
value and an fp32 scale per block of ``BLOCK_SIZE`` values, on every rank, never sharded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshwise.apply.lora import ALL_LINEAR, LoraConfig, targeted_layers
from meshwise.apply.nf4 import BLOCK_SIZE, LINEAR_TYPES, quantizable_layers
from meshwise.planner.layout import Layout

NF4_BYTES_PER_PARAM = 0.5 + 4 / BLOCK_SIZE  # two codes a byte, an fp32 absmax per block
# Bytes one dequantise moves per weight value (``meshwise.apply.nf4.dequantize_nf4``'s eager
# kernels, counted by tests/unit/test_planner_lora.py): the codes widened to int32 indices,
# one per byte of two values, each byte's two fp32 values looked up, and scaled in place;
# bf16 adds the cast (4 + 2).
DEQUANTIZE_BYTES = {"fp32": 21.1, "bf16": 27.1}
DEQUANTIZE_KERNELS = {"fp32": 6, "bf16": 7}
# The transient of the layer dequantising, per value: its fp32 values and, where the
# lookup takes a weight at once (an accelerator), an int32 index per byte of two codes.
DEQUANTIZE_WORKING_BYTES = 6
# ``LoraShape`` fields counted per layer (averaged over a mixture of experts' layers)
PER_LAYER = ("adapter_split", "adapter_replicated", "nf4_split", "nf4_replicated", "nf4_linears")


@dataclass(frozen=True)
class LoraShape:
    """What LoRA adds to one model: adapter parameters and NF4-held weights per layer,
    split over tp or held whole by every tp rank."""

    rank: int
    quantized: bool  # --quantize-base nf4
    adapter_split: float = 0.0
    adapter_replicated: float = 0.0
    adapter_root: int = 0  # adapters outside the blocks (a head named as a target)
    nf4_split: float = 0.0
    nf4_replicated: float = 0.0
    nf4_linears: float = 0.0  # quantised linear layers per layer
    nf4_largest: int = 0  # values of the largest quantised weight, whole
    nf4_rows: tuple[tuple[int, bool], ...] = ()  # (in_features, split by tp) of each


def lora_key(lora: LoraConfig) -> tuple | None:
    """What of ``--lora-*`` the shapes depend on (None without LoRA)."""
    if not lora.enabled:
        return None
    return (lora.lora_rank, lora.lora_targets, lora.quantize_base)


def layer_counts(model, plan, key: tuple, strict: bool) -> dict[str, Any]:
    """``LoraShape``'s counts of the one-layer ``model`` (on meta) under LoRA setting
    ``key``. ``strict``: every target must name a linear layer of it (a mixture of
    experts' MoE layer may lack a dense layer's MLP: there a target may match none)."""
    rank, targets, quantize_base = key
    lora = LoraConfig(lora_rank=rank, lora_targets=targets, quantize_base=quantize_base)
    counts: dict[str, Any] = {name: 0 for name in PER_LAYER}
    counts.update(adapter_root=0, nf4_largest=0, nf4_rows=set())
    prefix = plan.layers + "."
    for path, module in _targeted(model, lora, plan.last_stage, strict):
        style = plan.tp_style(path)
        a, b = rank * module.in_features, module.out_features * rank
        if not path.startswith(prefix):
            counts["adapter_root"] += a + b
            continue
        split = (a if style == "rowwise" else 0) + (b if style == "colwise" else 0)
        counts["adapter_split"] += split
        counts["adapter_replicated"] += a + b - split
    if quantize_base != "nf4":
        return counts
    for path, module in quantizable_layers(model, plan.last_stage):
        style = plan.tp_style(path)
        split = style in ("colwise", "rowwise")
        counts["nf4_split" if split else "nf4_replicated"] += module.weight.numel()
        counts["nf4_linears"] += 1
        counts["nf4_largest"] = max(counts["nf4_largest"], module.weight.numel())
        counts["nf4_rows"].add((module.in_features, style == "rowwise"))
    return counts


def _targeted(model, lora: LoraConfig, skip, strict: bool):
    if strict:
        return targeted_layers(model, lora, skip)
    paths = [p for p, m in model.named_modules() if isinstance(m, LINEAR_TYPES)]
    present = [
        t
        for t in lora.target_names
        if t == ALL_LINEAR or any(p == t or p.endswith("." + t) for p in paths)
    ]
    if not present:
        return []
    return targeted_layers(model, dataclasses.replace(lora, lora_targets=",".join(present)), skip)


def lora_shape(key: tuple, counts: dict[str, Any]) -> LoraShape:
    """The ``LoraShape`` of ``layer_counts``' (averaged) counts."""
    rows = tuple(sorted(counts["nf4_rows"]))
    fields = {name: counts[name] for name in (*PER_LAYER, "adapter_root", "nf4_largest")}
    return LoraShape(rank=key[0], quantized=key[2] == "nf4", nf4_rows=rows, **fields)


def rank_lora_params(shape, layout: Layout, is_last: bool) -> tuple[float, float]:
    """(adapter parameters, NF4-held weights) of one rank: its stage's layers' tp share,
    and the adapters outside the blocks on the last stage."""
    lora = shape.lora
    if lora is None:
        return 0.0, 0.0
    t, layers = layout.tp, shape.n_layer // layout.pp
    adapters = layers * (lora.adapter_split / t + lora.adapter_replicated)
    adapters += lora.adapter_root if is_last else 0
    return adapters, layers * (lora.nf4_split / t + lora.nf4_replicated)


def nf4_fits_tp(shape, tp: int) -> bool:
    """Whether each rank's row of every quantised weight is whole NF4 blocks under ``tp``
    (the rule ``meshwise.train.lora_setup.check_nf4_rows`` holds a run to)."""
    if shape.lora is None or not shape.lora.quantized:
        return True
    return all((n // tp if split else n) % BLOCK_SIZE == 0 for n, split in shape.lora.nf4_rows)


def dequantize_s(shape, layout: Layout, dtype: str, device) -> float:
    """Seconds to dequantise one layer's NF4 weights once (memory-bound, eager kernels)."""
    lora = shape.lora
    if lora is None or not lora.quantized:
        return 0.0
    values = lora.nf4_split / layout.tp + lora.nf4_replicated
    kernels = lora.nf4_linears * DEQUANTIZE_KERNELS[dtype] * device.op_overhead_s
    return values * DEQUANTIZE_BYTES[dtype] / device.memory_bandwidth + kernels
