"""Step time of one layout: per-action compute through the pipeline simulator, the
gradient collectives by ZeRO stage (Rajbhandari et al. 2019) hidden or exposed as the
device overlaps, waits for drifting peers, AdamW and the norm.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshwise.planner.collectives import collective_s, link_kind, p2p_s, sync_wait_s
from meshwise.planner.compute import ActionCosts, action_costs, micro_batch_tokens
from meshwise.planner.devices import DeviceProfile
from meshwise.planner.experts import expert_dp
from meshwise.planner.hybrid import cross_replica_bytes
from meshwise.planner.layout import Layout
from meshwise.planner.lora import rank_lora_params
from meshwise.planner.memory import DTYPE_BYTES, Settings, rank_expert_params, rank_params
from meshwise.planner.shapes import ModelShape
from meshwise.planner.traffic import ADAMW_BYTES

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
    ep: float = 0.0  # the experts' all-to-alls

    @property
    def step(self) -> float:
        return self.compute + self.bubble + self.tp + self.cp + self.ep + self.dp + self.optimizer

    def parts(self) -> dict[str, float]:
        return {
            "compute": self.compute,
            "pipeline bubble": self.bubble,
            "tp comm": self.tp,
            "cp comm": self.cp,
            "ep comm": self.ep,
            "dp comm": self.dp,
            "optimizer": self.optimizer,
        }


@functools.lru_cache(maxsize=4096)
def simulated(
    kind: str,
    stages: int,
    micro_batches: int,
    virtual: int,
    forward: float,
    backward: float,
    weights: float,
    latency: float,
):
    """(step time, peak micro-batches in flight per rank) of a schedule, cached across ZeRO
    stages and dp. Past ``SIMULATED_ROUNDS`` x pp micro-batches each further one adds a forward
    and a backward per rank and no kept activation (GPipe keeps them all): simulated there,
    the rest added, so 1,024-rank plans stay fast.
    """
    from meshwise.pipeline.simulator import simulate

    simulated_m = min(micro_batches, SIMULATED_ROUNDS * stages)
    timeline = simulate(
        _schedule(kind, stages, simulated_m, virtual),
        forward,
        backward,
        weights,
        latency,
        check=False,
    )
    extra = (micro_batches - simulated_m) * (forward + backward + weights)
    flights = tuple(timeline.peak_in_flight)
    if kind == "gpipe":
        flights = (micro_batches,) * stages
    return timeline.step_time + extra, flights


SIMULATED_ROUNDS = 2


@functools.lru_cache(maxsize=512)
def _schedule(kind: str, stages: int, micro_batches: int, virtual: int):
    from meshwise.pipeline.schedules import build_schedule
    from meshwise.pipeline.validate import validate

    schedule = build_schedule(kind, stages, micro_batches, virtual)
    validate(schedule)
    return schedule


def _round(x: float, digits: int = 2) -> float:
    """``digits`` significant digits: costs that close share one simulation."""
    return float(f"{x:.{digits}g}")


def in_flight(layout: Layout) -> list[int]:
    """Micro-batch chunks each pipeline rank keeps at once (1 without a pipeline), under
    unit costs."""
    if layout.pp == 1:
        return [1]
    return list(
        simulated(
            layout.schedule,
            layout.pp,
            layout.micro_batches,
            layout.virtual_stages,
            1.0,
            1.0,
            1.0,
            0.0,
        )[1]
    )


@dataclass
class Pipeline:
    """The part of a step that does not depend on the ZeRO stage: every micro-batch's
    compute and tp/cp communication on the slowest rank, with the pipeline's bubble."""

    worst: ActionCosts
    micro_steps: int  # micro-batches x accumulation
    share: float  # the ranks' share of the CPU cores (1 on a GPU)
    seconds: float
    flights: list[int]
    ranks: list[tuple[int, int, int]]
    exact: bool


def pipeline(
    shape: ModelShape, layout: Layout, st: Settings, device: DeviceProfile, exact: bool = True
) -> Pipeline:
    """Simulated with the costs rounded to 2 significant digits (``exact``), else to 1 (a
    first ranking of many layouts; the best are timed again exactly)."""
    ranks = list({rank_params(shape, layout, r) for r in range(layout.pp)})
    layers = shape.n_layer // layout.pp
    per_rank = [
        action_costs(shape, layout, st, device, layers, first > 0, last > 0)
        for _, first, last in ranks
    ]
    worst = max(per_rank, key=lambda c: c.compute + c.comm)
    m = layout.micro_batches * layout.grad_accum
    share = _core_share(layout, device)
    if layout.pp == 1:
        seconds = m * (worst.compute * share + worst.comm)
        return Pipeline(worst, m, share, seconds, [1], ranks, exact)
    n = micro_batch_tokens(layout, st)
    # a stage's output; under sequence parallelism each tp rank holds, and sends, its slice
    message = n * shape.d_model * DTYPE_BYTES[st.dtype] // (layout.tp if layout.sp else 1)
    latency = p2p_s(
        device, message, link_kind(layout.tp * layout.cp, layout.pp, device.ranks_per_node)
    )
    scale = worst.forward + worst.tp / 2 + worst.cp / 3 + worst.ep / 2
    backward = (worst.backward + worst.tp / 2 + 2 * worst.cp / 3 + worst.ep / 2) / scale
    weights = worst.weights / scale
    if exact:
        sim_step, flights = simulated(
            layout.schedule,
            layout.pp,
            layout.micro_batches,
            layout.virtual_stages,
            1.0,
            _round(backward),
            _round(weights),
            _round(latency / scale),
        )
    else:
        sim_step, flights = _coarse(layout, backward, weights, latency / scale)
    # Ranks sharing cores: a pipeline's idle ranks leave theirs to the others.
    shared = m * (worst.compute * share + worst.comm)
    seconds = max(sim_step * scale * layout.grad_accum, shared)
    # Each chunk's forward waits for its input and its backward for its gradient, from
    # another rank but on the first and last stage: meetings with a peer that may have
    # drifted behind, which the simulator's exact costs do not see.
    stages = layout.pp * layout.virtual_stages
    receives = 2 * m * layout.virtual_stages * (stages - 1) / stages
    seconds += sync_wait_s(device, 2, receives, m * worst.compute * share, layout.world_size)
    return Pipeline(worst, m, share, seconds, list(flights), ranks, exact)


def _coarse(layout: Layout, backward: float, weights: float, latency: float):
    """A first estimate for ranking many layouts: the schedule's bubble at unit costs
    (simulated once per schedule shape) applied to these costs, each message's latency on
    the way down and back up (2 (S - 1) of them)."""
    unit_step, flights = simulated(
        layout.schedule, layout.pp, layout.micro_batches, layout.virtual_stages, 1.0, 1.0, 1.0, 0.0
    )
    work = layout.micro_batches * 3.0
    per_micro_batch = 1.0 + backward + weights
    return (
        unit_step / work * layout.micro_batches * per_micro_batch + 2 * (layout.pp - 1) * latency
    ), flights


def step_time(
    shape: ModelShape,
    layout: Layout,
    st: Settings,
    device: DeviceProfile,
    pipe: Pipeline | None = None,
) -> tuple[TimeBreakdown, list[int]]:
    """The slowest rank's step, and the micro-batches each pipeline rank keeps."""
    pipe = pipe or pipeline(shape, layout, st, device)
    w, m = pipe.worst, pipe.micro_steps
    compute = m * w.compute * pipe.share
    bubble = max(0.0, pipe.seconds - compute - m * w.comm)
    dp = _dp_exposed(shape, layout, st, device, pipe.ranks, m * (w.backward + w.weights))
    optimizer = _optimizer_s(shape, layout, st, device, pipe.ranks) * pipe.share
    breakdown = TimeBreakdown(
        compute,
        bubble,
        m * w.tp,
        m * w.cp,
        dp,
        optimizer,
        bubble / pipe.seconds if pipe.seconds > 0 else 0.0,
        m * w.ep,
    )
    return breakdown, pipe.flights


def _core_share(layout: Layout, device: DeviceProfile) -> float:
    """How much slower a rank computes because its machine's ranks share the cores."""
    if device.cores is None:
        return 1.0
    local = (
        layout.world_size
        if device.ranks_per_node <= 0
        else min(layout.world_size, device.ranks_per_node)
    )
    threads = max(1, device.cores // local)  # what meshwise.cli.launch gives each rank
    return 1.0 / min(threads, device.cores / local)


def _dp_exposed(
    shape, layout: Layout, st: Settings, device: DeviceProfile, ranks, backward_s: float
) -> float:
    """Exposed seconds of the gradient (and ZeRO parameter) collectives over dp x cp: within
    a replica of ``--dp-shard``, then each shard's all-reduce across the replicas."""
    if layout.dp * layout.cp == 1:
        return 0.0
    n = layout.shard_size * layout.cp  # ZeRO's ranks
    # routed experts under ep: reduced (and ZeRO-gathered) over their own expert data
    # parallel group, by an engine of their own (under LoRA frozen, held whole)
    experts = rank_expert_params(shape, layout) if layout.ep > 1 or shape.lora else 0.0
    n_expert = expert_dp(layout.dp, layout.cp, layout.ep)
    params = max(sum(r) for r in ranks) - experts
    gathered = params  # ZeRO-3's gathers
    if shape.lora is not None:  # only the adapters have gradients and optimizer state
        adapters, quantized = max(rank_lora_params(shape, layout, last > 0) for *_, last in ranks)
        gathered = params - quantized if layout.zero == 3 else adapters
        params, experts = adapters, 0.0
    a = DTYPE_BYTES[st.dtype]
    per_grad = 2.0 if st.dtype == "bf16" and st.grad_reduce_dtype == "bf16" else 4.0
    per_grad *= COMPRESS_RATIO.get(layout.compress.partition(":")[0], 0.05)
    grad_bytes = params * per_grad
    if layout.dp > 1:
        link = link_kind(
            layout.tp * layout.cp * layout.pp, layout.shard_size, device.ranks_per_node
        )
    else:
        link = link_kind(layout.tp, layout.cp, device.ranks_per_node)

    def coll(kind, nbytes, expert_bytes=0.0):
        return collective_s(device, kind, nbytes, n, link) + collective_s(
            device, kind, expert_bytes, n_expert, link
        )

    z, micro = layout.zero, layout.grad_accum
    syncs = 1  # the step's reduction waits for every rank's last gradient
    if z == 0:
        counts = {"all_reduce": 1}
    elif z == 1:
        counts = {"all_reduce": 1, "all_gather": 1}
    elif z == 2:
        reduces = micro if layout.pp == 1 else 1
        counts = {"reduce_scatter": reduces, "all_gather": 1}
        syncs = reduces
    else:
        per = 1 if layout.pp > 1 else micro
        counts = {"all_gather": per * (1 if layout.pp > 1 else 2), "reduce_scatter": per}
        # a gather per layer in the forward and again in the backward, without a pipeline
        syncs = 1 if layout.pp > 1 else per * 2 * (shape.n_layer + 1)
    sizes = {"all_reduce": grad_bytes, "reduce_scatter": grad_bytes, "all_gather": gathered * a}
    share = experts / max(params, 1)  # the experts' bytes beside each
    total = sum(k * coll(kind, sizes[kind], share * sizes[kind]) for kind, k in counts.items())
    # across replicas: blocking all-reduces of the shards (or buffers), after each reduction
    reductions = counts.get("reduce_scatter", counts.get("all_reduce", 0))
    across = reductions * _across_replicas_s(layout, device, grad_bytes)
    if not device.overlap:
        window = backward_s * (1.5 if syncs > 1 else 1.0)
        return total + across + sync_wait_s(device, n, syncs, window, layout.world_size)
    # Hidden behind the backward (and ZeRO-3's gathers behind the forward too), but the
    # last bucket's reduction waits for the last gradient; without a pipeline ZeRO-3's
    # root unit (embedding, head) is gathered before the first layer can start and
    # reduced after the last gradient, with nothing to hide behind.
    tail = coll("all_reduce", min(grad_bytes, st.bucket_mb * 2**20))
    if z == 3 and layout.pp == 1:
        root = max(first + last for _, first, last in ranks)
        tail = max(
            tail,
            coll("all_gather", root * a)
            + coll("reduce_scatter", grad_bytes * root / max(gathered, 1)),
        )
    window = backward_s * (1.5 if z == 3 else 1.0)
    # what is hidden still slows the compute it runs beside
    return max(tail, total - window) + device.overlap_slowdown * min(total, window) + across


def _across_replicas_s(layout: Layout, device: DeviceProfile, grad_bytes: float) -> float:
    """One reduction's all-reduce over the replicas of ``--dp-shard`` (0 with one)."""
    if layout.replicas == 1:
        return 0.0
    stride = layout.shard_size * layout.tp * layout.cp * layout.pp
    link = link_kind(stride, layout.replicas, device.ranks_per_node)
    nbytes = cross_replica_bytes(layout, grad_bytes)
    return collective_s(device, "all_reduce", nbytes, layout.replicas, link)


def _optimizer_s(shape, layout: Layout, st: Settings, device: DeviceProfile, ranks) -> float:
    """AdamW over the parameters this rank owns, and the gradient norm over its gradients."""
    params: float = max(sum(r) for r in ranks)
    owned = params
    if shape.lora is not None:  # AdamW and the norm over the adapters only
        params = max(rank_lora_params(shape, layout, last > 0)[0] for *_, last in ranks)
        owned = params / (layout.shard_size * layout.cp) if layout.zero else params
    elif layout.zero:  # experts shard over their expert data parallel ranks, the rest over dp x cp
        experts = rank_expert_params(shape, layout)
        n = layout.shard_size * layout.cp
        owned = (params - experts) / n + experts / expert_dp(layout.dp, layout.cp, layout.ep)
    if device.optimizer_s_per_param:
        return device.optimizer_fixed_s + owned * device.optimizer_s_per_param
    # AdamW's kernels over what this rank owns (meshwise.planner.traffic), the compute
    # copy of the updated parameters (fp32 read, bf16 written), and the norm's read of
    # every held gradient
    grad = 2 if st.dtype == "bf16" and st.grad_reduce_dtype == "bf16" else 4
    touched = owned * (ADAMW_BYTES + (6 if st.dtype == "bf16" else 0)) + params * grad
    return touched / device.memory_bandwidth
