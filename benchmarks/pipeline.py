"""meshwise pipeline schedules vs torch.distributed.pipelining, side by side.

Spawns 2 gloo ranks on this machine (one thread each) and cuts the same GPT
(``meshwise.models.gpt``, identical initial weights everywhere) into pipeline
chunks with ``meshwise.apply.parallelize`` (meshwise: on the meta device, the engine
materialising the chunks as ``meshwise train`` does; torch: a copy of the whole
model holding the same values, cut the same way). Four variants train their
own copy on the same global batches (M micro-batches), in alternating rounds
after a warm-up (every variant ``--steps`` steps per round, the order reversed
every other round) so drift in machine speed hits all alike:

- ``meshwise_1f1b``: ``PipelineRuntime`` on ``build_schedule("1f1b", S, M)``;
- ``torch_1f1b``: ``Schedule1F1B`` over a ``PipelineStage`` of the same chunk;
- ``meshwise_interleaved``: ``build_schedule("interleaved-1f1b", S, M, V=2)``,
  2 chunks per rank (chunk v of rank r is logical stage v*S + r);
- ``torch_interleaved``: ``ScheduleInterleaved1F1B`` over the same 2 stages per rank;
- ``meshwise_zb-h1`` / ``torch_zb-h1``, ``meshwise_zbv`` / ``torch_zbv``,
  ``meshwise_dualpipev`` / ``torch_dualpipev``: the split-backward schedules
  (zbv and dualpipev: rank r holds stages r and 2S-1-r) against
  ``ScheduleInterleavedZeroBubble`` (one stage per rank), ``ScheduleZBVZeroBubble``
  and ``ScheduleDualPipeV``.

A step is the whole optimizer step: zero grad, the schedule (forward + backward
of every micro-batch), AdamW (meshwise: ``ZeroOptimizer`` stage 0 over the
rank's chunk parameters with a dp group of size 1, ``finish_grad_sync`` then
``step``; torch: ``torch.optim.AdamW`` with the same weight-decay split). The
loss is the sum of token cross-entropies divided by the global token count on
both sides (meshwise: ``ParallelModel.loss`` as the runtime's ``loss_fn``;
torch: ``scale_grads=False`` and a ``loss_fn`` on the last chunk's logits). The
tied embedding's two copies (first and last stage) are not synchronised on
either side: that is the trainer's job, not the schedule's.

A rank's step time is its wall time from a barrier to the end of the step; the F,
B and W actions inside it are timed too (meshwise: the runtime's record of each
action; torch: timers around its stage methods), and an idle
ping-pong of one activation gives the p2p latency. ``pipeline_report.py`` turns
these into the tables (slowest-rank medians, the measured bubble beside the
simulator's and the formula's, noise gauges), and the 1-minute load average
before and after is printed. The last line printed is one JSON object.

    python benchmarks/pipeline.py [--rounds 20 --steps 1] [--micro-batches 8]

The torch peers call ``torch.distributed`` directly (a benchmark, not the library).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

# Runnable from a checkout without installing (spawned ranks re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_gpt_args,
    add_round_args,
    median,
    new_timings,
    print_json,
    record,
    run_rounds,
    spawn,
)
from benchmarks.pipeline_report import SCHEDULE_OF, VARIANTS, report  # noqa: E402
from benchmarks.pipeline_runners import build_runner  # noqa: E402
from meshwise.comm import ops  # noqa: E402
from meshwise.mesh import Mesh, ParallelDims  # noqa: E402


# ---------------------------------------------------------------- setup
def global_batch(args, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``index`` (the same on every rank and for every variant)."""
    gen = torch.Generator().manual_seed(1234 + index)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (B, T) each


# ---------------------------------------------------------------- ranks
def agree_failed(failed: bool, world) -> bool:
    """True on every rank if it is True on any."""
    flag = torch.tensor([1.0 if failed else 0.0])
    ops.all_reduce(flag, world, op="max", category="bench")
    return bool(flag.item())


def run_step(name, runner, args, index, world, timings, losses, errors) -> None:
    """One timed (or warm-up, ``timings=None``) step of ``name``; a torch failure on any
    rank disables that variant on every rank, with its exception kept for the report."""
    inputs, targets = global_batch(args, index)
    ops.barrier(world)
    failed = False
    try:
        loss, t = runner.step(inputs, targets)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported
        if name.startswith("meshwise"):
            raise
        errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        errors[name + "_traceback"] = traceback.format_exc()[-3000:]
        failed = True
    if agree_failed(failed, world):
        errors.setdefault(name, "failed on the other rank")
        return
    losses[name].append(loss)
    if timings is not None:
        record(timings[name], t)


def p2p_latency_s(args, mesh: Mesh, reps: int = 30) -> float:
    """Median one-way time of one activation message (micro-batch, T, d_model) fp32 between
    the two ranks, both idle otherwise: half a ping-pong of ``ops.batch_p2p``."""
    buf = torch.zeros(args.batch_size // args.micro_batches, args.seq_len, args.d_model)
    peer, times = 1 - mesh.pp_rank, []
    for _ in range(reps):
        ops.barrier(mesh.world_group)
        start = time.perf_counter()
        if mesh.pp_rank == 0:
            ops.batch_p2p([(buf, peer, 0)], [], mesh.pp_group)
            ops.batch_p2p([], [(buf, peer, 1)], mesh.pp_group)
        else:
            ops.batch_p2p([], [(buf, peer, 0)], mesh.pp_group)
            ops.batch_p2p([(buf, peer, 1)], [], mesh.pp_group)
        times.append((time.perf_counter() - start) / 2)
    return median(times)


def rank_main(rank: int, args) -> dict:
    mesh = Mesh.build(ParallelDims(pp=2))
    world = mesh.world_group
    names = [n for n in VARIANTS if n.split("_", 1)[1] in args.schedules]
    runners, errors = {}, {}
    for name in names:
        failed = False
        try:
            runners[name] = build_runner(name, args, mesh)
        except Exception as exc:  # noqa: BLE001
            if name.startswith("meshwise"):
                raise
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
            failed = True
        if agree_failed(failed, world):
            runners.pop(name, None)
            errors.setdefault(name, "failed on the other rank")
    keys = ("step", "pipeline", "optim", "compute", "fwd", "bwd", "wgt", "compute_cpu")
    timings = new_timings(names, keys)
    losses = {n: [] for n in names}
    index = {n: 0 for n in names}  # each variant sees global batches 0, 1, 2, ... in order

    def step(name: str, timed: bool) -> None:
        if name in runners and name not in errors:
            run_step(
                name,
                runners[name],
                args,
                index[name],
                world,
                timings if timed else None,
                losses,
                errors,
            )
            index[name] += 1

    run_rounds(names, args.warmup, 1, lambda name, r, i: step(name, False), alternate=False)
    run_rounds(names, args.rounds, args.steps, lambda name, r, i: step(name, True))
    num_params = runners[names[0]].num_params
    return {
        "timings": timings,
        "losses": losses,
        "errors": errors,
        "num_params": num_params,
        "p2p_latency_s": p2p_latency_s(args, mesh),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt_args(p, n_layer=8, n_head=8, d_model=256, batch_size=16, lr=3e-4)
    p.add_argument("--vocab-size", type=int, default=256, help="vocabulary (default 256)")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=8,
        help="M micro-batches per step (default 8; a multiple of 2 for interleaved)",
    )
    p.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULE_OF),
        choices=list(SCHEDULE_OF),
        help="which pairs to run (default all)",
    )
    p.add_argument("--seed", type=int, default=0, help="model init seed (default 0)")
    add_round_args(p, warmup=2, rounds=20, steps=1)
    p.add_argument(
        "--timeout-s",
        type=float,
        default=120.0,
        help="gloo timeout, so a peer that hangs fails instead (default 120)",
    )
    p.add_argument("--verbose", action="store_true", help="print tracebacks of torch failures")
    args = p.parse_args(argv)
    if args.n_layer % 4 or args.batch_size % args.micro_batches or args.micro_batches % 2:
        p.error(
            "need n_layer % 4 == 0 (2 ranks x 2 chunks), batch_size % micro_batches == 0 "
            "and micro_batches even (interleaved needs a multiple of pp = 2)"
        )
    load_start = os.getloadavg()[0]
    per_rank = spawn(rank_main, 2, args, timeout_s=args.timeout_s, ignore_warnings=[Warning])
    summary = report(args, per_rank)
    load_end = os.getloadavg()[0]
    summary["loadavg_1min"] = [load_start, load_end]
    print(
        f"1-minute load average before / after: {load_start:.2f} / {load_end:.2f} "
        "(2 cores: above ~2 means other processes competed with the ranks)"
    )
    print_json(summary)


if __name__ == "__main__":
    main()
