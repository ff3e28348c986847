"""Step time of one layout: compute, the pipeline's bubble, communication, optimizer.

- compute and the exposed tp/cp communication per action
  (``meshwise.planner.compute``);
- the pipeline from ``meshwise.pipeline.simulator``, timed with those per-action
  costs and the activations' transfer time between stages as its p2p latency:
  the bubble is what the simulated step takes beyond the ranks' own work; the
  simulator also counts the micro-batches each rank keeps (memory);
- the gradient collectives over dp x cp by ZeRO stage (Rajbhandari et al. 2019:
  stage 0-1 all-reduce, 2 reduce-scatter, 3 adds the parameters' all-gathers, per
  micro-step without a pipeline), hidden behind the backward where the device
  overlaps communication, exposed where it does not (gloo on CPU cores);
- AdamW over the parameters a rank owns, and the gradient norm.

On a CPU whose cores are fewer than its ranks, ranks share the cores: the
compute of the whole step takes at least every rank's work over the cores, and
a pipeline's idle ranks leave theirs to the others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshwise.planner.collectives import collective_s, link_kind, p2p_s
from meshwise.planner.compute import ActionCosts, action_costs, micro_batch_tokens
from meshwise.planner.devices import DeviceProfile
from meshwise.planner.layout import Layout
from meshwise.planner.memory import DTYPE_BYTES, Settings, rank_params
from meshwise.planner.shapes import ModelShape

COMPRESS_RATIO = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "int8": 0.26}


@dataclass
class TimeBreakdown:
    """Seconds of one optimizer step on the slowest rank, by what takes them."""

    compute: float  # forwards, backwards and recomputation of every micro-batch
    bubble: float  # pipeline ranks idle, and waiting for activations
    tp: float
    cp: float
    dp: float  # exposed gradient and ZeRO collectives
    optimizer: float
    bubble_fraction: float

    @property
    def step(self) -> float:
        return self.compute + self.bubble + self.tp + self.cp + self.dp + self.optimizer

    def parts(self) -> dict[str, float]:
        return {"compute": self.compute, "pipeline bubble": self.bubble, "tp comm": self.tp,
                "cp comm": self.cp, "dp comm": self.dp, "optimizer": self.optimizer}


@functools.lru_cache(maxsize=4096)
def simulated(kind: str, stages: int, micro_batches: int, virtual: int, forward: float,
              backward: float, weights: float, latency: float):
    """(step time, peak micro-batches in flight per rank) of a schedule, cached: layouts
    that differ only in ZeRO stage or dp share the simulation."""
    from meshwise.pipeline.simulator import simulate

    timeline = simulate(_schedule(kind, stages, micro_batches, virtual), forward, backward,
                        weights, latency)
    return timeline.step_time, tuple(timeline.peak_in_flight)


@functools.lru_cache(maxsize=512)
def _schedule(kind: str, stages: int, micro_batches: int, virtual: int):
    from meshwise.pipeline.schedules import build_schedule

    return build_schedule(kind, stages, micro_batches, virtual)


def _round(x: float) -> float:
    """Two significant digits: costs that close share one simulation."""
    return float(f"{x:.2g}")


def in_flight(layout: Layout, costs: ActionCosts | None = None,
              latency: float = 0.0) -> list[int]:
    """Micro-batch chunks each pipeline rank keeps at once (1 without a pipeline)."""
    if layout.pp == 1:
        return [1]
    f, b, w = (1.0, 1.0, 1.0) if costs is None else _ratios(costs)
    return list(simulated(layout.schedule, layout.pp, layout.micro_batches,
                          layout.virtual_stages, f, b, w, _round(latency))[1])


def _ratios(c: ActionCosts) -> tuple[float, float, float]:
    scale = c.forward + c.tp / 2 + c.cp / 3
    return (1.0, _round((c.backward + c.tp / 2 + 2 * c.cp / 3) / scale),
            _round(c.weights / scale))


def step_time(shape: ModelShape, layout: Layout, st: Settings,
              device: DeviceProfile) -> tuple[TimeBreakdown, list[int]]:
    """The slowest rank's step, and the micro-batches each pipeline rank keeps."""
    ranks = [rank_params(shape, layout, r) for r in range(layout.pp)]
    layers = shape.n_layer // layout.pp
    per_rank = [action_costs(shape, layout, st, device, layers, first > 0, last > 0)
                for _, first, last in ranks]
    worst = max(per_rank, key=lambda c: c.compute + c.tp + c.cp)
    m = layout.micro_batches * layout.grad_accum
    work = m * (worst.compute + worst.tp + worst.cp)
    share = _core_share(layout, device)
    flights = [1]
    if layout.pp == 1:
        pipe = work + m * worst.compute * (share - 1)
    else:
        n = micro_batch_tokens(layout, st)
        message = n * shape.d_model * DTYPE_BYTES[st.dtype]
        stride = layout.tp * layout.cp
        latency = p2p_s(device, message, link_kind(stride, layout.pp, device.ranks_per_node))
        scale = worst.forward + worst.tp / 2 + worst.cp / 3
        f, b, w = _ratios(worst)
        sim_step, flights = simulated(layout.schedule, layout.pp, layout.micro_batches,
                                      layout.virtual_stages, f, b, w, _round(latency / scale))
        flights = list(flights)
        shared = m * worst.compute * share + m * (worst.tp + worst.cp)
        pipe = max(sim_step * scale * layout.grad_accum, shared)
    bubble = max(0.0, pipe - work - m * worst.compute * (share - 1))
    compute = m * worst.compute * share
    dp = _dp_exposed(shape, layout, st, device, ranks, m * (worst.backward + worst.weights))
    optimizer = _optimizer_s(layout, st, device, ranks) * share
    breakdown = TimeBreakdown(compute, bubble, m * worst.tp, m * worst.cp, dp, optimizer,
                              bubble / pipe if pipe > 0 else 0.0)
    return breakdown, flights


def _core_share(layout: Layout, device: DeviceProfile) -> float:
    """How much slower a rank computes because its machine's ranks share the cores."""
    if device.cores is None:
        return 1.0
    local = layout.world_size if device.ranks_per_node <= 0 else min(
        layout.world_size, device.ranks_per_node)
    return max(1.0, local / device.cores)


def _dp_exposed(shape, layout: Layout, st: Settings, device: DeviceProfile, ranks,
                backward_s: float) -> float:
    """Exposed seconds of the gradient (and ZeRO parameter) collectives over dp x cp."""
    n = layout.dp * layout.cp
    if n == 1:
        return 0.0
    params = max(sum(r) for r in ranks)
    a = DTYPE_BYTES[st.dtype]
    grad_bytes = params * (2 if st.dtype == "bf16" and st.grad_reduce_dtype == "bf16" else 4)
    grad_bytes *= COMPRESS_RATIO.get(layout.compress.partition(":")[0], 0.05)
    if layout.dp > 1:
        link = link_kind(layout.tp * layout.cp * layout.pp, layout.dp, device.ranks_per_node)
    else:
        link = link_kind(layout.tp, layout.cp, device.ranks_per_node)

    def coll(kind, nbytes):
        return collective_s(device, kind, nbytes, n, link)

    z, micro = layout.zero, layout.grad_accum
    if z == 0:
        total = coll("all_reduce", grad_bytes)
    elif z == 1:
        total = coll("all_reduce", grad_bytes) + coll("all_gather", params * a)
    elif z == 2:
        reduces = micro if layout.pp == 1 else 1
        total = reduces * coll("reduce_scatter", grad_bytes) + coll("all_gather", params * a)
    else:
        per = 1 if layout.pp > 1 else micro
        gathers = 1 if layout.pp > 1 else 2
        total = per * (gathers * coll("all_gather", params * a)
                       + coll("reduce_scatter", grad_bytes))
    if not device.overlap:
        return total
    # Hidden behind the backward (and ZeRO-3's gathers behind the forward too), but the
    # last bucket's reduction waits for the last gradient.
    tail = coll("all_reduce", min(grad_bytes, st.bucket_mb * 2**20))
    window = backward_s * (1.5 if z == 3 else 1.0)
    return max(tail, total - window)


def _optimizer_s(layout: Layout, st: Settings, device: DeviceProfile, ranks) -> float:
    """AdamW over the parameters this rank owns, and the gradient norm over its gradients."""
    params = max(sum(r) for r in ranks)
    owned = params if layout.zero == 0 else params / (layout.dp * layout.cp)
    if device.optimizer_s_per_param:
        return owned * device.optimizer_s_per_param
    # parameters, gradients and both moments read, three of them written (fp32), a bf16
    # copy of the parameters written too
    touched = owned * (7 * 4 + (2 if st.dtype == "bf16" else 0)) + params * 4
    return touched / device.memory_bandwidth
