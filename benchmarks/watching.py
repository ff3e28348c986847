"""What watching a run costs, and whether its MFU is right.

1. **Logger overhead**, from outside: ``meshwise train`` (the tiny preset on 2
   gloo ranks) with ``--log-to none`` and with each logger in ``--loggers``,
   each at ``--steps`` and three times as many steps, alternating, ``--rounds``
   times. A step's cost is the slope between the two: the difference of the
   processes' wall times over the extra steps, so start-up (importing a
   library, opening a run) drops out. The overhead is the logger's slope over
   ``none``'s, minus one.
2. **MFU on a CPU**: ``meshwise train --dp 1`` reports MFU against the matrix
   multiply rate it measures at start-up. A plain PyTorch loop over the same
   GPT (``meshwise.models.gpt.GPT``, ``torch.optim.AdamW``, the same batches'
   shapes, one process) is timed too, and its rate put against the peak
   meshwise reported (``tflops / mfu`` of its metrics): the two MFUs should
   agree, since both count the model's FLOPs the same way. The two alternate,
   ``--rounds`` pairs, since on a shared machine one run of each can differ by
   20% on its own.

The last line is one JSON object.

    python benchmarks/watching.py [--rounds 3 --steps 40 --loggers tensorboard]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.common import print_json  # noqa: E402

SHAPE = [
    "--n-layer",
    "4",
    "--d-model",
    "128",
    "--n-head",
    "4",
    "--seq-len",
    "128",
    "--batch-size",
    "16",
]


def _run(folder: Path, steps: int, *flags: str) -> tuple[float, list[dict]]:
    """Wall seconds of ``meshwise train`` and its metrics records."""
    metrics = folder / "m.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "meshwise",
            "train",
            "--steps",
            str(steps),
            "--metrics",
            str(metrics),
            "-q",
            *SHAPE,
            *flags,
        ],
        check=True,
        env=env,
        cwd=folder,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    return wall, [json.loads(line) for line in metrics.read_text().splitlines()]


def logger_overhead(args, folder: Path) -> dict:
    variants = ["none", *args.loggers]
    slopes = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            runs = []
            for steps in (args.steps, 3 * args.steps):
                log_dir = folder / f"logs-{variant}-{steps}-{len(slopes[variant])}"
                runs.append(_run(folder, steps, "--log-to", variant, "--log-dir", str(log_dir))[0])
            slopes[variant].append((runs[1] - runs[0]) / (2 * args.steps))
    base = statistics.median(slopes["none"])
    out = {"step_s": {v: statistics.median(s) for v, s in slopes.items()}}
    out["overhead"] = {v: statistics.median(s) / base - 1 for v, s in slopes.items() if v != "none"}
    return out


def plain_loop_rate(steps: int, warmup: int) -> float:
    """Tokens/s of the same GPT trained by a plain loop in this process."""
    from meshwise.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=128, vocab_size=256))
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen, rates = torch.Generator().manual_seed(0), []
    for step in range(steps):
        tokens = torch.randint(0, 256, (16, 129), generator=gen)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= warmup:
            rates.append(16 * 128 / (time.perf_counter() - start))
    return statistics.median(rates)


def mfu_check(args, folder: Path) -> dict:
    """``--rounds`` alternating pairs (meshwise, then the plain loop), so that the
    machine's drift hits both; medians, and the median of each pair's ratio."""
    threads = torch.get_num_threads()
    mfus, plains = [], []
    for _ in range(args.rounds):
        _, records = _run(folder, 3 * args.steps, "--dp", "1")
        kept = records[args.steps // 2 :]
        peak = statistics.median(r["tflops"] / r["mfu"] for r in kept) * 1e12
        flops_per_token = statistics.median(
            r["tflops"] * 1e12 * r["step_time_s"] / r["tokens"] for r in kept
        )
        mfus.append(statistics.median(r["mfu"] for r in kept))
        torch.set_num_threads(os.cpu_count() or 1)  # as the one rank of --dp 1 runs
        plains.append(plain_loop_rate(3 * args.steps, args.steps // 2) * flops_per_token / peak)
        torch.set_num_threads(threads)
    mfu, plain = statistics.median(mfus), statistics.median(plains)
    return {
        "meshwise_mfu": mfu,
        "plain_loop_mfu": plain,
        "meshwise_vs_plain": mfu / plain,
        "paired_ratios": [m / p for m, p in zip(mfus, plains)],
        "peak_tflops": peak / 1e12,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--loggers",
        nargs="*",
        default=["tensorboard"],
        help="loggers to time against none (tensorboard, wandb, mlflow)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        summary = {
            "logger_overhead": logger_overhead(args, Path(tmp)),
            "mfu": mfu_check(args, Path(tmp)),
        }
    for name, overhead in summary["logger_overhead"]["overhead"].items():
        print(f"--log-to {name}: {overhead:+.2%} per step", flush=True)
    m = summary["mfu"]
    print(
        f"MFU: meshwise {m['meshwise_mfu']:.1%}, plain loop {m['plain_loop_mfu']:.1%} "
        f"(ratio {m['meshwise_vs_plain']:.2f})",
        flush=True,
    )
    print_json(summary)


if __name__ == "__main__":
    main()
