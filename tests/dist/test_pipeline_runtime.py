"""Parity of ``PipelineRuntime`` against the same layers in one process, in float64.

Every rank builds the whole stack from one seed (an input layer, Linear+tanh
blocks, a head), cuts it into logical stages, and runs its own chunks with a
schedule on gloo ranks; the loss and every parameter gradient must match the
stack run in one process. The stages carry no fixed activation shape: the
variants exchange bf16 activations, hidden states that are not 3-D, and
sequence lengths that change between ``forward_only`` calls.
"""

import contextlib
import copy
import ctypes
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshwise.pipeline.mailbox as mailbox_module
from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
from meshwise.mesh import Mesh, ParallelDims
from meshwise.pipeline.runtime import PipelineRuntime
from meshwise.pipeline.schedules import build_schedule
from meshwise.tensor_parallel.weight_grads import WeightGradStore
from tests.dist.pool import RankError

DT = torch.float64
TOL = dict(rtol=1e-12, atol=1e-14)
D_IN, D, NUM_CLASSES, T, ROWS = 5, 8, 7, 3, 2  # ROWS: sequences per micro-batch


class NoSyncEngine:
    """The runtime's engine needs only ``no_sync()`` here: there is no dp axis."""

    def no_sync(self):
        return contextlib.nullcontext()


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# How an activation crosses from stage s to s + 1: (leaving s, entering s + 1).
EDGES = {
    "3d-fp64": lambda s: (None, None),
    "bf16": lambda s: (lambda x: x.to(torch.bfloat16), lambda x: x.to(DT)),
    # (B, T*D) 2-D, (B, 1, T, D) 4-D, alternating; neither needs T to be undone.
    "not-3d": lambda s: [(lambda x: x.flatten(1), lambda x: x.unflatten(1, (-1, D))),
                         (lambda x: x.unsqueeze(1), lambda x: x.squeeze(1))][s % 2],
}


def _stages(num_logical: int, edges: str, blocks_per_stage: int = 1,
            checkpointing: bool = False) -> list[nn.Sequential]:
    """The whole stack cut into ``num_logical`` stages, identical on every rank."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(D, D, dtype=DT), nn.Tanh())
              for _ in range(num_logical * blocks_per_stage)]
    if checkpointing:
        apply_activation_checkpointing(blocks, "full")
    stages = []
    for s in range(num_logical):
        layers = [nn.Linear(D_IN, D, dtype=DT)] if s == 0 else []
        if s > 0 and EDGES[edges](s - 1)[1] is not None:
            layers.insert(0, Lambda(EDGES[edges](s - 1)[1]))
        layers += blocks[s * blocks_per_stage:(s + 1) * blocks_per_stage]
        if s == num_logical - 1:
            layers.append(nn.Linear(D, NUM_CLASSES, dtype=DT))
        elif EDGES[edges](s)[0] is not None:
            layers.append(Lambda(EDGES[edges](s)[0]))
        stages.append(nn.Sequential(*layers))
    return stages


def loss_fn(logits, targets):  # (B, T, C), (B, T): the SUM of token losses
    return F.cross_entropy(logits.reshape(-1, NUM_CLASSES), targets.reshape(-1), reduction="sum")


class WithLoss(nn.Module):
    """A last stage that computes its own loss: ``chunk(x, targets)``."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x, targets=None):
        logits = self.stage(x)
        return logits if targets is None else loss_fn(logits, targets)


def _batch(num_micro_batches: int, seq_len: int = T, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_micro_batches * ROWS, seq_len, D_IN, generator=g, dtype=DT)
    y = torch.randint(0, NUM_CLASSES, (num_micro_batches * ROWS, seq_len), generator=g)
    return list(zip(x.chunk(num_micro_batches), y.chunk(num_micro_batches)))


def _reference(stages, micro_batches, scale):
    """The stack in one process: summed scaled loss; gradients left on the parameters."""
    total = 0.0
    for inputs, targets in micro_batches:
        x = inputs
        for stage in stages:
            x = stage(x)
        total = total + loss_fn(x, targets) * scale
    total.backward()
    return total.detach()


def _my_chunks(stages, pp_rank: int, num_stages: int, num_virtual: int, schedule=None):
    if schedule is not None:
        return [stages[schedule.stage_of(pp_rank, v)] for v in range(num_virtual)]
    return [stages[v * num_stages + pp_rank] for v in range(num_virtual)]


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- rank functions
def _check_parity(kind, num_virtual, num_micro_batches, edges, own_loss, checkpointing=False):
    mesh = Mesh.build(ParallelDims(pp=torch.distributed.get_world_size()))
    S, L = mesh.dims.pp, mesh.dims.pp * num_virtual
    stages, ref_stages = _stages(L, edges, checkpointing=checkpointing), _stages(L, edges)
    schedule = build_schedule(kind, S, num_micro_batches, num_virtual)
    chunks = _my_chunks(stages, mesh.pp_rank, S, num_virtual, schedule)
    holds_last = schedule.owner(L - 1)[0] == mesh.pp_rank
    if own_loss and holds_last:
        chunks[-1] = WithLoss(chunks[-1])
    seen = []  # dtypes and ranks of the activations this rank's later chunks receive
    for chunk in chunks:
        chunk.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, args[0].dim())))
    runtime = PipelineRuntime(chunks, schedule, mesh.pp_group, NoSyncEngine(),
                              loss_fn=None if own_loss else loss_fn)
    micro_batches = _batch(num_micro_batches)
    scale = 1.0 / (num_micro_batches * ROWS * T)
    for run in range(2):  # a second run keeps the shapes learned and accumulates gradients
        loss = runtime.run(micro_batches, scale)
        # One header per forward edge, whatever the number of micro-batches, in the
        # first run only: later steps send none (and read none on the host).
        stages_here = [schedule.stage_of(mesh.pp_rank, v) for v in range(num_virtual)]
        away = [s for s in range(L) if schedule.owner(s)[0] != mesh.pp_rank]
        crossing = [s for s in stages_here if s + 1 in away]
        receiving = [s for s in stages_here if s - 1 in away]
        assert runtime.channels.headers_sent == (run == 0) * len(crossing)
        assert runtime.channels.headers_received == (run == 0) * len(receiving)
        assert [label for label, _, _ in runtime.action_times() if label != "p2p"] == \
            [str(a) for a in schedule.compute_actions(mesh.pp_rank)]
    expected = _reference(ref_stages, micro_batches, scale)
    _reference(ref_stages, micro_batches, scale)
    assert loss.dim() == 0
    if holds_last:
        _close(loss, expected, f"{kind} loss")
    else:
        assert loss.item() == 0.0
    for v in range(num_virtual):
        stage = schedule.stage_of(mesh.pp_rank, v)
        for (name, p), ref in zip(stages[stage].named_parameters(),
                                  ref_stages[stage].parameters(), strict=True):
            _close(p.grad, ref.grad, f"{kind} stage {stage} {name} grad")
    return sorted(set(seen), key=str)


def _deferred_micro_batches(kind, num_virtual, num_micro_batches):
    """Parity as above; the (chunk, micro_batch) whose linear layers deferred a weight
    gradient on this rank."""
    deferred, put = set(), WeightGradStore.put

    def counting_put(store, key, *rest):
        deferred.add(key)
        put(store, key, *rest)

    WeightGradStore.put = counting_put
    try:
        _check_parity(kind, num_virtual, num_micro_batches, "3d-fp64", False)
    finally:
        WeightGradStore.put = put
    return sorted(deferred)


def _check_forward_only(edges, kind="interleaved-1f1b"):
    """Evaluation and generation: a new sequence length at every call."""
    mesh = Mesh.build(ParallelDims(pp=torch.distributed.get_world_size()))
    S = mesh.dims.pp
    stages = _stages(2 * S, edges)
    schedule = build_schedule(kind, S, 2 * S, 2)
    runtime = PipelineRuntime(_my_chunks(stages, mesh.pp_rank, S, 2, schedule), schedule,
                              mesh.pp_group, NoSyncEngine(), loss_fn=loss_fn)
    holds_last = schedule.owner(2 * S - 1)[0] == mesh.pp_rank
    for seq_len in (3, 5, 1, 6):
        [(inputs, targets)] = _batch(1, seq_len, seed=seq_len)
        with torch.no_grad():
            x = inputs
            for stage in stages:
                x = stage(x)
        logits = runtime.forward_only(inputs)
        loss = runtime.forward_only(inputs, targets)
        if holds_last:
            _close(logits, x, f"logits, length {seq_len}")
            _close(loss, loss_fn(x, targets), f"loss, length {seq_len}")
        else:
            assert logits is None and loss is None


def _run_after_forward_only():
    """Evaluation between training steps: a ``forward_only`` of another shape, then a
    ``run`` of the training shapes again; both runs' losses (on the last stage)."""
    mesh = Mesh.build(ParallelDims(pp=2))
    runtime = PipelineRuntime(_my_chunks(_stages(2, "3d-fp64"), mesh.pp_rank, 2, 1),
                              build_schedule("1f1b", 2, 2), mesh.pp_group, NoSyncEngine(), loss_fn)
    micro_batches = _batch(2)
    before = runtime.run(micro_batches, 1.0)
    [(inputs, _)] = _batch(1, seq_len=T + 2)  # ROWS sequences of another length
    runtime.forward_only(torch.cat([inputs, inputs]))  # and twice the rows
    after = runtime.run(micro_batches, 1.0)
    return before.item(), after.item()


class LateGradient(torch.autograd.Function):
    """The identity, whose first backward takes ``delay_s`` longer: a peer behind."""

    calls = 0

    @staticmethod
    def forward(ctx, x, delay_s):
        ctx.delay_s = delay_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        LateGradient.calls += 1
        if LateGradient.calls == 1:
            time.sleep(ctx.delay_s)
        return grad, None


def _waits_around_a_late_gradient(delay_s):
    """ZB-V on 2 ranks, M = 4: rank 0 posts the receive of micro-batch 0's gradient
    (from stage 1 on rank 1, late by ``delay_s``), then runs micro-batch 3's forward,
    which does not read it, then micro-batch 0's backward, which does. Rank 0's
    waits before each of the two, in seconds."""
    mesh = Mesh.build(ParallelDims(pp=2))
    schedule = build_schedule("zbv", 2, 4, 2)
    stages = _stages(4, "3d-fp64")
    LateGradient.calls = 0  # a pool's worker runs many tests
    stages[1].insert(0, Lambda(lambda x: LateGradient.apply(x, delay_s)))
    runtime = PipelineRuntime(_my_chunks(stages, mesh.pp_rank, 2, 2, schedule), schedule,
                              mesh.pp_group, NoSyncEngine(), loss_fn=loss_fn)
    runtime.run(_batch(4), 1.0)
    times = runtime.action_times()
    labels = [label for label, _, _ in times]

    def wait_before(label):
        i = labels.index(label)
        _, start, end = times[i - 1]
        return end - start if labels[i - 1] == "p2p" else 0.0

    return wait_before("F3.0"), wait_before("B0.0")


def _wrong_shape():
    """Micro-batch 1 is shorter than micro-batch 0: stage 0 must say so, not hang."""
    mesh = Mesh.build(ParallelDims(pp=2))
    stages = _stages(2, "3d-fp64")
    runtime = PipelineRuntime(_my_chunks(stages, mesh.pp_rank, 2, 1),
                              build_schedule("1f1b", 2, 2), mesh.pp_group, NoSyncEngine(), loss_fn)
    micro_batches = [_batch(1, seq_len=T)[0], _batch(1, seq_len=T - 1)[0]]
    runtime.run(micro_batches, 1.0)


class Told(nn.Module):
    """A stage that takes ``context=`` and records, in ``seen``, the context each of its
    forwards is given, under its logical stage index."""

    def __init__(self, stage, index: int, seen: list):
        super().__init__()
        self.stage, self.index, self.seen = stage, index, seen

    def forward(self, x, context=None):
        self.seen.append((self.index, context))
        return self.stage(x)


def _contexts_reach_every_stage(kind, num_virtual, num_micro_batches):
    """Every chunk's forward of micro-batch m is given micro-batch m's context, in the
    schedule's order; ``forward_only`` gives its one context to every stage."""
    mesh = Mesh.build(ParallelDims(pp=2))
    schedule = build_schedule(kind, 2, num_micro_batches, num_virtual)
    seen = []
    stages = [Told(stage, i, seen) for i, stage in enumerate(_stages(2 * num_virtual,
                                                                     "3d-fp64"))]
    runtime = PipelineRuntime(_my_chunks(stages, mesh.pp_rank, 2, num_virtual, schedule),
                              schedule, mesh.pp_group, NoSyncEngine(), loss_fn=loss_fn)
    contexts = [f"micro-batch {m}" for m in range(num_micro_batches)]
    runtime.run(_batch(num_micro_batches), 1.0, contexts=contexts)
    assert seen == [(schedule.stage_of(mesh.pp_rank, a.chunk), contexts[a.micro_batch])
                    for a in schedule.compute_actions(mesh.pp_rank) if a.kind == "F"]
    seen.clear()
    runtime.forward_only(_batch(1)[0][0], context="evaluation")
    held = sorted(schedule.stage_of(mesh.pp_rank, v) for v in range(num_virtual))
    assert seen == [(stage, "evaluation") for stage in held]


class Scale(nn.Module):
    """``x * w``: its backward keeps ``x`` (an input) but not its output."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.full((d,), 0.5, dtype=DT))

    def forward(self, x):
        return x * self.w


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_at_first_backward(rows, d, num_micro_batches, release):
    """GPipe on 2 ranks: stage 0's resident memory and its sent outputs' storage, as
    measured when its first backward runs (all forwards sent by then)."""
    # Large blocks are mmapped and unmapped at free: the resident set shows what is live.
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    mesh = Mesh.build(ParallelDims(pp=2))
    outputs, probe = [], {}

    def measure(grad):  # runs inside stage 0's backward, first micro-batch first
        probe.setdefault("at", (_rss_bytes(), [o.untyped_storage().nbytes() for o in outputs]))

    chunk = Scale(d) if mesh.pp_rank == 0 else Lambda(lambda x: x)
    if mesh.pp_rank == 0:
        chunk.register_forward_hook(lambda m, args, out: outputs.append(out))
        chunk.w.register_hook(measure)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_micro_batches * rows, d, generator=g, dtype=DT)
    micro_batches = [(mb, None) for mb in x.chunk(num_micro_batches)]
    runtime = PipelineRuntime([chunk], build_schedule("gpipe", 2, num_micro_batches), mesh.pp_group,
                              NoSyncEngine(), loss_fn=lambda out, _: out.sum())
    saved = mailbox_module.release_storage
    if not release:  # the same run holding its outputs, to measure what releasing saves
        mailbox_module.release_storage = lambda tensor: None
    try:
        before = _rss_bytes()
        runtime.run(micro_batches, 1.0)
    finally:
        mailbox_module.release_storage = saved
    if mesh.pp_rank != 0:
        return None
    rss, storage = probe["at"]
    return rss - before, storage


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("kind, num_virtual, num_micro_batches", [
    ("gpipe", 1, 4), ("1f1b", 1, 4), ("1f1b", 1, 1), ("interleaved-1f1b", 2, 4)])
def test_runtime_matches_one_process_on_2_ranks(dist_pools, kind, num_virtual,
                                                  num_micro_batches):
    seen = dist_pools.run(2, _check_parity, kind, num_virtual, num_micro_batches,
                          "3d-fp64", False)
    assert seen[1] == [(DT, 3)]  # rank 1 only ever receives (B, T, D) float64


@pytest.mark.parametrize("kind, num_virtual, num_micro_batches", [
    ("1f1b", 1, 8), ("interleaved-1f1b", 2, 4)])
def test_runtime_matches_one_process_on_4_ranks(dist_pools, kind, num_virtual,
                                                  num_micro_batches):
    dist_pools.run(4, _check_parity, kind, num_virtual, num_micro_batches, "3d-fp64", False)


@pytest.mark.parametrize("kind, num_virtual, num_micro_batches, checkpointing", [
    ("zbv", 2, 4, False), ("dualpipev", 2, 4, False),
    ("zbv", 2, 3, True), ("zb-h1", 1, 2, True)])
def test_split_backward_schedules_match_one_process_on_2_ranks(
        dist_pools, kind, num_virtual, num_micro_batches, checkpointing):
    dist_pools.run(2, _check_parity, kind, num_virtual, num_micro_batches, "3d-fp64", False,
                   checkpointing)


@pytest.mark.parametrize("kind, num_virtual, num_micro_batches, checkpointing", [
    ("zb-h1", 1, 8, True), ("zbv", 2, 8, False), ("dualpipev", 2, 8, True)])
def test_split_backward_schedules_match_one_process_on_4_ranks(
        dist_pools, kind, num_virtual, num_micro_batches, checkpointing):
    dist_pools.run(4, _check_parity, kind, num_virtual, num_micro_batches, "3d-fp64", False,
                   checkpointing)


@pytest.mark.parametrize("kind, num_virtual", [("interleaved-1f1b", 2), ("zbv", 2)])
def test_each_micro_batchs_context_reaches_every_stage(dist_pools, kind, num_virtual):
    dist_pools.run(2, _contexts_reach_every_stage, kind, num_virtual, 4)


def test_a_weight_pass_straight_after_its_backward_runs_whole(dist_pools):
    """zb-h1's first stage runs each W right after its B, so its backwards run whole
    (nothing kept for a later pass); the last stage sends its B's gradient first, and
    defers every weight gradient. Both match one process."""
    deferred = dist_pools.run(2, _deferred_micro_batches, "zb-h1", 1, 4)
    assert deferred[0] == []
    assert deferred[1] == [(0, m) for m in range(4)]


def test_a_forward_does_not_wait_for_a_gradient_it_does_not_read(dist_pools):
    """A receive is waited for by the action that reads it, not where it is posted:
    a late gradient holds up its backward, not the forward scheduled before it."""
    forward_wait, backward_wait = dist_pools.run(2, _waits_around_a_late_gradient, 0.5)[0]
    assert forward_wait < 0.25 and backward_wait > 0.25, (forward_wait, backward_wait)


def test_v_shaped_stages_exchange_bf16_and_own_loss(dist_pools):
    dist_pools.run(2, _check_parity, "zbv", 2, 4, "bf16", True)


def test_last_chunk_computing_its_own_loss(dist_pools):
    dist_pools.run(2, _check_parity, "1f1b", 1, 4, "3d-fp64", True)


def test_stages_exchange_bf16_activations(dist_pools):
    seen = dist_pools.run(2, _check_parity, "interleaved-1f1b", 2, 4, "bf16", False)
    assert seen[1] == [(torch.bfloat16, 3)]  # stages 1 and 3 receive bf16


def test_hidden_states_that_are_not_3d(dist_pools):
    seen = dist_pools.run(2, _check_parity, "interleaved-1f1b", 2, 4, "not-3d", False)
    assert seen[0] == [(DT, 3), (DT, 4)] and seen[1] == [(DT, 2)]


@pytest.mark.parametrize("edges", ["3d-fp64", "not-3d", "bf16"])
def test_forward_only_with_changing_sequence_length(dist_pools, edges):
    dist_pools.run(2, _check_forward_only, edges)


def test_a_run_after_forward_only_of_another_shape(dist_pools):
    _, (before, after) = dist_pools.run(2, _run_after_forward_only)
    assert after == before  # the same parameters: nothing stepped between the runs


def test_forward_only_through_a_v(dist_pools):
    dist_pools.run(2, _check_forward_only, "not-3d", "zbv")


def test_sent_activations_are_freed(dist_pools):
    rows, d, num_micro_batches = 2048, 1024, 4
    activation_bytes = rows * d * 8  # 16 MiB each
    freed, _ = dist_pools.run(2, _memory_at_first_backward, rows, d, num_micro_batches, True)
    held, _ = dist_pools.run(2, _memory_at_first_backward, rows, d, num_micro_batches, False)
    (freed_rss, freed_storage), (held_rss, held_storage) = freed, held
    print(f"\nstage 0 resident growth at its first backward, {num_micro_batches} sent "
          f"activations of {activation_bytes / 2**20:.0f} MiB: {held_rss / 2**20:.1f} MiB "
          f"holding them, {freed_rss / 2**20:.1f} MiB releasing them "
          f"({(held_rss - freed_rss) / 2**20:.1f} MiB freed)")
    assert freed_storage == [8] * num_micro_batches  # one float64 left of each
    assert held_storage == [activation_bytes] * num_micro_batches
    assert held_rss - freed_rss > 0.9 * num_micro_batches * activation_bytes


def test_wrong_shaped_stage_output_raises(dist_pools):
    with pytest.raises(RankError, match=r"rank 0 raised:(.|\n)*pipeline stage 0 produced an "
                       r"output of \(2, 2, 8\) torch.float64 for stage 1, but \(2, 3, 8\)"):
        dist_pools.run(2, _wrong_shape, timeout=60)
