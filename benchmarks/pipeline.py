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
import torch.nn.functional as F

# Runnable from a checkout without installing (spawned ranks re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    adamw_config,
    add_gpt_args,
    add_round_args,
    gpt_config,
    median,
    meshwise_gpt,
    new_timings,
    print_json,
    record,
    reference_gpt,
    run_rounds,
    spawn,
    torch_param_groups,
)
from benchmarks.pipeline_report import SCHEDULE_OF, VARIANTS, report, virtual_stages  # noqa: E402
from meshwise.apply.parallelize import parallelize  # noqa: E402
from meshwise.comm import ops  # noqa: E402
from meshwise.mesh import Mesh, ParallelDims  # noqa: E402
from meshwise.models.gpt import gpt_plan  # noqa: E402
from meshwise.pipeline.runtime import PipelineRuntime  # noqa: E402
from meshwise.pipeline.schedules import STAGE_MAP_OF, build_schedule  # noqa: E402
from meshwise.sharding.buckets import ZeroOptimizer  # noqa: E402


# ---------------------------------------------------------------- setup
def global_batch(args, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``index`` (the same on every rank and for every variant)."""
    gen = torch.Generator().manual_seed(1234 + index)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (B, T) each


class Timer:
    """Wraps a callable; adds its wall time to ``seconds`` and this thread's CPU time to
    ``cpu_seconds`` (compute is pure CPU, so cpu/wall < 1 means another process took the
    core: a noise gauge)."""

    def __init__(self, fn):
        self.fn, self.seconds, self.cpu_seconds = fn, 0.0, 0.0

    def __call__(self, *a, **kw):
        start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu_start

    def reset(self) -> None:
        self.seconds = self.cpu_seconds = 0.0


# ---------------------------------------------------------------- runners
class MeshwiseRunner:
    """``engine.zero_grad()``, ``PipelineRuntime.run``, ``finish_grad_sync``, ``step``.

    F, B and W times come from the runtime's own record of each action
    (``action_times()``, the device's clock); a B that runs its weight pass at once
    (schedules without W actions) includes it."""

    def __init__(self, args, mesh: Mesh, key: str):
        S, M, V = mesh.dims.pp, args.micro_batches, virtual_stages(key)
        kind = SCHEDULE_OF[key]
        pm, values = meshwise_gpt(
            gpt_config(args, args.vocab_size),
            args.seed,
            pp_rank=mesh.pp_rank,
            pp_size=S,
            virtual_stages=V,
            stage_map=STAGE_MAP_OF.get(kind, "loop"),
            tie_group=mesh.tie_group,
        )
        self.engine = ZeroOptimizer(
            pm.named_parameters(),
            mesh.dp_group,
            stage=0,
            adamw=adamw_config(args),
            modules=pm.chunks,
            values=values,
        )
        self.chunks = pm.chunks
        self.num_params = sum(p.numel() for _, p in pm.named_parameters())
        self.runtime = PipelineRuntime(
            self.chunks, build_schedule(kind, S, M, V), mesh.pp_group, self.engine, loss_fn=pm.loss
        )
        self.lr, self.scale, self.M = args.lr, 1.0 / (args.batch_size * args.seq_len), M

    def step(self, inputs, targets) -> tuple[float, dict]:
        micro = list(zip(inputs.chunk(self.M), targets.chunk(self.M)))
        start = time.perf_counter()
        self.engine.zero_grad()
        pipe_start, cpu_start = time.perf_counter(), time.thread_time()
        loss = self.runtime.run(micro, self.scale).item()
        pipe_end, cpu = time.perf_counter(), time.thread_time() - cpu_start
        self.engine.finish_grad_sync()
        self.engine.step(self.lr)
        end = time.perf_counter()
        per_kind = {"F": 0.0, "B": 0.0, "W": 0.0}
        for label, a, b in self.runtime.action_times():
            if label != "p2p":
                per_kind[label[0]] += b - a
        # CPU gauge: this thread's CPU time over the whole schedule (waits for messages
        # sleep) against the wall time inside compute actions.
        return loss, {
            "step": end - start,
            "pipeline": pipe_end - pipe_start,
            "optim": end - pipe_end,
            "compute": self.runtime.compute_s,
            "fwd": per_kind["F"],
            "bwd": per_kind["B"],
            "wgt": per_kind["W"],
            "compute_cpu": cpu,
        }


class TorchRunner:
    """``opt.zero_grad()``, ``schedule.step(...)``, ``opt.step()``: torch.distributed.pipelining.

    Its zero-bubble classes: ``ScheduleInterleavedZeroBubble`` with one stage per rank
    (zb-h1), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` over the V's two stages
    (the orders agree with meshwise's: tests/unit/test_zero_bubble.py)."""

    def __init__(self, args, mesh: Mesh, key: str):
        from torch.distributed.pipelining import PipelineStage, schedules

        S, M, V = mesh.dims.pp, args.micro_batches, virtual_stages(key)
        kind = SCHEDULE_OF[key]
        cfg = gpt_config(args, args.vocab_size)
        pm = parallelize(
            reference_gpt(cfg, args.seed),
            gpt_plan(cfg),
            pp_rank=mesh.pp_rank,
            pp_size=S,
            virtual_stages=V,
            stage_map=STAGE_MAP_OF.get(kind, "loop"),
        )
        self.chunks = pm.chunks
        self.num_params = sum(p.numel() for _, p in pm.named_parameters())
        self.stages = [
            PipelineStage(chunk, stage, S * V, torch.device("cpu"))
            for chunk, stage in zip(self.chunks, pm.stages)
        ]
        self.is_first = any(s.is_first for s in self.stages)
        self.is_last = any(s.is_last for s in self.stages)
        global_tokens, vocab = args.batch_size * args.seq_len, args.vocab_size

        def loss_fn(logits, targets):  # (b, T, vocab), (b, T): sum CE / global tokens
            return (
                F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum")
                / global_tokens
            )

        # Cheap timers: a stage's forward (+ the loss), input backward and weight pass.
        self.loss_timer = Timer(loss_fn)
        self.timers = {"fwd": [self.loss_timer], "bwd": [], "wgt": []}
        for stage in self.stages:
            for attr, key_ in (
                ("forward_one_chunk", "fwd"),
                ("backward_one_chunk", "bwd"),
                ("backward_weight_one_chunk", "wgt"),
            ):
                timer = Timer(getattr(stage, attr))
                setattr(stage, attr, timer)
                self.timers[key_].append(timer)
        cls = {
            "1f1b": schedules.Schedule1F1B,
            "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
            "zb-h1": schedules.ScheduleInterleavedZeroBubble,
            "zbv": schedules.ScheduleZBVZeroBubble,
            "dualpipev": schedules.ScheduleDualPipeV,
        }[kind]
        held = self.stages[0] if kind == "1f1b" else self.stages
        self.schedule = cls(held, M, loss_fn=self.loss_timer, scale_grads=False)
        adamw = adamw_config(args)
        groups = torch_param_groups(pm.named_parameters(), adamw)
        self.opt = torch.optim.AdamW(groups, lr=args.lr, betas=adamw.betas, eps=adamw.eps)

    def step(self, inputs, targets) -> tuple[float, dict]:
        timers = [t for group in self.timers.values() for t in group]
        for t in timers:
            t.reset()
        losses = [] if self.is_last else None
        args = (inputs,) if self.is_first else ()
        start = time.perf_counter()
        self.opt.zero_grad()
        pipe_start = time.perf_counter()
        self.schedule.step(
            *args, target=targets if self.is_last else None, losses=losses, return_outputs=False
        )
        pipe_end = time.perf_counter()
        self.opt.step()
        end = time.perf_counter()
        sums = {k: sum(t.seconds for t in group) for k, group in self.timers.items()}
        loss = float(sum(loss.item() for loss in losses)) if losses else 0.0
        return loss, {
            "step": end - start,
            "pipeline": pipe_end - pipe_start,
            "optim": end - pipe_end,
            "compute": sum(sums.values()),
            **sums,
            "compute_cpu": sum(t.cpu_seconds for t in timers),
        }


def build_runner(name: str, args, mesh: Mesh):
    cls = MeshwiseRunner if name.startswith("meshwise") else TorchRunner
    return cls(args, mesh, name.split("_", 1)[1])


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
