"""All-reduce algorithms built from point-to-point transfers, and a cost model to pick one.

Every transfer goes through ``meshwise.comm.ops`` (``batch_p2p``), so bytes and
waits are counted there like any collective's. Sums are taken in the tensor's
own dtype, for any group size (odd ones included) and any number of elements
(chunks may be uneven or empty).

- ring (Patarasuk & Yuan 2009): reduce-scatter then all-gather around a ring,
  ``2 (p-1)`` steps of ``N/p`` bytes: bandwidth-optimal.
- tree: binomial-tree reduce to the first rank, then binomial broadcast,
  ``2 ceil(log2 p)`` steps of ``N`` bytes: latency-optimal (Thakur et al. 2005).
- hierarchical (Horovod's / NCCL's two-level scheme, leader variant): a tree
  reduce inside each node to its leader (its first rank), a ring all-reduce
  among the leaders, a tree broadcast inside each node; only ``N``-sized
  messages per leader cross the slow links, once each way.
- adaptive: per message size, the algorithm with the lowest time under an
  alpha-beta model (Hockney 1994: ``t = alpha + n beta`` per message) whose
  alpha and beta per link kind (inside a node, between nodes), and those of the
  native collective, are measured by ``probe`` at start-up.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from meshwise.comm import ops

log = logging.getLogger("meshwise")

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
def _exchange(group, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
              category: str) -> None:
    """Send to ``dst`` and receive from ``src`` at once (empty tensors skipped on both sides).

    Separate ``isend``/``irecv`` rather than ``batch_p2p``: gloo runs a batch's transfers
    one after the other, which halves an exchange's speed on a full-duplex link (4 MiB
    each way over 200 Mbit/s: 280-350 ms batched, 180 ms separate, 125 ms one way).
    """
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


def ring_reduce_scatter(chunks: list[torch.Tensor], group, members=None,
                        category: str = "grad") -> None:
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
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype,
                          device=chunks[0].device)
    for s in range(p - 1):
        out, into = chunks[(me - s - 1) % p], chunks[(me - s - 2) % p]
        tmp = scratch[:into.numel()]
        _exchange(group, out, right, tmp, left, category)
        into.add_(tmp.view_as(into))


def ring_all_gather(chunks: list[torch.Tensor], group, members=None,
                    category: str = "grad") -> None:
    """Every member ends with every chunk; member ``i`` starts with ``chunks[i]`` complete."""
    members, me = _me(group, members)
    p = len(members)
    right, left = members[(me + 1) % p], members[(me - 1) % p]
    for s in range(p - 1):
        _exchange(group, chunks[(me - s) % p], right, chunks[(me - s - 1) % p], left, category)


def ring_all_reduce(flat: torch.Tensor, group, members=None, category: str = "grad") -> None:
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
    tree_reduce(flat, group, members, category)
    tree_broadcast(flat, group, members, category)


def hierarchical_all_reduce(flat: torch.Tensor, group, topology: Topology,
                            category: str = "grad") -> None:
    """Reduce inside the node, ring all-reduce across node leaders, broadcast inside."""
    node = next(m for m in topology.node_members if group.rank in m)
    tree_reduce(flat, group, node, category)
    if group.rank == node[0] and topology.num_nodes > 1:
        ring_all_reduce(flat, group, topology.leaders, category)
    tree_broadcast(flat, group, node, category)


def all_to_all(sends: list[torch.Tensor], recvs: list[torch.Tensor], group,
               category: str = "grad") -> None:
    """``sends[j]`` goes to rank ``j``, ``recvs[i]`` comes from rank ``i`` (own: copied).

    ``p - 1`` rounds; in round ``s`` each rank sends to ``rank + s`` and receives
    from ``rank - s``, so every round is a permutation and nothing queues.
    """
    p, me = group.size, group.rank
    recvs[me].copy_(sends[me])
    for s in range(1, p):
        _exchange(group, sends[(me + s) % p], (me + s) % p, recvs[(me - s) % p], (me - s) % p,
                  category)


# ---------------------------------------------------------------- cost model
@dataclass
class LinkCost:
    """Hockney's model of one message: ``alpha_s + nbytes * beta_s_per_byte``."""

    alpha_s: float
    beta_s_per_byte: float

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte

    @classmethod
    def fit(cls, small: tuple[int, float], large: tuple[int, float]) -> "LinkCost":
        (n0, t0), (n1, t1) = small, large
        beta = max((t1 - t0) / max(n1 - n0, 1), 1e-13)
        return cls(max(t0 - n0 * beta, 1e-7), beta)


@dataclass
class CostModel:
    """Alpha-beta costs per link kind ("intra", "inter") and of the native all-reduce."""

    links: dict[str, LinkCost] = field(default_factory=dict)
    native: LinkCost | None = None

    def _worst(self, topology: Topology) -> LinkCost:
        kind = "inter" if topology.num_nodes > 1 else "intra"
        return self.links.get(kind) or next(iter(self.links.values()))

    def estimate(self, algorithm: str, nbytes: float, topology: Topology) -> float:
        p = len(topology.nodes)
        if algorithm == "native":
            return self.native.time(nbytes) if self.native else math.inf
        if algorithm == "ring":
            return 2 * (p - 1) * self._worst(topology).time(nbytes / p)
        if algorithm == "tree":
            return 2 * math.ceil(math.log2(p)) * self._worst(topology).time(nbytes)
        if algorithm == "hierarchical":
            if not topology.is_hierarchical():
                return math.inf
            m, local = topology.num_nodes, topology.max_per_node
            intra = self.links.get("intra") or self._worst(topology)
            inter = self.links.get("inter") or self._worst(topology)
            return (2 * math.ceil(math.log2(local)) * intra.time(nbytes)
                    + 2 * (m - 1) * inter.time(nbytes / m))
        raise ValueError(f"no cost for algorithm {algorithm!r}")

    def choose(self, nbytes: float, topology: Topology) -> str:
        candidates = ("native", "ring", "tree", "hierarchical")
        return min(candidates, key=lambda a: self.estimate(a, nbytes, topology))

    def describe(self) -> str:
        parts = [f"{kind}: alpha {c.alpha_s * 1e6:.1f} us, {1 / c.beta_s_per_byte / 1e9:.3f} GB/s"
                 for kind, c in self.links.items()]
        if self.native:
            parts.append(f"native all-reduce: {self.native.alpha_s * 1e6:.1f} us + "
                         f"{1 / self.native.beta_s_per_byte / 1e9:.3f} GB/s")
        return "; ".join(parts)


def _ping_pong(group, a: int, b: int, nbytes: int, repeats: int) -> float:
    """One-way time between group ranks ``a`` and ``b`` (the fastest of ``repeats``, the
    least disturbed by other processes; measured on ``a``, else 0)."""
    if group.rank not in (a, b):
        return 0.0
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up (connection set-up)
        start = time.perf_counter()
        if group.rank == a:
            _exchange(group, buf, b, None, 0, "probe")
            _exchange(group, None, 0, buf, b, "probe")
        else:
            _exchange(group, None, 0, buf, a, "probe")
            _exchange(group, buf, a, None, 0, "probe")
        times.append((time.perf_counter() - start) / 2)
    return min(times[1:]) if group.rank == a else 0.0


def _time_native(group, nbytes: int, repeats: int) -> float:
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    times = []
    for _ in range(repeats + 1):
        ops.barrier(group)
        start = time.perf_counter()
        ops.all_reduce(buf, group, category="probe")
        times.append(time.perf_counter() - start)
    return min(times[1:])


def probe(group, topology: Topology, small: int = 8, large: int = 2**20,
          repeats: int = 5) -> CostModel:
    """Measure alpha and beta of each link kind present, and of the native all-reduce.

    A collective: every rank of ``group`` calls it and all get the same model
    (each value is the maximum over ranks, so every rank picks alike).
    """
    pairs = {}
    for node in topology.node_members:
        if len(node) > 1:
            pairs["intra"] = (node[0], node[1])
            break
    if topology.num_nodes > 1:
        pairs["inter"] = tuple(topology.leaders[:2])
    values = []
    for a, b in pairs.values():
        values += [_ping_pong(group, a, b, small, repeats), _ping_pong(group, a, b, large, repeats)]
    values += [_time_native(group, small, repeats), _time_native(group, large, repeats)]
    agreed = torch.tensor(values, dtype=torch.float64)
    ops.all_reduce(agreed, group, op="max", category="probe")
    v = agreed.tolist()
    model = CostModel()
    for i, kind in enumerate(pairs):
        model.links[kind] = LinkCost.fit((small, v[2 * i]), (large, v[2 * i + 1]))
    model.native = LinkCost.fit((small, v[-2]), (large, v[-1]))
    if not model.links:  # a group of one rank
        model.links["intra"] = LinkCost(1e-6, 1e-10)
    return model


# ---------------------------------------------------------------- dispatcher
class AllReducer:
    """Runs all-reduce, reduce-scatter and all-gather with one algorithm on one group,
    counting calls and bytes per algorithm actually used (``stats``).

    ``topology`` is needed by hierarchical and adaptive; ``cost`` by adaptive (probed
    here when not given). Every call is synchronous and must be made by every rank
    of the group in the same order.
    """

    def __init__(self, group, algorithm: str = "native", topology: Topology | None = None,
                 cost: CostModel | None = None, category: str = "grad"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; valid: "
                             f"{', '.join(ALGORITHMS)}")
        self.group, self.algorithm, self.category = group, algorithm, category
        self.topology = topology or Topology(tuple(range(group.size)))
        if algorithm == "hierarchical":
            problem = hierarchical_problem(self.topology, group.ranks)
            if problem:
                raise ValueError(f"hierarchical all-reduce cannot serve this group: {problem}")
        self.cost = cost
        if algorithm == "adaptive" and cost is None:
            self.cost = probe(group, self.topology)
            if group.rank == 0:
                log.info("adaptive all-reduce on group %s: %s", group.name, self.cost.describe())
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, float] = {}

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def _pick(self, nbytes: int) -> str:
        if self.group.size == 1:
            return "native"
        if self.algorithm == "adaptive":
            return self.cost.choose(nbytes, self.topology)
        return self.algorithm

    def uncompressed_bytes(self, nbytes: int, scatter: bool = False) -> float:
        """What this rank sends, on average over the group, to all-reduce (or reduce-scatter)
        ``nbytes`` uncompressed: the reference of ``compress_ratio``. Every exact all-reduce
        here moves ``2 (p-1)`` buffers in total; a ring or NCCL reduce-scatter half that."""
        p = self.size
        name = self._pick(nbytes)
        halves = scatter and (name == "ring" or (name == "native"
                                                 and ops.backend(self.group) != "gloo"))
        return (p - 1) / p * nbytes * (1 if halves else 2)

    def _count(self, name: str, before: float) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.bytes[name] = (self.bytes.get(name, 0.0)
                            + self.group.counters.bytes_sent[self.category] - before)

    def _run_all_reduce(self, name: str, flat: torch.Tensor) -> None:
        if name == "native":
            ops.all_reduce(flat, self.group, category=self.category)
        elif name == "ring":
            ring_all_reduce(flat, self.group, category=self.category)
        elif name == "tree":
            tree_all_reduce(flat, self.group, category=self.category)
        else:
            hierarchical_all_reduce(flat, self.group, self.topology, category=self.category)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place sum over the group."""
        flat = tensor.view(-1)  # needs a contiguous tensor
        name = self._pick(flat.numel() * flat.element_size())
        before = self.group.counters.bytes_sent[self.category]
        self._run_all_reduce(name, flat)
        self._count(name, before)

    def reduce_scatter(self, flat: torch.Tensor) -> tuple[int, int]:
        """Sum over the group of ``p`` equal chunks of ``flat``; this rank's chunk gets
        the sum (the rest of ``flat`` is scratch). Returns that chunk's range."""
        p, rank = self.group.size, self.group.rank
        assert flat.numel() % p == 0, "reduce_scatter needs a multiple of the group size"
        size = flat.numel() // p
        name = self._pick(flat.numel() * flat.element_size())
        before = self.group.counters.bytes_sent[self.category]
        if name == "ring":
            ring_reduce_scatter(list(flat.split(size)), self.group, category=self.category)
        elif name == "native" and ops.backend(self.group) != "gloo":
            out = torch.empty(size, dtype=flat.dtype, device=flat.device)
            ops.reduce_scatter(out, flat, self.group, category=self.category)
            flat[rank * size:(rank + 1) * size].copy_(out)
        else:  # gloo's all-reduce beats its reduce-scatter; tree/hierarchical have none
            self._run_all_reduce(name, flat)
        self._count(name, before)
        return rank * size, (rank + 1) * size

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Concatenate every rank's ``inp`` (equal sizes) into ``out``, in rank order."""
        name = "native" if self._pick(out.numel() * out.element_size()) == "native" else "ring"
        before = self.group.counters.bytes_sent[self.category]
        if name == "native":
            ops.all_gather(out, inp, self.group, category=self.category)
        else:
            chunks = list(out.split(inp.numel()))
            chunks[self.group.rank].copy_(inp.view(-1))
            ring_all_gather(chunks, self.group, category=self.category)
        self._count(name, before)

    def all_to_all(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
        before = self.group.counters.bytes_sent[self.category]
        all_to_all(sends, recvs, self.group, category=self.category)
        self._count("p2p", before)
