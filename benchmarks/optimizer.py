"""The optimizer step: meshwise's engine beside ``torch.optim.AdamW(fused=True)``.

Both sides hold the same number of fp32 parameters in the same tensors, shaped
like a Llama's (an embedding, then per layer four attention matrices, three
SwiGLU matrices and two norm vectors; default about 100M parameters), with
the same random gradients, hyperparameters and weight-decay split (matrices
only), and take the same step:

* ``meshwise``: what ``meshwise train`` does in its optimizer phase at dp 1
  (``ZeroOptimizer`` at stage 0, the path of ``--dp 1``): the global gradient
  norm, the non-finite check and the clipping scale on the device, then
  ``engine.step`` (AdamW, with ``--dtype bf16`` also the copy of the fp32
  master weights into the bf16 compute weights);
* ``torch``: ``torch.nn.utils.clip_grad_norm_`` (foreach) and
  ``torch.optim.AdamW(fused=True).step()``; with ``--clip 0`` the fused step
  alone (meshwise still computes the norm: its metrics and its non-finite
  check need it).

Steps alternate between the variants in rounds (the order reversed every other
round); each is timed on its own, from before the norm to after the step (on
CUDA with ``torch.cuda.synchronize()`` at both ends). The last line is one JSON
object with the medians and their ratio.

    python benchmarks/optimizer.py [--params 100e6 --device cpu --dtype fp32 --clip 1.0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.common import add_round_args, median, new_timings, print_json, quartiles, run_rounds  # noqa: E402
from meshwise.cli.launch import free_port  # noqa: E402
from meshwise.comm import ops  # noqa: E402
from meshwise.sharding.adamw import AdamWConfig, decays  # noqa: E402
from meshwise.sharding.buckets import ZeroOptimizer  # noqa: E402
from meshwise.sharding.flat import Precision  # noqa: E402

VOCAB = 32000
ADAMW = AdamWConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def llama_shapes(num_params: float, d_model: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama-like model with about ``num_params`` parameters."""
    ffn = 256 * ((8 * d_model // 3 + 255) // 256)  # SwiGLU's width, rounded as Llama's
    layer = [
        ("q", (d_model, d_model)),
        ("k", (d_model, d_model)),
        ("v", (d_model, d_model)),
        ("o", (d_model, d_model)),
        ("gate", (ffn, d_model)),
        ("up", (ffn, d_model)),
        ("down", (d_model, ffn)),
        ("attn_norm", (d_model,)),
        ("mlp_norm", (d_model,)),
    ]
    per_layer = sum(torch.Size(s).numel() for _, s in layer)
    num_layers = max(1, round((num_params - VOCAB * d_model) / per_layer))
    shapes = [("embed", (VOCAB, d_model))]
    shapes += [(f"layers.{i}.{n}", s) for i in range(num_layers) for n, s in layer]
    return shapes + [("norm", (d_model,))]


def make_params(shapes, device, dtype=torch.float32) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return {
        name: torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device, dtype))
        for name, shape in shapes
    }


def random_grads(shapes, device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {name: (torch.randn(shape, generator=gen) * 1e-3).to(device) for name, shape in shapes}


class MeshwiseStep:
    """The engine at dp 1 with the gradients in its buckets, stepped as the trainer does."""

    def __init__(self, shapes, grads, device, dtype: torch.dtype, clip: float):
        params = make_params(shapes, device, dtype)
        group = ops.world_group(device=device)
        self.engine = ZeroOptimizer(
            params.items(),
            group,
            stage=0,
            adamw=ADAMW,
            precision=Precision(param_dtype=dtype),
            device=device,
        )
        self.clip = clip
        # One backward delivers a gradient to every parameter, as training would;
        # then the buckets take the benchmark's gradients.
        self.engine.zero_grad()
        sum(p.float().sum() for p in params.values()).backward()
        self.engine.finish_grad_sync()
        with torch.no_grad():
            for name in params:
                self.engine.grad_of(name).copy_(grads[name])

    def __call__(self) -> None:
        # meshwise.train.trainer: norm, skip and scale on the device, then the step.
        sq_norm = self.engine.grad_sq_norm()
        skip = ~torch.isfinite(sq_norm)
        scale = (self.clip / (sq_norm.sqrt() + 1e-6)).clamp(max=1.0) if self.clip > 0 else 1.0
        self.engine.step(ADAMW.lr, scale, skip)


class TorchStep:
    """``clip_grad_norm_`` and ``torch.optim.AdamW(fused=True)`` on the same tensors."""

    def __init__(self, shapes, grads, device, clip: float):
        params = make_params(shapes, device)
        for name, p in params.items():
            p.grad = grads[name].clone()
        groups = [
            {
                "params": [p for n, p in params.items() if decays(n, p)],
                "weight_decay": ADAMW.weight_decay,
            },
            {"params": [p for n, p in params.items() if not decays(n, p)], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            groups, lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps, fused=True
        )
        self.params, self.clip = list(params.values()), clip

    def __call__(self) -> None:
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--params", type=float, default=100e6, help="about how many parameters (default 100e6)"
    )
    p.add_argument("--d-model", type=int, default=1024, help="model width (default 1024)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both sides run (default cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="meshwise's compute weights (bf16: fp32 master copy kept by the "
        "engine and cast after each step); torch's are fp32 (default fp32)",
    )
    p.add_argument(
        "--clip",
        type=float,
        default=1.0,
        help="max global gradient norm; 0 turns clipping off (default 1.0)",
    )
    add_round_args(p, warmup=2, rounds=10, steps=2)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print_json({"skipped": "--device cuda, but there is no CUDA device"})
        return
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"
    )
    ops.init_process_group("gloo", timeout_s=300.0)  # one rank: its collectives are no-ops

    shapes = llama_shapes(args.params, args.d_model)
    num_params = sum(torch.Size(s).numel() for _, s in shapes)
    grads = random_grads(shapes, device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    steps = {
        "meshwise": MeshwiseStep(shapes, grads, device, dtype, args.clip),
        "torch": TorchStep(shapes, grads, device, args.clip),
    }
    del grads
    timings = new_timings(steps, ["step"])

    def one_step(name: str, _round: int, _i: int, record: bool = True) -> None:
        _sync(device)
        start = time.perf_counter()
        steps[name]()
        _sync(device)
        if record:
            timings[name]["step"].append(time.perf_counter() - start)

    run_rounds(
        steps, 1, args.warmup, lambda n, r, i: one_step(n, r, i, record=False), alternate=False
    )
    run_rounds(steps, args.rounds, args.steps, one_step)
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "num_params": num_params,
        "num_tensors": len(shapes),
        "dtype": args.dtype,
        "clip": args.clip,
    }
    for name, t in timings.items():
        q1, med, q3 = quartiles(t["step"])
        summary[name] = {
            "step_ms": med * 1e3,
            "q1_ms": q1 * 1e3,
            "q3_ms": q3 * 1e3,
            "ns_per_param": med * 1e9 / num_params,
        }
        print(
            f"{name:9s} step {med * 1e3:8.2f} ms  (q1 {q1 * 1e3:.2f}, q3 {q3 * 1e3:.2f}), "
            f"{med * 1e9 / num_params:.3f} ns/parameter",
            flush=True,
        )
    ratio = median(timings["meshwise"]["step"]) / median(timings["torch"]["step"])
    summary["meshwise_over_torch"] = ratio
    print(f"meshwise / torch fused AdamW: {ratio:.3f}x", flush=True)
    ops.destroy_process_group()
    print_json(summary)


if __name__ == "__main__":
    main()
