"""Every layout of a world that is valid and fits, ranked by predicted tokens per second.

The candidates are listed in docs/choosing-a-layout.md "What is searched"; validity is
``check_layout``'s, the check ``meshwise train`` runs. A layout that recomputes more than
it needs to fit is left out (less recomputation fits too and is faster).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshwise.apply.activation_checkpointing import MODES
from meshwise.pipeline.schedules import SCHEDULE_KINDS
from meshwise.planner.devices import DeviceProfile
from meshwise.planner.experts import valid_ep
from meshwise.planner.hybrid import shard_options
from meshwise.planner.layout import Layout
from meshwise.planner.lora import nf4_fits_tp
from meshwise.planner.memory import MemoryBreakdown, Settings, peak_memory
from meshwise.planner.shapes import ModelShape
from meshwise.planner.step_time import Pipeline, TimeBreakdown, pipeline, step_time
from meshwise.train.config import ZERO_STAGES, TrainConfig
from meshwise.train.layout_rules import check_layout

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
        return {
            "layout": self.layout.flags(),
            "peak_mem_bytes": int(self.memory.total),
            "step_time_s": self.time.step,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "memory": {k: int(v) for k, v in self.memory.parts().items()},
            "time": self.time.parts(),
            "bubble_fraction": self.time.bubble_fraction,
            "micro_batches_in_flight": self.memory.in_flight,
        }


def predict(
    shape: ModelShape,
    layout: Layout,
    st: Settings,
    device: DeviceProfile,
    memory_limit: float,
    pipe: Pipeline | None = None,
) -> Prediction:
    """Predicted memory and time of one layout (any layout, valid or not); ``pipe``: its
    pipeline part, when already timed (it does not depend on the ZeRO stage)."""
    time, flights = step_time(shape, layout, st, device, pipe)
    memory = peak_memory(
        shape,
        layout,
        st,
        flights,
        device.overhead_bytes,
        device.given_gradient_bytes,
        device.checkpointing_bytes,
    )
    tokens = st.batch_size * st.seq_len / time.step
    peak = device.peak_flops.get(st.dtype) or device.matmul_rate(st.dtype)
    mfu = shape.model_flops_per_token(st.seq_len) * tokens / (_peak_units(device, layout) * peak)
    return Prediction(layout, memory, time, tokens, mfu, memory.total <= memory_limit)


def _peak_units(device: DeviceProfile, layout: Layout) -> int:
    """What the job's peak is made of, in units of ``peak_flops``: a device per rank, or
    on a CPU (whose peak is one thread's) the threads its ranks run, at most its cores."""
    world = layout.world_size
    if device.cores is None:
        return world
    return min(device.cores, world * max(1, device.cores // world))


def memory_limit(device: DeviceProfile, world: int) -> float:
    """Bytes one rank may hold: its device's, or its share of a machine's."""
    if not device.memory_per_node:
        return device.memory_bytes
    local = world if device.ranks_per_node <= 0 else min(world, device.ranks_per_node)
    return device.memory_bytes / local


def search(
    cfg: TrainConfig,
    shape: ModelShape,
    world: int,
    device: DeviceProfile,
    space: Space,
    limit: float,
) -> list[Prediction]:
    """Every valid layout of ``world`` ranks with its prediction, best first, then those over
    ``limit`` bytes per rank, least memory first. Pipelines are simulated at coarse costs
    (one significant digit, so thousands of layouts share a few); the best ``REFINED`` exactly.
    """
    st = settings_of(cfg, device)
    fitting: list[Prediction] = []
    over: list[Prediction] = []
    stages, modes = valid_choices(cfg, space)
    for structure in _structures(cfg, world, space, shape):
        # ZeRO over one rank shards nothing: stage 0 stands for them all
        zeros: Sequence[int] = stages if structure.dp * structure.cp > 1 else stages[:1]
        for mode in modes:
            base = _replace(structure, activation_checkpointing=mode)
            pipe = _pipe(shape, base, st, device)
            layouts = [_replace(base, zero=z) for z in zeros]
            layouts += [  # hybrid sharding where dp crosses nodes
                _replace(layout, dp_shard=n)
                for layout in layouts
                for n in shard_options(layout, device.ranks_per_node)
            ]
            found = [predict(shape, layout, st, device, limit, pipe) for layout in layouts]
            for p in found:
                (fitting if p.fits else over).append(p)
            # more recomputation would only be slower where this mode fits
            zeros = sorted({p.layout.zero for p in found if not p.fits})
            if not zeros:
                break
    fitting.sort(key=_rank_key)
    top = [predict(shape, p.layout, st, device, limit) for p in fitting[:REFINED]]
    fitting[:REFINED] = sorted(top, key=_rank_key)
    _pipe_cached.cache_clear()
    over.sort(key=lambda p: p.memory.total)
    return fitting + over


REFINED = 32


def _rank_key(p: Prediction):
    # Ties (three significant digits) go to the layout using less memory, then the shorter
    # command line (fewer choices that buy nothing here).
    tokens = float(f"{p.tokens_per_s:.3g}")
    return (-tokens, round(p.memory.total / 2**20), len(p.layout.flags()))


@functools.lru_cache(maxsize=None)
def _pipe_cached(shape, structure, st, device_key):
    return pipeline(shape, structure, st, _DEVICES[device_key], exact=False)


_DEVICES: dict = {}


def _pipe(shape: ModelShape, structure: Layout, st: Settings, device: DeviceProfile) -> Pipeline:
    _DEVICES[id(device)] = device
    return _pipe_cached(shape, structure, st, id(device))


def valid_choices(cfg: TrainConfig, space: Space) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ZeRO stages and checkpointing modes of the space that the configuration check
    accepts. The check has no rule that ties either to the axes, so each is checked once
    (tests/unit/test_planner.py validates every layout listed: a rule that ties them
    later fails there)."""
    zeros = tuple(z for z in space.zero if _valid(cfg, Layout(zero=z)))
    modes = tuple(
        m for m in space.activation_checkpointing if _valid(cfg, Layout(activation_checkpointing=m))
    )
    return zeros, modes


def settings_of(cfg: TrainConfig, device: DeviceProfile) -> Settings:
    """The settings a step's cost depends on; ``--dtype auto`` as it resolves on
    ``device`` (bf16 on a GPU profile, fp32 on the CPU)."""
    dtype = cfg.runtime.dtype
    if dtype == "auto":
        dtype = "fp32" if device.name == "cpu" else "bf16"
    return Settings(
        seq_len=cfg.data.seq_len,
        batch_size=cfg.data.batch_size,
        dtype=dtype,
        grad_reduce_dtype=cfg.runtime.grad_reduce_dtype,
        bucket_mb=cfg.comm.bucket_mb,
    )


def _replace(layout: Layout, **changes) -> Layout:
    import dataclasses

    return dataclasses.replace(layout, **changes)


def _valid(cfg: TrainConfig, layout: Layout) -> bool:
    try:
        check_layout(layout.apply(cfg))
    except ValueError:
        return False
    return True


def _structures(cfg: TrainConfig, world: int, space: Space, shape: ModelShape):
    """Layouts without their ZeRO stage and checkpointing, valid at ZeRO-0; with experts,
    each expert parallel degree that divides dp x cp and the experts; under QLoRA, a tp
    that leaves each rank whole NF4 blocks."""
    for dp, cp, tp, pp in _factorisations(world):
        per_dp = cfg.data.batch_size // dp if cfg.data.batch_size % dp == 0 else 0
        if not per_dp or not nf4_fits_tp(shape, tp):
            continue
        for ep in valid_ep(shape.n_experts, dp * cp):
            axes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp, "ep": ep}
            if any(axes[k] != v for k, v in space.axes.items()):
                continue
            for sp in (False, True) if tp > 1 else (False,):
                base = Layout(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, sp=sp, compress=space.compress)
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
        chunks = {
            "interleaved-1f1b": [v for v in (2, 3, 4) if n_layer % (base.pp * v) == 0],
            "zbv": [2],
            "dualpipev": [2],
        }.get(kind, [1])
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
