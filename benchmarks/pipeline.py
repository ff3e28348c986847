"""meshwise pipeline schedules vs torch.distributed.pipelining, side by side.

Spawns 2 gloo ranks on this machine (one thread each) and cuts the same GPT
(``meshwise.models.gpt``, identical initial weights everywhere) into pipeline
chunks with ``meshwise.pipeline.stage.build_chunks``. Four variants train their
own copy on the same global batches (M micro-batches), in alternating rounds
after a warm-up (every variant ``--steps`` steps per round, the order reversed
every other round) so drift in machine speed hits all alike:

- ``meshwise_1f1b``: ``PipelineRuntime`` on ``build_schedule("1f1b", S, M)``;
- ``torch_1f1b``: ``Schedule1F1B`` over a ``PipelineStage`` of the same chunk;
- ``meshwise_interleaved``: ``build_schedule("interleaved-1f1b", S, M, V=2)``,
  2 chunks per rank (chunk v of rank r is logical stage v*S + r);
- ``torch_interleaved``: ``ScheduleInterleaved1F1B`` over the same 2 stages per rank.

A step is the whole optimizer step: zero grad, the schedule (forward + backward
of every micro-batch), AdamW (meshwise: ``ZeroOptimizer`` stage 0 over the
rank's chunk parameters with a dp group of size 1, ``finish_grad_sync`` then
``step``; torch: ``torch.optim.AdamW`` with the same weight-decay split). The
loss is the sum of token cross-entropies divided by the global token count on
both sides (torch: ``scale_grads=False`` and a ``loss_fn`` on the last chunk's
logits). The tied embedding's two copies (first and last stage) are not
synchronised on either side: that is the trainer's job, not the schedule's.

A rank's step time is its wall time from a barrier to the end of the step; the
step's time is the slower rank's, and the median over steps is reported. The
measured bubble of rank r is ``1 - compute_s / pipeline_s``: ``compute_s`` the
seconds rank r spent in F and B actions (meshwise: ``PipelineRuntime.compute_s``;
torch: timers around the stage's ``forward_one_chunk`` / ``backward_one_chunk``
and the loss function), ``pipeline_s`` the slower rank's time in the schedule
alone (optimizer excluded), median over steps. Beside it: the simulator's
bubble for the same S, M, V (``simulate(build_schedule(...))``, forward 1 /
backward 2), the simulator again with the measured forward and backward costs
and a p2p latency from an idle ping-pong of one activation, and the formula
(S-1)/(V*M + S-1).

Noise: other processes on a 2-core machine take cores from the ranks. The report
gives the CPU share of the compute timers (thread CPU time / wall time in F and
B: 1.00 when the core was the rank's alone), the bubble over the steps in which
both ranks had at least 90% of their core, the 1-minute load average, and a
ratio of paired steps (the same round) beside the ratio of medians. The last
line printed is one JSON object.

    python benchmarks/pipeline.py [--rounds 20 --steps 1] [--micro-batches 8]

The torch peers call ``torch.distributed`` directly (a benchmark, not the library).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

# Runnable from a checkout without installing (spawned ranks re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshwise.comm import ops  # noqa: E402
from meshwise.mesh import Mesh, ParallelDims  # noqa: E402
from meshwise.models.gpt import GPTConfig  # noqa: E402
from meshwise.optim import AdamWConfig, decays  # noqa: E402
from meshwise.pipeline.runtime import PipelineRuntime  # noqa: E402
from meshwise.pipeline.schedules import build_schedule  # noqa: E402
from meshwise.pipeline.simulator import ideal_bubble_fraction, simulate  # noqa: E402
from meshwise.pipeline.stage import build_chunks, named_parameters  # noqa: E402
from meshwise.zero.optimizer import ZeroOptimizer  # noqa: E402

VARIANTS = ("meshwise_1f1b", "torch_1f1b", "meshwise_interleaved", "torch_interleaved")
PEER_OF = {"meshwise_1f1b": "torch_1f1b", "meshwise_interleaved": "torch_interleaved"}
KEY_OF = {"meshwise_1f1b": "1f1b", "meshwise_interleaved": "interleaved"}
QUIET_CPU_SHARE = 0.9


# ---------------------------------------------------------------- setup
def gpt_config(args) -> GPTConfig:
    return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                     block_size=args.seq_len, vocab_size=args.vocab_size)


def global_batch(args, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``index`` (the same on every rank and for every variant)."""
    gen = torch.Generator().manual_seed(1234 + index)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (B, T) each


def adamw_config(args) -> AdamWConfig:
    return AdamWConfig(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def virtual_stages(name: str) -> int:
    return 2 if name.endswith("interleaved") else 1


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
    """``engine.zero_grad()``, ``PipelineRuntime.run``, ``finish_grad_sync``, ``step``."""

    def __init__(self, args, mesh: Mesh, num_virtual: int):
        S, M = mesh.dims.pp, args.micro_batches
        self.chunks = build_chunks(gpt_config(args), args.seed, mesh.pp_rank, S, num_virtual)
        self.engine = ZeroOptimizer(named_parameters(self.chunks), mesh.dp, stage=0,
                                    adamw=adamw_config(args))
        kind = "1f1b" if num_virtual == 1 else "interleaved-1f1b"
        schedule = build_schedule(kind, S, M, num_virtual)
        hidden = (args.batch_size // M, args.seq_len, args.d_model)
        self.runtime = PipelineRuntime(self.chunks, schedule, mesh.pp, self.engine, hidden,
                                       torch.float32, torch.device("cpu"))
        # Benchmark-only timers on the instance: split compute_s into F and B.
        self.fwd = self.runtime._forward = Timer(self.runtime._forward)
        self.bwd = self.runtime._backward = Timer(self.runtime._backward)
        self.lr, self.scale, self.M = args.lr, 1.0 / (args.batch_size * args.seq_len), M

    def step(self, inputs, targets) -> tuple[float, dict]:
        micro = list(zip(inputs.chunk(self.M), targets.chunk(self.M)))
        self.fwd.reset()
        self.bwd.reset()
        start = time.perf_counter()
        self.engine.zero_grad()
        pipe_start = time.perf_counter()
        loss = self.runtime.run(micro, self.scale)
        pipe_end = time.perf_counter()
        self.engine.finish_grad_sync()
        self.engine.step(self.lr)
        end = time.perf_counter()
        return loss, {"step": end - start, "pipeline": pipe_end - pipe_start,
                      "optim": end - pipe_end, "compute": self.runtime.compute_s,
                      "fwd": self.fwd.seconds, "bwd": self.bwd.seconds,
                      "compute_cpu": self.fwd.cpu_seconds + self.bwd.cpu_seconds}


class TorchRunner:
    """``opt.zero_grad()``, ``schedule.step(...)``, ``opt.step()``: torch.distributed.pipelining."""

    def __init__(self, args, mesh: Mesh, num_virtual: int):
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                                  ScheduleInterleaved1F1B)

        S, M = mesh.dims.pp, args.micro_batches
        self.chunks = build_chunks(gpt_config(args), args.seed, mesh.pp_rank, S, num_virtual)
        total_stages = S * num_virtual
        self.stages = [PipelineStage(chunk, v * S + mesh.pp_rank, total_stages,
                                     torch.device("cpu"))
                       for v, chunk in enumerate(self.chunks)]
        self.is_first = any(s.is_first for s in self.stages)
        self.is_last = any(s.is_last for s in self.stages)
        global_tokens = args.batch_size * args.seq_len
        vocab = args.vocab_size

        def loss_fn(logits, targets):  # (b, T, vocab), (b, T): sum CE / global tokens
            return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1),
                                   reduction="sum") / global_tokens

        # Cheap timers: the stage's forward (+ the loss) and backward of one micro-batch.
        self.loss_timer = Timer(loss_fn)
        self.fwd_timers, self.bwd_timers = [], []
        for stage in self.stages:
            stage.forward_one_chunk = Timer(stage.forward_one_chunk)
            stage.backward_one_chunk = Timer(stage.backward_one_chunk)
            self.fwd_timers.append(stage.forward_one_chunk)
            self.bwd_timers.append(stage.backward_one_chunk)
        if num_virtual == 1:
            self.schedule = Schedule1F1B(self.stages[0], M, loss_fn=self.loss_timer,
                                         scale_grads=False)
        else:
            self.schedule = ScheduleInterleaved1F1B(self.stages, M, loss_fn=self.loss_timer,
                                                    scale_grads=False)
        cfg = adamw_config(args)
        named = [(n, p) for n, p in named_parameters(self.chunks) if p.requires_grad]
        groups = [{"params": [p for n, p in named if decays(n, p)],
                   "weight_decay": cfg.weight_decay},
                  {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=args.lr, betas=cfg.betas, eps=cfg.eps)

    def step(self, inputs, targets) -> tuple[float, dict]:
        timers = [self.loss_timer] + self.fwd_timers + self.bwd_timers
        for t in timers:
            t.reset()
        losses = [] if self.is_last else None
        args = (inputs,) if self.is_first else ()
        start = time.perf_counter()
        self.opt.zero_grad()
        pipe_start = time.perf_counter()
        self.schedule.step(*args, target=targets if self.is_last else None, losses=losses,
                           return_outputs=False)
        pipe_end = time.perf_counter()
        self.opt.step()
        end = time.perf_counter()
        fwd = self.loss_timer.seconds + sum(t.seconds for t in self.fwd_timers)
        bwd = sum(t.seconds for t in self.bwd_timers)
        loss = float(sum(loss.item() for loss in losses)) if losses else 0.0
        return loss, {"step": end - start, "pipeline": pipe_end - pipe_start,
                      "optim": end - pipe_end, "compute": fwd + bwd, "fwd": fwd, "bwd": bwd,
                      "compute_cpu": sum(t.cpu_seconds for t in timers)}


def build_runner(name: str, args, mesh: Mesh):
    cls = MeshwiseRunner if name.startswith("meshwise") else TorchRunner
    return cls(args, mesh, virtual_stages(name))


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
        for key, value in t.items():
            timings[name][key].append(value)


def p2p_latency_s(args, mesh: Mesh, reps: int = 30) -> float:
    """Median one-way time of one activation message (micro-batch, T, d_model) fp32 between
    the two ranks, both idle otherwise: half a ping-pong of ``ops.batch_p2p``."""
    buf = torch.zeros(args.batch_size // args.micro_batches, args.seq_len, args.d_model)
    peer, times = 1 - mesh.pp_rank, []
    for _ in range(reps):
        ops.barrier(mesh.world)
        start = time.perf_counter()
        if mesh.pp_rank == 0:
            ops.batch_p2p([(buf, peer, 0)], [], mesh.pp)
            ops.batch_p2p([], [(buf, peer, 1)], mesh.pp)
        else:
            ops.batch_p2p([], [(buf, peer, 0)], mesh.pp)
            ops.batch_p2p([(buf, peer, 1)], [], mesh.pp)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def rank_main(rank: int, args, port: int, results) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    ops.init_process_group("gloo", timeout_s=args.timeout_s)
    mesh = Mesh.build(ParallelDims(pp=2))
    world = mesh.world
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
    keys = ("step", "pipeline", "optim", "compute", "fwd", "bwd", "compute_cpu")
    timings = {n: {k: [] for k in keys} for n in names}
    losses = {n: [] for n in names}
    index = {n: 0 for n in names}  # each variant sees global batches 0, 1, 2, ... in order
    for _ in range(args.warmup):
        for name in names:
            if name in runners and name not in errors:
                run_step(name, runners[name], args, index[name], world, None, losses, errors)
                index[name] += 1
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            for _ in range(args.steps):
                if name in runners and name not in errors:
                    run_step(name, runners[name], args, index[name], world, timings, losses,
                             errors)
                    index[name] += 1
    num_params = sum(p.numel() for _, p in named_parameters(runners[names[0]].chunks))
    latency_s = p2p_latency_s(args, mesh)
    results.put({"rank": rank, "timings": timings, "losses": losses, "errors": errors,
                 "num_params": num_params, "p2p_latency_s": latency_s})
    ops.destroy_process_group()


# ---------------------------------------------------------------- report
def simulated(S: int, M: int, V: int, fwd: float = 1.0, bwd: float = 2.0,
              latency: float = 0.0) -> tuple[float, list]:
    """The simulator's bubble (mean over ranks) and each rank's idle fraction."""
    kind = "1f1b" if V == 1 else "interleaved-1f1b"
    tl = simulate(build_schedule(kind, S, M, V), forward_cost=fwd, backward_cost=bwd,
                  p2p_latency=latency)
    per_rank = [1 - sum(e - s for s, e, _ in row) / tl.step_time for row in tl.rows]
    return tl.bubble_fraction, per_rank


def summarize(name: str, per_rank: list[dict]) -> dict | None:
    """Medians over steps of the slower rank's times, and per-rank measured bubbles."""
    t = [r["timings"][name] for r in per_rank]
    if not t[0]["step"]:
        return None
    steps = [max(vals) for vals in zip(*(x["step"] for x in t))]
    pipes = [max(vals) for vals in zip(*(x["pipeline"] for x in t))]
    bubbles = [[1 - c / p for c, p in zip(x["compute"], pipes)] for x in t]
    q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
    # Steps in which both ranks had their core to themselves while computing (thread CPU
    # time >= QUIET_CPU_SHARE of wall time in F and B): the bubble without outside noise.
    quiet = [i for i in range(len(steps))
             if all(x["compute_cpu"][i] >= QUIET_CPU_SHARE * x["compute"][i] for x in t)]
    return {
        "quiet_steps": len(quiet),
        "bubble_quiet": [statistics.median(b[i] for i in quiet) if quiet else None
                         for b in bubbles],
        "step": statistics.median(steps), "step_q1": q[0], "step_q3": q[2],
        "step_min": min(steps), "step_max": max(steps),
        "pipeline": statistics.median(pipes),
        "optim": statistics.median(max(v) for v in zip(*(x["optim"] for x in t))),
        "bubble": [statistics.median(b) for b in bubbles],
        "bubble_q": [statistics.quantiles(b, n=4) if len(b) > 1 else [b[0]] * 3
                     for b in bubbles],
        # CPU share of the compute timers, over all steps (1.0 = the core was ours alone).
        "cpu_share": [sum(x["compute_cpu"]) / sum(x["compute"]) for x in t],
        "fwd": [statistics.median(x["fwd"]) for x in t],
        "bwd": [statistics.median(x["bwd"]) for x in t],
        "steps": len(steps), "step_list": steps,
    }


def report(args, per_rank: list[dict]) -> dict:
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    S, M = 2, args.micro_batches
    errors = {}
    for r in per_rank:
        for k, v in r["errors"].items():
            errors.setdefault(k, v)
    names = [n for n in VARIANTS if n in per_rank[0]["timings"]]
    stats = {n: summarize(n, per_rank) for n in names}
    losses = {n: next((r["losses"][n] for r in per_rank if any(r["losses"][n])), [])
              for n in names}
    n_params = sum(r["num_params"] for r in per_rank)
    tokens = args.batch_size * args.seq_len
    print(f"model: GPT n_layer {args.n_layer}, n_head {args.n_head}, d_model {args.d_model}, "
          f"vocab {args.vocab_size}, {n_params / 1e6:.2f}M params over 2 pipeline ranks; "
          f"global batch {args.batch_size} x {args.seq_len} = {tokens} tokens in M = {M} "
          f"micro-batches; gloo, 1 thread per rank; {args.rounds} rounds x {args.steps} "
          f"steps after {args.warmup} warm-up steps each")
    for name in names:
        if name in errors:
            print(f"{name} did not run on CPU/gloo: {errors[name]}")
            tb = errors.get(name + "_traceback")
            if tb and args.verbose:
                print(tb)

    def ms(x):
        return "-" if x is None else f"{1e3 * x:.1f}"

    print(f"\n{'variant':22}{'step ms':>9}{'q1..q3':>15}{'pipeline':>10}{'optim':>8}"
          f"{'F ms r0/r1':>14}{'B ms r0/r1':>14}{'steps':>7}")
    for name in names:
        s = stats[name]
        if s is None:
            print(f"{name:22}{'(did not run)':>9}")
            continue
        print(f"{name:22}{ms(s['step']):>9}{ms(s['step_q1']) + '..' + ms(s['step_q3']):>15}"
              f"{ms(s['pipeline']):>10}{ms(s['optim']):>8}"
              f"{ms(s['fwd'][0]) + '/' + ms(s['fwd'][1]):>14}"
              f"{ms(s['bwd'][0]) + '/' + ms(s['bwd'][1]):>14}{s['steps']:>7}")

    summary: dict = {}
    print(f"\n{'meshwise / torch (median step times)':42}{'step time':>10}{'pipeline only':>15}"
          f"{'paired steps':>15}")
    for ours, peer in PEER_OF.items():
        key = KEY_OF[ours]
        a, b = stats.get(ours), stats.get(peer)
        summary[f"meshwise_{key}_step_s"] = a["step"] if a else None
        summary[f"torch_{key}_step_s"] = b["step"] if b else None
        ratio = a["step"] / b["step"] if a and b else None
        pipe_ratio = a["pipeline"] / b["pipeline"] if a and b else None
        # Step i of both ran in the same round: the median of these ratios resists drift in
        # the load from other processes better than the ratio of medians.
        paired = statistics.median(x / y for x, y in zip(a["step_list"], b["step_list"])) \
            if a and b else None
        summary[f"ratio_{key}"] = ratio
        summary[f"ratio_{key}_pipeline_only"] = pipe_ratio
        summary[f"ratio_{key}_paired"] = paired
        shown = (f"{ratio:10.3f}{pipe_ratio:15.3f}{paired:15.3f}" if ratio
                 else f"{'-':>10}{'-':>15}{'-':>15}")
        print(f"{ours + ' / ' + peer:42}{shown}")

    latency = statistics.median(r["p2p_latency_s"] for r in per_rank)
    print(f"\nbubble = 1 - compute_s / pipeline_s per rank, median over steps (q1..q3); "
          f"S = {S}, M = {M}.\nsimulated: forward 1, backward 2 (for balanced stages the F:B "
          f"ratio does not change it); sim+lat: the simulator with this variant's measured F "
          f"and B costs and a p2p latency of {1e3 * latency:.2f} ms (one activation message, "
          f"ranks idle)")
    print(f"{'variant':22}{'rank 0':>22}{'rank 1':>22}{'simulated':>11}{'sim r0/r1':>13}"
          f"{'sim+lat':>9}{'formula':>9}")
    for name in names:
        V, s = virtual_stages(name), stats[name]
        if s is None:
            continue
        sim, sim_ranks = simulated(S, M, V)
        # Per micro-batch costs of a rank's whole share (the simulator splits them over V).
        f_cost, b_cost = statistics.mean(s["fwd"]) / M, statistics.mean(s["bwd"]) / M
        sim_lat, _ = simulated(S, M, V, f_cost, b_cost, latency)
        formula = ideal_bubble_fraction(S, M, V)
        cells = [f"{b:.3f} ({q[0]:.3f}..{q[2]:.3f})" for b, q in zip(s["bubble"], s["bubble_q"])]
        print(f"{name:22}{cells[0]:>22}{cells[1]:>22}{sim:11.3f}"
              f"{sim_ranks[0]:7.3f}/{sim_ranks[1]:.3f}{sim_lat:9.3f}{formula:9.3f}")
        key = name.split("_", 1)[1]
        if name.startswith("meshwise"):
            summary[f"bubble_measured_{key}"] = s["bubble"]
            summary[f"bubble_simulated_{key}"] = sim
            summary[f"bubble_formula_{key}"] = formula
            summary[f"bubble_simulated_with_latency_{key}"] = sim_lat
            summary[f"bubble_measured_quiet_{key}"] = s["bubble_quiet"]
            summary[f"quiet_steps_{key}"] = s["quiet_steps"]
            summary[f"backward_over_forward_{key}"] = b_cost / f_cost
        else:
            summary[f"torch_bubble_measured_{key}"] = s["bubble"]
            summary[f"torch_bubble_measured_quiet_{key}"] = s["bubble_quiet"]
        summary[f"cpu_share_of_compute_{name}"] = s["cpu_share"]
    summary["p2p_latency_s"] = latency
    print(f"quiet steps only (CPU share >= {QUIET_CPU_SHARE} on both ranks): " + "; ".join(
        f"{n} " + (f"{s['bubble_quiet'][0]:.3f}/{s['bubble_quiet'][1]:.3f} "
                   if s["quiet_steps"] else "") + f"({s['quiet_steps']} steps)"
        for n, s in stats.items() if s))
    print("noise gauge: CPU share of compute (thread CPU time / wall time inside F and B; "
          "1.00 = the core was the rank's alone): " + ", ".join(
              f"{n} {s['cpu_share'][0]:.2f}/{s['cpu_share'][1]:.2f}"
              for n, s in stats.items() if s))
    for key in ("1f1b", "interleaved"):
        for field in ("bubble_measured", "bubble_simulated", "bubble_formula"):
            summary.setdefault(f"{field}_{key}", None)

    print("\nloss (sum CE / global tokens) at the first step, and at the last step both ran:")
    for ours, peer in PEER_OF.items():
        a, b = losses.get(ours, []), losses.get(peer, [])
        key = KEY_OF[ours]
        if not a:
            continue
        if not b:
            print(f"  {ours}: first {a[0]:.6f} (torch peer did not run)")
            summary[f"loss_rel_diff_first_{key}"] = None
            continue
        first = abs(a[0] - b[0]) / abs(b[0])
        n = min(len(a), len(b)) - 1
        last = abs(a[n] - b[n]) / abs(b[n])
        print(f"  {ours} {a[0]:.6f} vs {peer} {b[0]:.6f}: relative difference {first:.2e}; "
              f"step {n + 1}: {a[n]:.6f} vs {b[n]:.6f} ({last:.2e})")
        summary[f"loss_rel_diff_first_{key}"] = first
        summary[f"loss_rel_diff_step{n + 1}_{key}"] = last
    summary["torch_errors"] = {k: v for k, v in errors.items() if not k.endswith("_traceback")}
    summary.update(num_stages=S, num_micro_batches=M, steps_each=args.rounds * args.steps)
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=8, help="GPT blocks (default 8)")
    p.add_argument("--n-head", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    p.add_argument("--vocab-size", type=int, default=256, help="vocabulary (default 256)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--micro-batches", type=int, default=8,
                   help="M micro-batches per step (default 8; a multiple of 2 for interleaved)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved"],
                   choices=["1f1b", "interleaved"], help="which pairs to run (default both)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    p.add_argument("--seed", type=int, default=0, help="model init seed (default 0)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps each (default 2)")
    p.add_argument("--rounds", type=int, default=20, help="alternating rounds (default 20)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per round (default 1)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="gloo timeout, so a peer that hangs fails instead (default 120)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of torch failures")
    args = p.parse_args(argv)
    if args.n_layer % 4 or args.batch_size % args.micro_batches or args.micro_batches % 2:
        p.error("need n_layer % 4 == 0 (2 ranks x 2 chunks), batch_size % micro_batches == 0 "
                "and micro_batches even (interleaved needs a multiple of pp = 2)")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load_start = os.getloadavg()[0]
    mp.spawn(rank_main, args=(args, port, results), nprocs=2)
    summary = report(args, [results.get(), results.get()])
    summary["loadavg_1min"] = [load_start, os.getloadavg()[0]]
    print(f"1-minute load average before / after: {load_start:.2f} / {os.getloadavg()[0]:.2f} "
          "(2 cores: above ~2 means other processes competed with the ranks)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
