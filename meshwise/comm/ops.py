"""The one module that calls ``torch.distributed``: each operation is entered in this rank's
``CommContext`` (NCCL's rules, the ledger), issued, and counted per category in its
``Group``'s counters; its ``Handle`` marks it complete once waited for.
"""

from __future__ import annotations

import copy
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from meshwise.comm.checks.context import CommContext, default_device

# Re-exported: handles and timeouts are part of the collectives' interface.
from meshwise.comm.handle import CollectiveTimeout, CommCounters, Handle, is_timeout, timeout_error  # noqa: F401
from meshwise.device.choice import rank_device

# torch >= 2.13 renames the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Group:
    """A process group, this rank's index in it, the counters it feeds, and the
    device its tensors live on (declared by whoever builds it, e.g. the mesh)."""

    def __init__(
        self,
        pg,
        ranks: list[int],
        name: str,
        counters: CommCounters,
        timeout_s: float | None = None,
        device=None,
    ):
        self.pg = pg
        self.ranks = list(ranks)
        self.name = name
        self.counters = counters
        self.timeout_s = timeout_s  # None: torch.distributed's default
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        self.channel = f"{name}[{','.join(map(str, self.ranks))}]"  # its name in the ledger
        if device is None:
            device = default_device(str(dist.get_backend(pg)) if self.size > 1 else "local")
        self.device = torch.device(device)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __deepcopy__(self, memo):
        # A process group is a handle to shared state, never copied with a model.
        return self

    def __repr__(self) -> str:
        return f"Group({self.name}, rank {self.rank} of {self.ranks})"


def _describe(group: "Group", op: str, peer: int | None = None) -> str:
    who = f"peer rank {group.global_rank(peer)}" if peer is not None else f"ranks {group.ranks}"
    limit = f" after {group.timeout_s:g}s" if group.timeout_s else ""
    return f"{op} on group {group.name} ({who}){limit}"


# NCCL's own watchdog aborts the process when a collective outlives the group's
# timeout; ours (``meshwise.comm.checks.watchdog``) reports it first, naming who is behind,
# so NCCL's is set this much later.
NCCL_TIMEOUT_MARGIN_S = 60.0


def _pg_timeout(timeout_s: float, backend_name: str) -> timedelta:
    margin = NCCL_TIMEOUT_MARGIN_S if backend_name == "nccl" else 0.0
    return timedelta(seconds=timeout_s + margin)


def init_process_group(backend: str, timeout_s: float, store_hosted: bool = False) -> None:
    """Initialise from the ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` env.

    ``store_hosted``: the key-value store at that address is hosted by the launcher (else
    rank 0 hosts it, or torchrun's agent where torchrun says so), so that a rank that is
    stopped or gone never takes the store its peers wait on with it."""
    device_id = rank_device("cuda") if backend == "nccl" else None
    timeout = _pg_timeout(timeout_s, backend)
    if not store_hosted:
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
        return
    dist.init_process_group(
        backend=backend,
        timeout=timeout,
        device_id=device_id,
        store=open_store(timeout_s),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def destroy_process_group() -> None:
    context = _CONTEXT.pop("current", None)
    if context is not None:
        context.close()
    if dist.is_initialized():
        dist.destroy_process_group()


# One per initialised default process group: the rank's ledger and NCCL-rule state
# belong to the process, as its loggers do.
_CONTEXT: dict[str, CommContext] = {}


def context() -> CommContext:
    """This rank's ``CommContext`` (created on first use after initialisation)."""
    world = dist.group.WORLD
    current = _CONTEXT.get("current")
    if current is None or current.world_id != id(world):
        current = CommContext(
            dist.get_rank(), dist.get_world_size(), open_store, world_id=id(world)
        )
        _CONTEXT["current"] = current
    return current


def open_store(timeout_s: float):
    """A client of the store the launch rendezvoused on, each call bounded by ``timeout_s``
    (None where the environment does not say where it is)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (host and port):
        return None
    return dist.TCPStore(
        host,
        int(port),
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


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


def world_group(
    counters: CommCounters | None = None, timeout_s: float | None = None, device=None
) -> Group:
    """The whole world; ``timeout_s`` is the one it was initialised with, for messages."""
    return Group(
        dist.group.WORLD,
        list(range(dist.get_world_size())),
        "world",
        counters or CommCounters(),
        timeout_s,
        device,
    )


def new_group(
    ranks: list[int], name: str, counters: CommCounters, timeout_s: float | None = None, device=None
) -> Group | None:
    """Create a subgroup. Every rank must call this for every group, in order;
    ranks outside ``ranks`` get ``None``. ``timeout_s``: how long its operations
    may wait (subgroups do not inherit the world's; ``None``: torch's default)."""
    timeout = _pg_timeout(timeout_s, dist.get_backend()) if timeout_s else None
    pg = dist.new_group(ranks=list(ranks), timeout=timeout)
    if dist.get_rank() not in ranks:
        return None
    return Group(pg, ranks, name, counters, timeout_s, device)


def _begin(group: Group, op: str, tensors, reduce_op: str | None = None):
    """Check the operation against NCCL's rules and enter it in the ledger."""
    return context().begin(group, op, tensors, reduce_op)


def _finish(
    work,
    group: Group,
    category: str,
    async_op: bool,
    entry,
    on_done=None,
    keep=None,
    op: str = "collective",
    peer: int | None = None,
):
    handle = Handle(
        work,
        group.counters,
        category,
        on_done,
        keep,
        _describe(group, op, peer),
        [entry],
        context(),
        group.device,
    )
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


def _pair_channel(group: Group, src: int, dst: int) -> str:
    """The ledger channel of transfers from group rank ``src`` to ``dst``."""
    return f"{group.channel} {group.global_rank(src)}->{group.global_rank(dst)}"


def _begin_transfer(group: Group, op: str, tensor: torch.Tensor, peer: int, tag: int):
    src, dst = (group.rank, peer) if op == "send" else (peer, group.rank)
    return context().begin(
        group, op, [tensor], peer=peer, channel=_pair_channel(group, src, dst), tag=tag
    )


def send(
    tensor: torch.Tensor,
    dst: int,
    group: Group,
    tag: int = 0,
    category: str = "p2p",
    async_op: bool = False,
):
    """Send to group rank ``dst`` with a tag (outside a batch: see ``batch_p2p``)."""
    tensor = tensor.contiguous()
    entry = _begin_transfer(group, "send", tensor, dst, tag)
    group.counters.record(category, _nbytes(tensor))
    work = dist.isend(tensor, dst=group.global_rank(dst), group=group.pg, tag=tag)
    context().unbatched(group, dst, [work], "send")
    return _finish(work, group, category, async_op, entry, keep=tensor, op="send", peer=dst)


def recv(
    tensor: torch.Tensor,
    src: int,
    group: Group,
    tag: int = 0,
    category: str = "p2p",
    async_op: bool = False,
):
    """Receive from group rank ``src`` into ``tensor`` with a tag (outside a batch)."""
    entry = _begin_transfer(group, "recv", tensor, src, tag)
    work = dist.irecv(tensor, src=group.global_rank(src), group=group.pg, tag=tag)
    context().unbatched(group, src, [work], "recv")
    return _finish(work, group, category, async_op, entry, op="recv", peer=src)


def batch_p2p(
    sends: list[tuple[torch.Tensor, int, int]],
    recvs: list[tuple[torch.Tensor, int, int]],
    group: Group,
    category: str = "p2p",
    wait_sends: bool = True,
    recv_handles: list | None = None,
) -> list[Handle]:
    """Post several sends and receives together: ``(tensor, group_rank, tag)`` each.

    Posted at once (``batch_isend_irecv``), two neighbours exchange without deadlock, as
    NCCL needs. Returns after the receives complete; with ``wait_sends=False``, one
    ``Handle`` per send in order, each keeping its tensor alive until waited for (none where
    the backend made the batch one work). With ``recv_handles`` (a list) a ``Handle`` per
    receive is appended instead of waiting, to wait for before reading (one shared work on
    NCCL: wait for it once, ``if not handle.done``).
    """
    ops, keep, send_entries, recv_entries = [], [], [], []
    for tensor, dst, tag in sends:
        keep.append(tensor.contiguous())
        send_entries.append(_begin_transfer(group, "send", keep[-1], dst, tag))
        group.counters.record(category, _nbytes(tensor))
        ops.append(
            dist.P2POp(dist.isend, keep[-1], group.global_rank(dst), group=group.pg, tag=tag)
        )
    for tensor, src, tag in recvs:
        recv_entries.append(_begin_transfer(group, "recv", tensor, src, tag))
        ops.append(dist.P2POp(dist.irecv, tensor, group.global_rank(src), group=group.pg, tag=tag))
    works = list(dist.batch_isend_irecv(ops)) if ops else []
    del ops  # the P2POps hold the tensors too
    peers = sorted({group.global_rank(peer) for _, peer, _ in sends + recvs})
    what = f"point-to-point batch on group {group.name} (peers {peers})"
    ctx = context()
    if len(works) != len(sends) + len(recvs):  # one coalesced work for the whole batch (NCCL)
        whole = Handle(
            works,
            group.counters,
            category,
            keep=keep,
            what=what,
            entries=send_entries + recv_entries,
            context=ctx,
            device=group.device,
        )
        if recv_handles is not None and recvs:
            recv_handles += [whole] * len(recvs)
        else:
            whole.wait()
        return []
    if recv_handles is None:
        Handle(
            works[len(sends) :],
            group.counters,
            category,
            what=what,
            entries=recv_entries,
            context=ctx,
            device=group.device,
        ).wait()
    else:
        recv_handles += [
            Handle(
                work,
                group.counters,
                category,
                what=what,
                entries=[entry],
                context=ctx,
                device=group.device,
            )
            for work, entry in zip(works[len(sends) :], recv_entries)
        ]
    send_handles = [
        Handle(
            work,
            group.counters,
            category,
            keep=tensor,
            what=what,
            entries=[entry],
            context=ctx,
            device=group.device,
        )
        for work, tensor, entry in zip(works[: len(sends)], keep, send_entries)
    ]
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
