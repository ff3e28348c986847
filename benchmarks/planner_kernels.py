"""The rates a GPU profile of the planner stands on, measured on this machine's GPU.

``python benchmarks/planner_kernels.py --json rates.json`` times, in bf16 with
CUDA events (median of repeats after a warm-up):

- the matmuls of one Llama layer and its head, forward, input gradient and
  weight gradient, at Llama-3.2-1B's sizes (8,192 tokens) and Llama 3 8B's
  (16,384 tokens: torchtitan's local batch 2 at 8,192);
- causal grouped-query attention (``scaled_dot_product_attention``, as
  meshwise calls it) forward and backward at 2,048 and 8,192 tokens, its FLOPs
  counted as FlashAttention counts them (causal: half of 4 B H T^2 d forward,
  2.5 times that backward);
- a device-to-device copy (HBM bandwidth) and meshwise's RMSNorm forward and
  backward (an eager element-wise chain: its bytes moved over its time).

``--trace FILE`` instead sums the GPU kernels of a ``meshwise train
--profile-steps`` trace by kind (matmul, attention, communication, the rest),
per profiled step, with the time no kernel ran.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # tokens, d_model, q width, kv width, MLP, vocabulary
    "llama-1b": (8192, 2048, 2048, 512, 8192, 32000),
    "llama3-8b": (16384, 4096, 4096, 1024, 14336, 128256),
}
ATTENTION = {"llama-1b": (4, 32, 8, 2048), "llama3-8b": (2, 32, 8, 8192)}  # B, H, Hkv, T


def timed(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` on the current CUDA device."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def matmuls(name: str, device) -> dict:
    """TFLOP/s of each weight's three matmuls, and of the layer's and head's together."""
    tokens, d, q, kv, ffn, vocab = SHAPES[name]
    weights = {
        "q": (d, q),
        "k": (d, kv),
        "v": (d, kv),
        "o": (q, d),
        "gate": (d, ffn),
        "up": (d, ffn),
        "down": (ffn, d),
        "head": (d, vocab),
    }
    out, layer_flops, layer_s = {}, 0.0, 0.0
    for key, (fan_in, fan_out) in weights.items():
        x = torch.randn(tokens, fan_in, device=device, dtype=torch.bfloat16)
        w = torch.randn(fan_out, fan_in, device=device, dtype=torch.bfloat16)
        dy = torch.randn(tokens, fan_out, device=device, dtype=torch.bfloat16)
        flops = 2.0 * tokens * fan_in * fan_out
        seconds = _three_passes(x, w, dy)
        out[key] = {p: flops / s / 1e12 for p, s in seconds.items()}
        if key != "head":
            layer_flops += 3 * flops
            layer_s += sum(seconds.values())
    out["layer_tflops"] = layer_flops / layer_s / 1e12
    return out


def _three_passes(x, w, dy) -> dict:
    """Seconds of a linear layer's forward, input gradient and weight gradient."""
    return {
        "forward": timed(lambda: F.linear(x, w)),
        "input_grad": timed(lambda: dy @ w),
        "weight_grad": timed(lambda: dy.t() @ x),
    }


def attention(name: str, device) -> dict:
    """Forward and backward TFLOP/s of causal grouped-query attention."""
    b, h, hkv, t = ATTENTION[name]
    hd = 128
    q = torch.randn(b, h, t, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, t, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, t, hd, device=device, dtype=torch.bfloat16, requires_grad=True)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out = forward()
    grad = torch.randn_like(out)
    fwd = timed(forward)
    both = timed(lambda: torch.autograd.grad(forward(), (q, k, v), grad))
    flops = 4.0 * b * h * t * t * hd / 2
    return {
        "forward": flops / fwd / 1e12,
        "backward": 2.5 * flops / (both - fwd) / 1e12,
        "forward_s": fwd,
        "backward_s": both - fwd,
    }


def bandwidth(device) -> dict:
    """GB/s of a 2 GiB copy, and of meshwise's RMSNorm forward + backward (bytes: its
    eager kernels' reads and writes, counted below)."""
    from meshwise.models.llama import RMSNorm

    copy = _copy_gbs(device)
    tokens, d = SHAPES["llama3-8b"][:2]
    norm = RMSNorm(d, 1e-5).to(device)
    x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
    seconds = timed(lambda: torch.autograd.grad(norm(x), (x,), dy))
    return {
        "copy_gbs": copy,
        "rmsnorm_fwd_bwd_s": seconds,
        "rmsnorm_s_per_token_elem": seconds / (tokens * d),
    }


def _copy_gbs(device) -> float:
    """GB/s of a 2 GiB device-to-device copy, counting what it reads and writes."""
    src = torch.empty(2**30, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / timed(lambda: dst.copy_(src)) / 1e9


KINDS = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.IGNORECASE)),
    ("communication", re.compile(r"nccl", re.IGNORECASE)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|sm90_|sm80_|cublas", re.IGNORECASE)),
]


def summarise_trace(path: Path, steps: int) -> dict:
    """Seconds per step of GPU kernels by kind, and of the span no kernel covered."""
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    by_kind: dict[str, float] = {}
    top: dict[str, float] = {}
    for e in kernels:
        kind = next((k for k, pattern in KINDS if pattern.search(e["name"])), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"] / 1e6 / steps
        top[e["name"][:90]] = top.get(e["name"][:90], 0.0) + e["dur"] / 1e6 / steps
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, None
    for lo, hi in spans:
        if end is None or lo > end:
            busy, end = busy + (hi - lo), hi
        elif hi > end:
            busy, end = busy + (hi - end), hi
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    return {
        "per_step_s": by_kind,
        "busy_s": busy / 1e6 / steps,
        "idle_s": (span - busy) / 1e6 / steps,
        "top_kernels_s": dict(sorted(top.items(), key=lambda kv: -kv[1])[:25]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--trace", type=Path, help="summarise this profiler trace instead")
    parser.add_argument("--steps", type=int, default=2, help="steps the trace holds")
    args = parser.parse_args()
    if args.trace:
        result = summarise_trace(args.trace, args.steps)
    else:
        device = torch.device("cuda")
        result = {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "bandwidth": bandwidth(device),
        }
        for name in SHAPES:
            result[name] = {"matmul": matmuls(name, device), "attention": attention(name, device)}
            torch.cuda.empty_cache()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
