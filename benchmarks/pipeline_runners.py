"""The variants ``benchmarks/pipeline.py`` times, built on one rank: meshwise's
``PipelineRuntime`` on its schedules and ``torch.distributed.pipelining``'s on the same
chunks, each taking one whole optimizer step with its F, B and W actions timed.

The torch peers call ``torch.distributed`` directly (a benchmark, not the library).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from benchmarks.common import (
    adamw_config,
    gpt_config,
    meshwise_gpt,
    reference_gpt,
    torch_param_groups,
)
from benchmarks.pipeline_report import SCHEDULE_OF, virtual_stages
from meshwise.apply.parallelize import parallelize
from meshwise.mesh import Mesh
from meshwise.models.gpt import gpt_plan
from meshwise.pipeline.runtime import PipelineRuntime
from meshwise.pipeline.schedules import STAGE_MAP_OF, build_schedule
from meshwise.sharding.buckets import ZeroOptimizer


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
