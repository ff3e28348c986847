"""Every layout of a world that is valid and fits, ranked by predicted tokens per second.

Candidates are every factorisation of the world into dp x cp x tp x pp, with
sequence parallelism where tp > 1, each schedule and its virtual stages and a
few micro-batch counts under a pipeline (multiples of pp), a few accumulation
counts without one, each ZeRO stage and activation checkpointing mode. Whether
one is valid is decided by ``TrainConfig.validate``, the check ``meshwise
train`` runs before any rank starts: the rules have one source. A layout that
recomputes more than it needs to fit is left out: the same layout with less
recomputation fits too and is faster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshwise.apply.activation_checkpointing import MODES
from meshwise.pipeline.schedules import SCHEDULE_KINDS
from meshwise.planner.devices import DeviceProfile
from meshwise.planner.layout import Layout
from meshwise.planner.memory import MemoryBreakdown, Settings, peak_memory
from meshwise.planner.shapes import ModelShape
from meshwise.planner.step_time import TimeBreakdown, step_time
from meshwise.train.config import ZERO_STAGES, TrainConfig

MAX_OPTIONS = 4  # micro-batch or accumulation counts tried per layout


@dataclass(frozen=True)
class Space:
    """The choices the search may make (each flag of ``meshwise plan`` narrows one)."""

    zero: tuple[int, ...] = ZERO_STAGES
    schedules: tuple[str, ...] = SCHEDULE_KINDS
    activation_checkpointing: tuple[str, ...] = MODES
    compress: str = "none"
    axes: dict = field(default_factory=dict)  # fixed degrees, e.g. {"tp": 2}


@dataclass
class Prediction:
    """A layout with its predicted peak memory (worst rank) and step time."""

    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    tokens_per_s: float
    mfu: float
    fits: bool

    def as_json(self) -> dict:
        return {"layout": self.layout.flags(), "peak_mem_bytes": int(self.memory.total),
                "step_time_s": self.time.step, "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu, "memory": {k: int(v) for k, v in self.memory.parts().items()},
                "time": self.time.parts(), "bubble_fraction": self.time.bubble_fraction,
                "micro_batches_in_flight": self.memory.in_flight}


def predict(shape: ModelShape, layout: Layout, st: Settings, device: DeviceProfile,
            memory_limit: float) -> Prediction:
    """Predicted memory and time of one layout (any layout, valid or not)."""
    time, flights = step_time(shape, layout, st, device)
    memory = peak_memory(shape, layout, st, flights, device.overhead_bytes)
    tokens = st.batch_size * st.seq_len / time.step
    peak = device.peak_flops.get(st.dtype) or device.matmul_rate(st.dtype)
    mfu = shape.model_flops_per_token(st.seq_len) * tokens / (layout.world_size * peak)
    return Prediction(layout, memory, time, tokens, mfu, memory.total <= memory_limit)


def memory_limit(device: DeviceProfile, world: int) -> float:
    """Bytes one rank may hold: its device's, or its share of a machine's."""
    if not device.memory_per_node:
        return device.memory_bytes
    local = world if device.ranks_per_node <= 0 else min(world, device.ranks_per_node)
    return device.memory_bytes / local


def search(cfg: TrainConfig, shape: ModelShape, world: int, device: DeviceProfile,
           space: Space, limit: float) -> list[Prediction]:
    """Every valid layout of ``world`` ranks with its prediction, best first; those that
    do not fit ``limit`` bytes per rank follow, least memory first."""
    st = settings_of(cfg)
    fitting, over = [], []
    for structure in _structures(cfg, world, space):
        # ZeRO over one rank shards nothing: stage 0 stands for them all
        stages = space.zero if structure.dp * structure.cp > 1 else space.zero[:1]
        for zero in stages:
            for mode in space.activation_checkpointing:
                layout = _replace(structure, zero=zero, activation_checkpointing=mode)
                if not _valid(cfg, layout):
                    continue
                p = predict(shape, layout, st, device, limit)
                (fitting if p.fits else over).append(p)
                if p.fits:
                    break  # more recomputation would only be slower
    fitting.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    over.sort(key=lambda p: p.memory.total)
    return fitting + over


def settings_of(cfg: TrainConfig) -> Settings:
    return Settings(seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
                    dtype=cfg.runtime.dtype, grad_reduce_dtype=cfg.runtime.grad_reduce_dtype,
                    bucket_mb=cfg.comm.bucket_mb)


def _replace(layout: Layout, **changes) -> Layout:
    import dataclasses

    return dataclasses.replace(layout, **changes)


def _valid(cfg: TrainConfig, layout: Layout) -> bool:
    try:
        layout.apply(cfg).validate()
    except ValueError:
        return False
    return True


def _structures(cfg: TrainConfig, world: int, space: Space):
    """Layouts without their ZeRO stage and checkpointing, valid at ZeRO-0."""
    for dp, cp, tp, pp in _factorisations(world):
        axes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
        if any(axes[k] != v for k, v in space.axes.items()):
            continue
        per_dp = cfg.data.batch_size // dp if cfg.data.batch_size % dp == 0 else 0
        if not per_dp:
            continue
        for sp in ((False, True) if tp > 1 else (False,)):
            base = Layout(dp=dp, cp=cp, tp=tp, pp=pp, sp=sp, compress=space.compress)
            for layout in _pipelines(base, per_dp, space, cfg.model.resolved().n_layer):
                if _valid(cfg, layout):
                    yield layout


def _pipelines(base: Layout, per_dp: int, space: Space, n_layer: int):
    """The schedule, virtual stages and micro-batch (or accumulation) choices of ``base``."""
    if base.pp == 1:
        for k in _spread([d for d in _divisors(per_dp)]):
            yield _replace(base, grad_accum=k)
        return
    counts = [m for m in _divisors(per_dp) if m >= base.pp] or [per_dp]
    for kind in space.schedules:
        chunks = {"interleaved-1f1b": [v for v in (2, 3, 4) if n_layer % (base.pp * v) == 0],
                  "zbv": [2], "dualpipev": [2]}.get(kind, [1])
        for v in chunks:
            for m in _spread(counts):
                yield _replace(base, schedule=kind, virtual_stages=v, micro_batches=m)


def _spread(values: list[int]) -> list[int]:
    """At most ``MAX_OPTIONS`` of sorted ``values``, about evenly spaced in log scale."""
    if len(values) <= MAX_OPTIONS:
        return values
    picks = {values[round(i * (len(values) - 1) / (MAX_OPTIONS - 1))] for i in range(MAX_OPTIONS)}
    return sorted(picks)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _factorisations(world: int):
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for cp in _divisors(world // (tp * pp)):
                yield world // (tp * pp * cp), cp, tp, pp
