"""The collectives, over ``torch.distributed``: each operation is entered in this rank's
``CommContext`` (NCCL's rules, the ledger), issued, and counted per category in its
``Group``'s counters; its ``Handle`` marks it complete once waited for. With
``meshwise.comm.groups`` (the groups and their context) and ``meshwise.comm.point_to_point``
(tagged transfers), the only code that calls ``torch.distributed``; their names are
re-exported here, the one interface every other module calls.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# Re-exported: groups, their context and point-to-point transfers are called through ops.
from meshwise.comm.groups import (  # noqa: F401
    NCCL_TIMEOUT_MARGIN_S,
    Group,
    _begin,
    _describe,
    _finish,
    _nbytes,
    backend,
    context,
    destroy_process_group,
    init_process_group,
    new_group,
    open_store,
    with_counters,
    world_group,
)

# Re-exported: handles and timeouts are part of the collectives' interface.
from meshwise.comm.handle import CollectiveTimeout, CommCounters, Handle, is_timeout, timeout_error  # noqa: F401
from meshwise.comm.point_to_point import batch_p2p, recv, send  # noqa: F401

# torch >= 2.13 renames the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def start_ledger(timeout_s: float | None, out_dir=None) -> None:
    """Compare ledgers across ranks from now on: the per-step ``check_ledger`` and the
    watchdog. ``out_dir``: where each rank writes its ledger when something is wrong."""
    world = dist.group.WORLD
    ends_timeouts = dist.get_backend(world) == "nccl"  # gloo's own waits time out
    context().start(timeout_s, ends_timeouts, out_dir)


def check_ledger(timeout_s: float = 60.0, step: int | None = None, now: bool = False) -> None:
    """Every rank: compare what each rank issued on each group since the start; raise
    ``CollectiveDesync`` naming the rank and both call sites where they first differ.
    With ``step``, only every ``MESHWISE_LEDGER_CHECK_EVERY`` steps (the first
    operation that differs is still the one named), or ``now``."""
    found = context().check(timeout_s, step, now)
    if found:
        raise CollectiveDesync(found)


class CollectiveDesync(RuntimeError):
    """Ranks issued different operations on a group; names the rank and both call sites."""


# Bytes on the wire are counted at the bandwidth-optimal ring cost (Patarasuk & Yuan 2009;
# Thakur et al. 2005): all-reduce 2 (n-1)/n of the buffer, reduce-scatter and all-gather
# (n-1)/n of the full buffer, a send its whole payload.
def _ring_fraction(group: Group) -> float:
    return (group.size - 1) / group.size


def all_reduce(
    tensor: torch.Tensor,
    group: Group,
    op: str = "sum",
    category: str = "other",
    async_op: bool = False,
):
    """In-place all-reduce; returns a ``Handle`` when ``async_op``."""
    if group.size == 1:
        return Handle([], None, category) if async_op else None
    entry = _begin(group, f"all_reduce {op}", [tensor], reduce_op=op)
    group.counters.record(category, 2 * _ring_fraction(group) * _nbytes(tensor))
    work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group.pg, async_op=True)
    return _finish(work, group, category, async_op, entry, op="all_reduce")


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    category: str = "other",
    async_op: bool = False,
):
    """Sum ``input`` (``group.size`` equal chunks) across ranks; this rank's chunk -> ``output``."""
    assert input.numel() == output.numel() * group.size, "input must be size * output"
    if group.size == 1:
        output.copy_(input)
        return Handle([], None, category) if async_op else None
    entry = _begin(group, "reduce_scatter", [input, output], reduce_op="sum")
    group.counters.record(category, _ring_fraction(group) * _nbytes(input))
    work = _reduce_scatter_flat(output, input, group=group.pg, async_op=True)
    return _finish(work, group, category, async_op, entry, keep=input, op="reduce_scatter")


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    category: str = "other",
    async_op: bool = False,
):
    """Concatenate every rank's ``input`` into ``output`` (flat, rank order)."""
    assert output.numel() == input.numel() * group.size, "output must be size * input"
    if group.size == 1:
        output.copy_(input.view_as(output))
        return Handle([], None, category) if async_op else None
    entry = _begin(group, "all_gather", [input, output])
    group.counters.record(category, _ring_fraction(group) * _nbytes(output))
    work = _all_gather_flat(output, input, group=group.pg, async_op=True)
    return _finish(work, group, category, async_op, entry, keep=input, op="all_gather")


def broadcast(tensor: torch.Tensor, src: int, group: Group, category: str = "other") -> None:
    """Broadcast from group rank ``src`` in place."""
    if group.size == 1:
        return
    entry = _begin(group, f"broadcast from {src}", [tensor])
    if group.rank == src:
        group.counters.record(category, _nbytes(tensor))
    work = dist.broadcast(tensor, src=group.global_rank(src), group=group.pg, async_op=True)
    _finish(work, group, category, False, entry, op="broadcast")


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    category: str = "other",
    async_op: bool = False,
):
    """Rows ``input_splits[j]`` of ``input`` (dim 0, in order) go to group rank ``j``;
    ``output`` receives ``output_splits[i]`` rows from rank ``i``, in rank order.
    ``None`` splits: equal parts. Sizes may differ per rank (expert dispatch), so the
    ledger matches the operation and dtype, not the sizes."""
    if group.size == 1:
        output.copy_(input)
        return Handle([], None, category) if async_op else None
    entry = _begin(group, f"all_to_all {str(input.dtype).removeprefix('torch.')}", [input, output])
    row_bytes = math.prod(input.shape[1:]) * input.element_size()
    kept = input_splits[group.rank] if input_splits is not None else len(input) // group.size
    group.counters.record(category, (len(input) - kept) * row_bytes)  # rows that leave
    work = dist.all_to_all_single(
        output, input, output_splits, input_splits, group=group.pg, async_op=True
    )
    return _finish(work, group, category, async_op, entry, keep=input, op="all_to_all")


def all_gather_object(obj, group: Group, category: str = "other") -> list:
    """Every rank's picklable ``obj``, in group-rank order (small metadata only)."""
    if group.size == 1:
        return [obj]
    entry = _begin(group, "all_gather_object", [])
    out = [None] * group.size
    try:
        dist.all_gather_object(out, obj, group=group.pg)
    except RuntimeError as exc:
        if is_timeout(exc):
            raise timeout_error(exc, _describe(group, "all_gather_object"), context()) from None
        raise
    ledger = context().ledger
    if entry is not None and ledger is not None:
        ledger.complete(entry)
    group.counters.calls[category] += 1
    return out


def barrier(group: Group) -> None:
    if group.size > 1:
        entry = _begin(group, "barrier", [])
        _finish(
            dist.barrier(group=group.pg, async_op=True), group, "other", False, entry, op="barrier"
        )
