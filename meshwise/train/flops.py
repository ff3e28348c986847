"""FLOPs per token from a model's own shapes (PaLM's convention, Chowdhery et al. 2022,
appendix B, as torchtitan and Megatron-LM report), the device's peak, and MFU and HFU.
See docs/watching.md "FLOPs and MFU".
"""

from __future__ import annotations

import time

import torch
from torch import nn

from meshwise.apply.lora import ADAPTER_NAMES

# Dense peaks from the vendors' data sheets (SXM/flagship parts), FLOP/s.
GPU_PEAKS = {  # name fragment: {dtype: peak}
    "H200": {torch.bfloat16: 989e12, torch.float32: 67e12},
    "H100": {torch.bfloat16: 989e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float32: 19.5e12},
    "L40S": {torch.bfloat16: 362e12, torch.float32: 91.6e12},
    "A10G": {torch.bfloat16: 70e12, torch.float32: 31.2e12},
}


def matmul_params(model: nn.Module) -> int:
    """Parameters a forward multiplies by: every ``nn.Linear``'s weight (a tied
    head counts as the head it is) and the LoRA adapters beside them."""
    return sum(p.numel() for p in _matmul_weights(model))


def frozen_matmul_params(model: nn.Module) -> int:
    """The part of ``matmul_params`` that does not train (LoRA's frozen base)."""
    return sum(p.numel() for p in _matmul_weights(model) if not p.requires_grad)


def _matmul_weights(model: nn.Module):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            yield m.weight
            yield from (a for a in (getattr(m, n, None) for n in ADAPTER_NAMES) if a is not None)


def flops_per_token(
    model: nn.Module,
    layers: list[nn.Module],
    n_layer: int,
    d_model: int,
    seq_len: int,
    recomputed: bool = False,
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token of a training step: forward and backward
    of ``model`` (the whole, single-process one; the meta device will do) and, with
    ``recomputed``, one more forward of each of its ``layers``."""
    # A multiply-add counts 2 FLOPs forward and 4 backward: 6 per linear-layer parameter
    # (head included, embedding lookups not), 4 for a frozen one (the input's gradient, not
    # its own; the first layer's projections, whose input needs none, are counted alike).
    # Attention counts the whole T x T product, as the peers and torch.utils.flop_counter
    # do, though a causal kernel computes about half.
    attention = 12 * n_layer * d_model * seq_len
    model_flops = 6 * matmul_params(model) - 2 * frozen_matmul_params(model) + attention
    if not recomputed:
        return float(model_flops), float(model_flops)
    again = 2 * sum(matmul_params(layer) for layer in layers) + attention / 3
    return float(model_flops), float(model_flops + again)


def gpu_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """The data-sheet dense peak of this GPU in ``dtype`` (None for one we do not know)."""
    name = torch.cuda.get_device_name(device)
    return next((peaks.get(dtype) for key, peaks in GPU_PEAKS.items() if key in name), None)


def measured_peak(
    device: torch.device, dtype: torch.dtype, size: int = 1024, budget_s: float = 0.1
) -> float:
    """FLOP/s of a ``size``-square matrix multiply here: the best of as many as fit in
    ``budget_s`` (at least 5; the best is the least disturbed by other work)."""
    a = torch.randn(size, size, device=device).to(dtype)
    a @ a  # warm-up
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 5 or spent < budget_s:
        start = time.perf_counter()
        a @ a
        if device.type != "cpu":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return 2 * size**3 / best


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """This rank's peak FLOP/s in ``dtype`` and where it comes from."""
    if device.type == "cuda":
        peak = gpu_peak(device, dtype)
        if peak is not None:
            return peak, f"{torch.cuda.get_device_name(device)} data sheet"
    return measured_peak(device, dtype), "a matrix multiply measured at start-up"
