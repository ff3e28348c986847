"""Tagged point-to-point transfers through ``meshwise.comm.ops``: a send, a receive, and a
batch of both posted together (``batch_isend_irecv``), as NCCL needs between neighbours.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshwise.comm.groups import Group, _finish, _nbytes, context
from meshwise.comm.handle import Handle


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
    works, keep, send_entries, recv_entries = _post_batch(sends, recvs, group, category)
    peers = sorted({group.global_rank(peer) for _, peer, _ in sends + recvs})
    what = f"point-to-point batch on group {group.name} (peers {peers})"
    ctx = context()

    def handle(batch_works, entries, kept=None) -> Handle:
        return Handle(
            batch_works,
            group.counters,
            category,
            keep=kept,
            what=what,
            entries=entries,
            context=ctx,
            device=group.device,
        )

    if len(works) != len(sends) + len(recvs):  # one coalesced work for the whole batch (NCCL)
        whole = handle(works, send_entries + recv_entries, keep)
        if recv_handles is not None and recvs:
            recv_handles += [whole] * len(recvs)
        else:
            whole.wait()
        return []
    if recv_handles is None:
        handle(works[len(sends) :], recv_entries).wait()
    else:
        recv_handles += [
            handle(work, [entry]) for work, entry in zip(works[len(sends) :], recv_entries)
        ]
    send_handles = [
        handle(work, [entry], tensor)
        for work, tensor, entry in zip(works[: len(sends)], keep, send_entries)
    ]
    del works, keep
    if wait_sends:
        for send_handle in send_handles:
            send_handle.wait()
        return []
    return send_handles


def _post_batch(sends, recvs, group: Group, category: str):
    """Enter and count each transfer, then post them all in one ``batch_isend_irecv``:
    the works, the contiguous tensors sent, and the ledger entries of sends and receives."""
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
    return works, keep, send_entries, recv_entries
