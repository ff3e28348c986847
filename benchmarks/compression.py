"""Gradient compression: bytes, final loss and step time per compressor, beside DDP's hooks.

Three parts, each printed as a table, then one JSON line with everything:

1. ``meshwise train --dp 2`` for ``--steps`` (300) steps of the tiny preset with
   every ``--compress`` value, and without error feedback for the lossy ones:
   bytes on the wire per step (``grad_sync_bytes``, all ranks), the compression
   ratio, the final loss (mean of the last 10 steps) against uncompressed, and
   the median step time. "bytes vs none" is the median step (after warm-ups);
   "whole run" divides the mean bytes of all steps, warm-up and top-k's
   density ramp included.
2. The same compressors on a GPT with ``--d-model 512`` for a few steps (PowerSGD
   warm-up 1): the ratio at that width, where rank-4 factors are small.
3. PyTorch DDP on the same model, data, schedule and AdamW, with no hook,
   ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4, error feedback, warm
   start, the same 10 uncompressed steps): bytes (each all-reduce the hooks
   issue, counted at ``2 (p-1)/p`` of its size like ours; the no-hook reducer's
   buckets likewise), final loss and step time.

    python benchmarks/compression.py [--steps 300] [--skip-wide] [--skip-ddp]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout; spawned ranks re-import this file

VARIANTS = [
    ("none", True),
    ("fp16", True),
    ("bf16", True),
    ("int8", True),
    ("topk:0.01", True),
    ("powersgd:4", True),
    ("int8", False),
    ("topk:0.01", False),
    ("powersgd:4", False),
]
TARGET = {"fp16": 0.02, "bf16": 0.02, "int8": 0.02, "topk:0.01": 0.05, "powersgd:4": 0.05}
LAST = 10  # steps averaged for the final loss


def _env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
        PYTHONUNBUFFERED="1",
    )


def train(args, workdir: Path, name: str, *flags) -> list[dict]:
    metrics = workdir / f"{name.replace(':', '_')}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "meshwise",
        "train",
        "--dp",
        "2",
        "--steps",
        str(args.steps),
        "--metrics",
        str(metrics),
        "-q",
        *(["--data", args.data] if args.data else []),
        *map(str, flags),
    ]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summarize(records: list[dict]) -> dict:
    return {
        "final_loss": statistics.fmean(r["loss"] for r in records[-LAST:]),
        "bytes_per_step": statistics.median(r["grad_sync_bytes"] for r in records),
        # warm-up and top-k's density ramp included: what the whole run sent per step
        "mean_bytes_per_step": statistics.fmean(r["grad_sync_bytes"] for r in records),
        "compress_ratio": statistics.median(r.get("compress_ratio", 1.0) for r in records),
        "step_time_s": statistics.median(r["step_time_s"] for r in records[1:]),
    }


def part_meshwise(args, workdir: Path) -> list[dict]:
    rows = []
    for spec, ef in VARIANTS:
        flags = ["--compress", spec] + ([] if ef else ["--error-feedback", "off"])
        row = {
            "compress": spec,
            "error_feedback": ef,
            **summarize(train(args, workdir, f"{spec}-{ef}", *flags)),
        }
        rows.append(row)
        print(f"  done: {spec} error feedback {'on' if ef else 'off'}", file=sys.stderr)
    base = rows[0]
    for row in rows:
        row["loss_vs_none"] = row["final_loss"] / base["final_loss"] - 1
        row["bytes_vs_none"] = row["bytes_per_step"] / base["bytes_per_step"]
        row["run_bytes_vs_none"] = row["mean_bytes_per_step"] / base["mean_bytes_per_step"]
    return rows


def part_wide(args, workdir: Path) -> list[dict]:
    rows = []
    for spec, _ in VARIANTS[:6]:
        records = train(
            argparse.Namespace(**{**vars(args), "steps": 4}),
            workdir,
            f"wide-{spec}",
            "--d-model",
            "512",
            "--compress",
            spec,
            "--compress-warmup-steps",
            "1",
            "--topk-ramp-steps",
            "0",
            "--warmup-steps",
            "2",
        )
        rows.append(
            {
                "compress": spec,
                "compress_ratio": records[-1].get("compress_ratio", 1.0),
                "bytes_per_step": records[-1]["grad_sync_bytes"],
            }
        )
    return rows


# ------------------------------------------------------------------- DDP
def ddp_rank(rank: int, data_path: str, hook: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from meshwise.data.dataset import TokenDataset
    from meshwise.models.gpt import GPT, GPTConfig
    from meshwise.train.lr_schedule import lr_at

    world, seq, batch, seed = dist.get_world_size(), 128, 16, 1234
    dataset = TokenDataset(data_path, seq)
    # The tiny preset with the initial values meshwise train draws from its --seed.
    model = torch.nn.parallel.DistributedDataParallel(
        GPT(
            GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=256, vocab_size=256)
        ).init_weights(seed)
    )
    sent = [0.0]
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **kw):  # what the hooks put on the wire
        sent[0] += 2 * (world - 1) / world * tensor.numel() * tensor.element_size() * world
        return real_all_reduce(tensor, *a, **kw)

    dist.all_reduce = counting_all_reduce
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=4,
            start_powerSGD_iter=10,
            use_error_feedback=True,
            warm_start=True,
        )
        model.register_comm_hook(state, psgd.powerSGD_hook)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    losses, times, sent_per_step = [], [], []
    for step in range(1, steps + 1):
        start, before = time.perf_counter(), sent[0]
        rows = dataset.global_batch(step, batch, seed).chunk(world)[rank]  # (B / world, T + 1)
        logits = model(rows[:, :-1])  # (B / world, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, 1e-3, 20, steps)
        opt.step()
        times.append(time.perf_counter() - start)
        total = loss.detach().clone()
        real_all_reduce(total)
        losses.append(total.item() / world)
        # No hook: DDP's C++ reducer all-reduces every gradient byte (not seen by the patch).
        sent_per_step.append(sent[0] - before if hook != "none" else 2 * (world - 1) * grad_bytes)
    return {
        "losses": losses,
        "step_time_s": statistics.median(times[1:]),
        "bytes_per_step": statistics.median(sent_per_step),
    }


def part_ddp(args, workdir: Path) -> list[dict]:
    from benchmarks.common import spawn
    from meshwise.data.dataset import resolve_data

    data_path = str(resolve_data(args.data, None))
    rows = []
    for hook in ("none", "fp16", "powersgd"):
        result = spawn(ddp_rank, 2, data_path, hook, args.steps)[0]
        rows.append(
            {
                "hook": hook,
                "final_loss": statistics.fmean(result["losses"][-LAST:]),
                "bytes_per_step": result["bytes_per_step"],
                "step_time_s": result["step_time_s"],
            }
        )
        print(f"  done: DDP hook {hook}", file=sys.stderr)
    for row in rows:
        row["bytes_vs_none"] = row["bytes_per_step"] / rows[0]["bytes_per_step"]
        row["loss_vs_none"] = row["final_loss"] / rows[0]["final_loss"] - 1
    return rows


def report(mesh, wide, ddp, steps: int) -> None:
    print(
        f"\nmeshwise train --dp 2, tiny preset, {steps} steps (final loss: mean of the last {LAST})"
    )
    print(
        f"{'compress':<12} {'EF':<4} {'MiB/step':>9} {'ratio':>7} {'bytes vs none':>14} "
        f"{'whole run':>10} {'final loss':>11} {'vs none':>8} {'target':>7} {'step ms':>8}"
    )
    for r in mesh:
        target = TARGET.get(r["compress"])
        ok = (
            ""
            if target is None or not r["error_feedback"]
            else (f"{'ok' if abs(r['loss_vs_none']) <= target else 'MISS'} {target:.0%}")
        )
        print(
            f"{r['compress']:<12} {'on' if r['error_feedback'] else 'off':<4} "
            f"{r['bytes_per_step'] / 2**20:>9.3f} {r['compress_ratio']:>7.1f} "
            f"{r['bytes_vs_none']:>14.4f} {r['run_bytes_vs_none']:>10.4f} "
            f"{r['final_loss']:>11.4f} {r['loss_vs_none']:>+8.2%} {ok:>7} "
            f"{r['step_time_s'] * 1e3:>8.1f}"
        )
    if wide:
        print("\n--d-model 512 (bytes of one compressed step, dp 2)")
        for r in wide:
            print(
                f"{r['compress']:<12} ratio {r['compress_ratio']:>7.1f}  "
                f"({r['bytes_per_step'] / 2**20:.3f} MiB/step)"
            )
    if ddp:
        print(f"\nPyTorch DDP on the same model, data and AdamW, {steps} steps")
        print(
            f"{'hook':<10} {'MiB/step':>9} {'bytes vs none':>14} {'final loss':>11} "
            f"{'vs none':>8} {'step ms':>8}"
        )
        for r in ddp:
            print(
                f"{r['hook']:<10} {r['bytes_per_step'] / 2**20:>9.3f} "
                f"{r['bytes_vs_none']:>14.4f} "
                f"{r['final_loss']:>11.4f} {r['loss_vs_none']:>+8.2%} "
                f"{r['step_time_s'] * 1e3:>8.1f}"
            )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--data", default=None, help="as meshwise train --data (default corpus)")
    parser.add_argument("--skip-wide", action="store_true")
    parser.add_argument("--skip-ddp", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        mesh = part_meshwise(args, workdir)
        wide = [] if args.skip_wide else part_wide(args, workdir)
        ddp = [] if args.skip_ddp else part_ddp(args, workdir)
    report(mesh, wide, ddp, args.steps)
    print(json.dumps({"meshwise": mesh, "d_model_512": wide, "ddp": ddp}))


if __name__ == "__main__":
    main()
