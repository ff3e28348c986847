"""The one module that calls ``torch.distributed``.

Every collective and point-to-point transfer in meshwise goes through here, so
byte counting, timing of exposed waits and debugging live in one place.

A ``Group`` wraps a process group with this rank's position in it and a shared
``CommCounters``. Counters record the bytes *this rank* puts on the wire per
category (``"grad"``, ``"param"``, ``"p2p"``, ...), using the bandwidth-optimal
ring cost of each collective (Patarasuk & Yuan 2009; Thakur et al. 2005):
all-reduce sends ``2 (n-1)/n`` of the buffer, reduce-scatter and all-gather
``(n-1)/n`` of the full buffer, a send its whole payload.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from meshwise.comm.devices import rank_device

# torch >= 2.13 renames the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CommCounters:
    """Bytes sent, calls made and seconds spent waiting, per category."""

    def __init__(self):
        self.bytes_sent = defaultdict(float)
        self.calls = defaultdict(int)
        self.wait_s = defaultdict(float)

    def record(self, category: str, nbytes: float) -> None:
        self.bytes_sent[category] += nbytes
        self.calls[category] += 1

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()
        self.wait_s.clear()


class CollectiveTimeout(RuntimeError):
    """A collective or transfer waited past its group's timeout; names the group and operation."""


class Group:
    """A process group, this rank's index in it, and the counters it feeds."""

    def __init__(self, pg, ranks: list[int], name: str, counters: CommCounters,
                 timeout_s: float | None = None):
        self.pg = pg
        self.ranks = list(ranks)
        self.name = name
        self.counters = counters
        self.timeout_s = timeout_s  # None: torch.distributed's default
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __deepcopy__(self, memo):
        # A process group is a handle to shared state, never copied with a model.
        return self

    def __repr__(self) -> str:
        return f"Group({self.name}, rank {self.rank} of {self.ranks})"


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _timeout_error(exc: BaseException, what: str) -> CollectiveTimeout:
    """One line naming the operation and group, for the launcher to print."""
    detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return CollectiveTimeout(f"{what} timed out: a rank of it did not arrive ({detail})")


def _describe(group: "Group", op: str, peer: int | None = None) -> str:
    who = f"peer rank {group.global_rank(peer)}" if peer is not None else f"ranks {group.ranks}"
    limit = f" after {group.timeout_s:g}s" if group.timeout_s else ""
    return f"{op} on group {group.name} ({who}){limit}"


class Handle:
    """An in-flight async operation. ``wait()`` exactly once."""

    def __init__(self, works, counters: CommCounters | None, category: str,
                 on_done=None, keep=None, what: str = "a collective"):
        self._works = works if isinstance(works, list) else [works]
        self._keep = keep  # tensors that must outlive the transfer
        self._counters = counters
        self._category = category
        self._on_done = on_done
        self._what = what  # operation and group, named when it times out
        self.done = False

    def wait(self) -> None:
        assert not self.done, "Handle.wait() called twice"
        start = time.perf_counter()
        for work in self._works:
            if work is not None:
                try:
                    work.wait()
                except RuntimeError as exc:
                    if _is_timeout(exc):
                        raise _timeout_error(exc, self._what) from None
                    raise
        if self._counters is not None:
            self._counters.wait_s[self._category] += time.perf_counter() - start
        self.done = True
        # Drop the works too: a finished work may still reference its tensors, and a
        # sent activation's memory is only returned once nothing references it.
        self._works, self._keep = [], None
        if self._on_done is not None:
            self._on_done()


def init_process_group(backend: str, timeout_s: float) -> None:
    """Initialise from the ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` env."""
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = rank_device("cuda")
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world_group(counters: CommCounters | None = None, timeout_s: float | None = None) -> Group:
    """The whole world; ``timeout_s`` is the one it was initialised with, for messages."""
    return Group(dist.group.WORLD, list(range(dist.get_world_size())), "world",
                 counters or CommCounters(), timeout_s)


def new_group(ranks: list[int], name: str, counters: CommCounters,
              timeout_s: float | None = None) -> Group | None:
    """Create a subgroup. Every rank must call this for every group, in order;
    ranks outside ``ranks`` get ``None``. ``timeout_s``: how long its operations
    may wait (subgroups do not inherit the world's; ``None``: torch's default)."""
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    pg = dist.new_group(ranks=list(ranks), timeout=timeout)
    if dist.get_rank() not in ranks:
        return None
    return Group(pg, ranks, name, counters, timeout_s)


def _finish(work, group: Group, category: str, async_op: bool, on_done=None, keep=None,
            op: str = "collective", peer: int | None = None):
    handle = Handle(work, group.counters, category, on_done, keep, _describe(group, op, peer))
    if async_op:
        return handle
    handle.wait()
    return None


def backend(group: Group) -> str:
    """The backend that carries ``group``'s collectives: ``"gloo"``, ``"nccl"``, ...;
    ``"local"`` for a group of one rank. What differs per backend is decided in
    ``meshwise.comm.policy``."""
    if group.size == 1:
        return "local"
    return str(dist.get_backend(group.pg))


def _ring_fraction(group: Group) -> float:
    return (group.size - 1) / group.size


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum",
               category: str = "other", async_op: bool = False):
    """In-place all-reduce; returns a ``Handle`` when ``async_op``."""
    if group.size == 1:
        return Handle([], None, category) if async_op else None
    group.counters.record(category, 2 * _ring_fraction(group) * _nbytes(tensor))
    work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group.pg, async_op=True)
    return _finish(work, group, category, async_op, op="all_reduce")


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group,
                   category: str = "other", async_op: bool = False):
    """Sum ``input`` (``group.size`` equal chunks) across ranks; this rank's chunk -> ``output``."""
    assert input.numel() == output.numel() * group.size, "input must be size * output"
    if group.size == 1:
        output.copy_(input)
        return Handle([], None, category) if async_op else None
    group.counters.record(category, _ring_fraction(group) * _nbytes(input))
    work = _reduce_scatter_flat(output, input, group=group.pg, async_op=True)
    return _finish(work, group, category, async_op, keep=input, op="reduce_scatter")


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group,
               category: str = "other", async_op: bool = False):
    """Concatenate every rank's ``input`` into ``output`` (flat, rank order)."""
    assert output.numel() == input.numel() * group.size, "output must be size * input"
    if group.size == 1:
        output.copy_(input.view_as(output))
        return Handle([], None, category) if async_op else None
    group.counters.record(category, _ring_fraction(group) * _nbytes(output))
    work = _all_gather_flat(output, input, group=group.pg, async_op=True)
    return _finish(work, group, category, async_op, keep=input, op="all_gather")


def broadcast(tensor: torch.Tensor, src: int, group: Group, category: str = "other") -> None:
    """Broadcast from group rank ``src`` in place."""
    if group.size == 1:
        return
    if group.rank == src:
        group.counters.record(category, _nbytes(tensor))
    work = dist.broadcast(tensor, src=group.global_rank(src), group=group.pg, async_op=True)
    _finish(work, group, category, False, op="broadcast")


def all_gather_object(obj, group: Group, category: str = "other") -> list:
    """Every rank's picklable ``obj``, in group-rank order (small metadata only)."""
    if group.size == 1:
        return [obj]
    out = [None] * group.size
    try:
        dist.all_gather_object(out, obj, group=group.pg)
    except RuntimeError as exc:
        if _is_timeout(exc):
            raise _timeout_error(exc, _describe(group, "all_gather_object")) from None
        raise
    group.counters.calls[category] += 1
    return out


def barrier(group: Group) -> None:
    if group.size > 1:
        _finish(dist.barrier(group=group.pg, async_op=True), group, "other", False, op="barrier")


def send(tensor: torch.Tensor, dst: int, group: Group, tag: int = 0,
         category: str = "p2p", async_op: bool = False):
    """Send to group rank ``dst`` with a tag."""
    group.counters.record(category, _nbytes(tensor))
    tensor = tensor.contiguous()
    work = dist.isend(tensor, dst=group.global_rank(dst), group=group.pg, tag=tag)
    return _finish(work, group, category, async_op, keep=tensor, op="send", peer=dst)


def recv(tensor: torch.Tensor, src: int, group: Group, tag: int = 0,
         category: str = "p2p", async_op: bool = False):
    """Receive from group rank ``src`` into ``tensor`` with a tag."""
    work = dist.irecv(tensor, src=group.global_rank(src), group=group.pg, tag=tag)
    return _finish(work, group, category, async_op, op="recv", peer=src)


def batch_p2p(sends: list[tuple[torch.Tensor, int, int]],
              recvs: list[tuple[torch.Tensor, int, int]], group: Group,
              category: str = "p2p", wait_sends: bool = True) -> list[Handle]:
    """Post several sends and receives together: ``(tensor, group_rank, tag)`` each.

    Posting them at once (rather than one blocking call after another) is what
    lets two neighbours exchange in both directions without deadlock. Returns
    after the receives complete; with ``wait_sends=False`` the sends may still be
    in flight: one ``Handle`` per send, in order (each keeps its tensor alive
    until waited for), or none where the backend completed the whole batch as one.
    """
    ops, keep = [], []
    for tensor, dst, tag in sends:
        group.counters.record(category, _nbytes(tensor))
        keep.append(tensor.contiguous())
        ops.append(dist.P2POp(dist.isend, keep[-1], group.global_rank(dst),
                              group=group.pg, tag=tag))
    for tensor, src, tag in recvs:
        ops.append(dist.P2POp(dist.irecv, tensor, group.global_rank(src),
                              group=group.pg, tag=tag))
    works = list(dist.batch_isend_irecv(ops)) if ops else []
    ops = None  # the P2POps hold the tensors too
    peers = sorted({group.global_rank(peer) for _, peer, _ in sends + recvs})
    what = f"point-to-point batch on group {group.name} (peers {peers})"
    if len(works) != len(sends) + len(recvs):  # one coalesced work for the whole batch (NCCL)
        Handle(works, group.counters, category, what=what).wait()
        return []
    Handle(works[len(sends):], group.counters, category, what=what).wait()
    send_handles = [Handle(work, group.counters, category, keep=tensor, what=what)
                    for work, tensor in zip(works[:len(sends)], keep)]
    del works, keep
    if wait_sends:
        for handle in send_handles:
            handle.wait()
        return []
    return send_handles


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ------------------------------------------------- gradient-sync extensions
def with_counters(group: Group, counters: CommCounters) -> Group:
    """The same process group, feeding other counters (e.g. one reducer's own, so that
    what it sent is known exactly even while other code records on the shared ones)."""
    twin = copy.copy(group)
    twin.counters = counters
    return twin
