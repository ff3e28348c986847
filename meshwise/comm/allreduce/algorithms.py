"""All-reduce algorithms from point-to-point transfers: ring (Patarasuk & Yuan 2009,
bandwidth-optimal), binomial tree (Thakur et al. 2005, latency-optimal) and hierarchical
(Horovod's and NCCL's two-level scheme); any group size and uneven chunks, summed in the
tensor's dtype. See docs/compression.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshwise.comm import ops, policy

ALGORITHMS = ("native", "ring", "tree", "hierarchical", "adaptive")
P2P_ALGORITHMS = ("ring", "tree", "hierarchical")
_TAG = 7


# ------------------------------------------------------------------ topology
@dataclass(frozen=True)
class Topology:
    """Which node each rank of a group is on (``nodes[group_rank]``)."""

    nodes: tuple[int, ...]

    @classmethod
    def of(cls, global_ranks, ranks_per_node: int) -> "Topology":
        """Nodes hold consecutive global ranks, as torchrun numbers them."""
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        return cls(tuple(r // ranks_per_node for r in global_ranks))

    @property
    def node_members(self) -> list[list[int]]:
        """Group ranks per node, nodes in order of first appearance."""
        members: dict[int, list[int]] = {}
        for group_rank, node in enumerate(self.nodes):
            members.setdefault(node, []).append(group_rank)
        return list(members.values())

    @property
    def leaders(self) -> list[int]:
        return [m[0] for m in self.node_members]

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    @property
    def max_per_node(self) -> int:
        return max(len(m) for m in self.node_members)

    def is_hierarchical(self) -> bool:
        """Two levels exist: more than one node, and some node with more than one rank."""
        return self.num_nodes > 1 and self.max_per_node > 1


def hierarchical_problem(topology: Topology, global_ranks) -> str | None:
    """Why ``hierarchical`` cannot serve this group, or None."""
    if topology.num_nodes == 1:
        return f"all ranks of the group {list(global_ranks)} are on one node"
    if topology.max_per_node == 1:
        return f"each rank of the group {list(global_ranks)} is alone on its node"
    return None


# ---------------------------------------------------------- p2p primitives
def _exchange(
    group, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int, category: str
) -> None:
    """Send to ``dst`` and receive from ``src`` at once (empty tensors skipped on both sides):
    one batch where the backend needs it, separate transfers where they are faster
    (``policy.transfers_in_batches``)."""
    if policy.transfers_in_batches(group):
        sends = [(send, dst, _TAG)] if send is not None and send.numel() else []
        recvs = [(recv, src, _TAG)] if recv is not None and recv.numel() else []
        if sends or recvs:
            ops.batch_p2p(sends, recvs, group, category=category)
        return
    handles = []
    if recv is not None and recv.numel():
        handles.append(ops.recv(recv, src, group, tag=_TAG, category=category, async_op=True))
    if send is not None and send.numel():
        handles.append(ops.send(send, dst, group, tag=_TAG, category=category, async_op=True))
    for handle in handles:
        handle.wait()


def _me(group, members) -> tuple[list[int], int]:
    members = list(range(group.size)) if members is None else list(members)
    return members, members.index(group.rank)


def ring_reduce_scatter(
    chunks: list[torch.Tensor], group, members=None, category: str = "grad"
) -> None:
    """Sum ``chunks[i]`` over ``members``; on return ``chunks[my index]`` holds the sum.

    ``chunks``: one contiguous tensor per member, in member order (sizes may
    differ). At step ``s`` a rank sends the chunk it has accumulated so far to
    its right neighbour and adds the one from its left; the shift by one makes
    member ``i`` finish with chunk ``i``.
    """
    members, me = _me(group, members)
    p = len(members)
    if p == 1:
        return
    right, left = members[(me + 1) % p], members[(me - 1) % p]
    scratch = torch.empty(
        max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device
    )
    for s in range(p - 1):
        out, into = chunks[(me - s - 1) % p], chunks[(me - s - 2) % p]
        tmp = scratch[: into.numel()]
        _exchange(group, out, right, tmp, left, category)
        into.add_(tmp.view_as(into))


def ring_all_gather(
    chunks: list[torch.Tensor], group, members=None, category: str = "grad"
) -> None:
    """Every member ends with every chunk; member ``i`` starts with ``chunks[i]`` complete."""
    members, me = _me(group, members)
    p = len(members)
    right, left = members[(me + 1) % p], members[(me - 1) % p]
    for s in range(p - 1):
        _exchange(group, chunks[(me - s) % p], right, chunks[(me - s - 1) % p], left, category)


def ring_all_reduce(flat: torch.Tensor, group, members=None, category: str = "grad") -> None:
    # reduce-scatter then all-gather: 2 (p-1) steps of N/p bytes
    members, _ = _me(group, members)
    chunks = list(torch.tensor_split(flat, len(members)))
    ring_reduce_scatter(chunks, group, members, category)
    ring_all_gather(chunks, group, members, category)


def tree_reduce(flat: torch.Tensor, group, members=None, category: str = "grad") -> None:
    """Binomial-tree sum onto ``members[0]`` (the others' ``flat`` become partial sums)."""
    members, me = _me(group, members)
    p, mask = len(members), 1
    tmp = None
    while mask < p:
        if me & mask:
            _exchange(group, flat, members[me - mask], None, 0, category)
            return
        if me + mask < p:
            tmp = torch.empty_like(flat) if tmp is None else tmp
            _exchange(group, None, 0, tmp, members[me + mask], category)
            flat.add_(tmp)
        mask <<= 1


def tree_broadcast(flat: torch.Tensor, group, members=None, category: str = "grad") -> None:
    """Binomial-tree broadcast of ``members[0]``'s ``flat`` to the other members."""
    members, me = _me(group, members)
    p = len(members)
    mask = 1 << max(0, math.ceil(math.log2(p)) - 1) if p > 1 else 0
    while mask:
        if me % (2 * mask) == 0 and me + mask < p:
            _exchange(group, flat, members[me + mask], None, 0, category)
        elif me % (2 * mask) == mask:
            _exchange(group, None, 0, flat, members[me - mask], category)
        mask >>= 1


def tree_all_reduce(flat: torch.Tensor, group, members=None, category: str = "grad") -> None:
    # binomial reduce to the first member, then broadcast: 2 ceil(log2 p) steps of N bytes
    tree_reduce(flat, group, members, category)
    tree_broadcast(flat, group, members, category)


def hierarchical_all_reduce(
    flat: torch.Tensor, group, topology: Topology, category: str = "grad"
) -> None:
    """Reduce inside the node, ring all-reduce across node leaders, broadcast inside."""
    # A node's leader is its first rank; only N-sized messages per leader cross the slow
    # links, once each way.
    node = next(m for m in topology.node_members if group.rank in m)
    tree_reduce(flat, group, node, category)
    if group.rank == node[0] and topology.num_nodes > 1:
        ring_all_reduce(flat, group, topology.leaders, category)
    tree_broadcast(flat, group, node, category)


def all_to_all(
    sends: list[torch.Tensor], recvs: list[torch.Tensor], group, category: str = "grad"
) -> None:
    """``sends[j]`` goes to rank ``j``, ``recvs[i]`` comes from rank ``i`` (own: copied).

    ``p - 1`` rounds; in round ``s`` each rank sends to ``rank + s`` and receives
    from ``rank - s``, so every round is a permutation and nothing queues.
    """
    p, me = group.size, group.rank
    recvs[me].copy_(sends[me])
    for s in range(1, p):
        _exchange(
            group, sends[(me + s) % p], (me + s) % p, recvs[(me - s) % p], (me - s) % p, category
        )
