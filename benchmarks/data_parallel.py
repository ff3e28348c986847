"""meshwise data parallel (ZeroOptimizer stage 0) vs torch DistributedDataParallel.

Spawns 2 gloo ranks on this machine (one thread each), builds the same model in
both (a residual stack of pre-LayerNorm MLP blocks, d -> 4d -> d, about 4.2M
parameters by default) with the same batches, and times training steps in
alternating rounds (meshwise, DDP, meshwise, DDP, ...) after a warm-up:

- meshwise: ``zero_grad``, forward, backward (buckets all-reduced from grad hooks),
  ``finish_grad_sync``, ``step`` (AdamW on the flat buckets).
- DDP: ``zero_grad``, forward, backward (its reducer all-reduces buckets),
  ``torch.optim.AdamW.step``; the same ``bucket_cap_mb``.

Exposed communication is the time meshwise spends in ``finish_grad_sync`` (what
backward did not hide); total communication is the same bucket all-reduces run
blocking on their own. The last line printed is one JSON object.

    python benchmarks/data_parallel.py [--bucket-mb 4] [--rounds 10 --steps 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

# Runnable from a checkout without installing (spawned ranks re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_round_args,
    median,
    medians,
    new_timings,
    print_json,
    record,
    run_rounds,
    spawn,
    timed_step,
    torch_param_groups,
)
from meshwise.comm import ops  # noqa: E402
from meshwise.sharding.adamw import AdamWConfig  # noqa: E402
from meshwise.sharding.buckets import ZeroOptimizer  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build_model(args) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(args.d_model) for _ in range(args.n_blocks)])


def batches(args, rank: int, count: int):
    gen = torch.Generator().manual_seed(1000 + rank)
    return [
        (
            torch.randn(args.rows, args.d_model, generator=gen),
            torch.randn(args.rows, args.d_model, generator=gen),
        )
        for _ in range(count)
    ]


def mse_backward(model, x, y) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def blocking_all_reduce_s(engine, group, reps: int = 10) -> float:
    """Median time of the engine's bucket all-reduces, run blocking and alone."""
    times = []
    for _ in range(reps):
        ops.barrier(group)
        start = time.perf_counter()
        for buf in (flat.grad for flat in engine.flats):  # stage 0: full gradient buckets
            ops.all_reduce(buf, group, category="bench")
        times.append(time.perf_counter() - start)
    return median(times)


def rank_main(rank: int, args) -> dict | None:
    group = ops.world_group()
    ours = build_model(args)
    adamw = AdamWConfig(lr=1e-4, weight_decay=0.1)
    engine = ZeroOptimizer(
        ours.named_parameters(), group, stage=0, adamw=adamw, bucket_cap_mb=args.bucket_mb
    )
    theirs = nn.parallel.DistributedDataParallel(build_model(args), bucket_cap_mb=args.bucket_mb)
    # The same weight-decay split as meshwise (matrices only), so both do the same work.
    opt = torch.optim.AdamW(
        torch_param_groups(theirs.module.named_parameters(), adamw),
        lr=adamw.lr,
        betas=adamw.betas,
        eps=adamw.eps,
    )

    def meshwise(x, y) -> dict:  # buckets all-reduced from grad hooks during backward
        return timed_step(
            engine.zero_grad,
            lambda: mse_backward(ours, x, y),
            engine.finish_grad_sync,
            lambda: engine.step(1e-4),
        )[1]

    def ddp(x, y) -> dict:  # its reducer all-reduces buckets inside backward
        return timed_step(opt.zero_grad, lambda: mse_backward(theirs, x, y), None, opt.step)[1]

    steps = {"meshwise": meshwise, "ddp": ddp}
    data = batches(args, rank, args.steps)
    # Warm-up: one step each on the first batch, in turn; rounds: all batches of one, then
    # of the other, from a barrier, the order reversed every other round so that neither
    # always runs first (a drifting machine would favour one).
    run_rounds(steps, args.warmup, 1, lambda name, r, i: steps[name](*data[0]))
    timings = new_timings(steps, ("step", "fwd_bwd", "sync", "optim"))
    run_rounds(
        steps,
        args.rounds,
        args.steps,
        lambda name, r, i: record(timings[name], steps[name](*data[i])),
        before_block=lambda name: ops.barrier(group),
    )
    total_comm_s = blocking_all_reduce_s(engine, group)
    if rank != 0:
        return None
    return {
        "timings": timings,
        "total_comm_s": total_comm_s,
        "num_params": sum(p.numel() for p in ours.parameters()),
        "num_buckets": len(engine.plan.buckets),
    }


def report(args, res) -> dict:
    med = medians(res["timings"])
    exposed, total = med["meshwise"]["sync"], res["total_comm_s"]
    summary = {
        "meshwise_step_s": med["meshwise"]["step"],
        "torch_ddp_step_s": med["ddp"]["step"],
        "ratio": med["meshwise"]["step"] / med["ddp"]["step"],
        "exposed_comm_s": exposed,
        "total_comm_s": total,
        "hidden_fraction": max(0.0, 1 - exposed / total) if total > 0 else 0.0,
        "meshwise_optim_s": med["meshwise"]["optim"],
        "torch_ddp_optim_s": med["ddp"]["optim"],
        "num_params": res["num_params"],
        "num_buckets": res["num_buckets"],
        "bucket_mb": args.bucket_mb,
        "world_size": args.world_size,
        "steps_each": args.rounds * args.steps,
    }
    print(
        f"model: {args.n_blocks} MLP blocks, d_model {args.d_model}, "
        f"{res['num_params'] / 1e6:.2f}M params; {args.rows} rows per rank; "
        f"{args.world_size} gloo ranks; bucket_cap_mb {args.bucket_mb} "
        f"({res['num_buckets']} meshwise buckets)"
    )
    print(f"{'':22}{'meshwise':>12}{'torch DDP':>12}")
    print(
        f"{'median step (ms)':22}{1e3 * med['meshwise']['step']:12.2f}"
        f"{1e3 * med['ddp']['step']:12.2f}"
    )
    print(
        f"{'  of which optim (ms)':22}{1e3 * med['meshwise']['optim']:12.2f}"
        f"{1e3 * med['ddp']['optim']:12.2f}"
    )
    print(
        f"{'steps timed':22}{len(res['timings']['meshwise']['step']):12d}"
        f"{len(res['timings']['ddp']['step']):12d}"
    )
    print(f"ratio meshwise / DDP: {summary['ratio']:.3f}")
    print(
        f"grad comm: exposed {1e3 * exposed:.2f} ms of {1e3 * total:.2f} ms blocking "
        f"(hidden fraction {summary['hidden_fraction']:.2f})"
    )
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--d-model", type=int, default=256, help="block width (default 256)")
    p.add_argument("--n-blocks", type=int, default=8, help="MLP blocks (default 8)")
    p.add_argument("--rows", type=int, default=128, help="rows per rank per step (default 128)")
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=4.0,
        help="bucket_cap_mb for both (default 4: several buckets to overlap)",
    )
    add_round_args(p, warmup=3, rounds=10, steps=3)
    args = p.parse_args(argv)
    results = spawn(
        rank_main, args.world_size, args, timeout_s=120, ignore_warnings=[FutureWarning]
    )
    print_json(report(args, results[0]))


if __name__ == "__main__":
    main()
