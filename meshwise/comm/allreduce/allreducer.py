"""``AllReducer``: one group's collectives with one algorithm, and the adaptive cost model.

adaptive picks per message size the cheapest algorithm under an alpha-beta model
(Hockney 1994: ``t = alpha + n beta``), alpha and beta per link kind and for the
native collective measured by ``probe`` at start-up.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from meshwise.comm import ops, policy
from meshwise.comm.allreduce.algorithms import (
    ALGORITHMS,
    Topology,
    _exchange,
    all_to_all,
    hierarchical_all_reduce,
    hierarchical_problem,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tree_all_reduce,
)
from meshwise.comm.timing import timed_runs

log = logging.getLogger("meshwise")


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
            return 2 * math.ceil(math.log2(local)) * intra.time(nbytes) + 2 * (m - 1) * inter.time(
                nbytes / m
            )
        raise ValueError(f"no cost for algorithm {algorithm!r}")

    def choose(self, nbytes: float, topology: Topology) -> str:
        candidates = ("native", "ring", "tree", "hierarchical")
        return min(candidates, key=lambda a: self.estimate(a, nbytes, topology))

    def describe(self) -> str:
        parts = [
            f"{kind}: alpha {c.alpha_s * 1e6:.1f} us, {1 / c.beta_s_per_byte / 1e9:.3f} GB/s"
            for kind, c in self.links.items()
        ]
        if self.native:
            parts.append(
                f"native all-reduce: {self.native.alpha_s * 1e6:.1f} us + "
                f"{1 / self.native.beta_s_per_byte / 1e9:.3f} GB/s"
            )
        return "; ".join(parts)


def _ping_pong(group, a: int, b: int, nbytes: int, repeats: int) -> float:
    """One-way time between group ranks ``a`` and ``b`` (the fastest of ``repeats``
    round trips, the least disturbed by other processes; measured on ``a``, else 0)."""
    if group.rank not in (a, b):
        return 0.0
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=group.device)
    other = b if group.rank == a else a

    def round_trip():
        if group.rank == a:
            _exchange(group, buf, other, None, 0, "probe")
            _exchange(group, None, 0, buf, other, "probe")
        else:
            _exchange(group, None, 0, buf, other, "probe")
            _exchange(group, buf, other, None, 0, "probe")

    times = timed_runs(round_trip, repeats, group.device)
    return min(times) / 2 if group.rank == a else 0.0


def _time_native(group, nbytes: int, repeats: int) -> float:
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=group.device)
    return min(
        timed_runs(
            lambda: ops.all_reduce(buf, group, category="probe"), repeats, group.device, group
        )
    )


def probe(
    group, topology: Topology, small: int = 8, large: int = 2**20, repeats: int = 5
) -> CostModel:
    """Measure alpha and beta of each link kind present, and of the native all-reduce.

    A collective: every rank of ``group`` calls it and all get the same model
    (each value is the maximum over ranks, so every rank picks alike).
    """
    pairs: dict[str, tuple[int, int]] = {}
    for node in topology.node_members:
        if len(node) > 1:
            pairs["intra"] = (node[0], node[1])
            break
    if topology.num_nodes > 1:
        pairs["inter"] = (topology.leaders[0], topology.leaders[1])
    values = []
    for a, b in pairs.values():
        values += [_ping_pong(group, a, b, small, repeats), _ping_pong(group, a, b, large, repeats)]
    values += [_time_native(group, small, repeats), _time_native(group, large, repeats)]
    agreed = torch.tensor(values, dtype=torch.float64, device=group.device)
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

    def __init__(
        self,
        group,
        algorithm: str = "native",
        topology: Topology | None = None,
        cost: CostModel | None = None,
        category: str = "grad",
    ):
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"unknown all-reduce algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}"
            )
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

    def pick(self, nbytes: int) -> str:
        if self.group.size == 1:
            return "native"
        if self.algorithm == "adaptive":
            assert self.cost is not None, "adaptive probes its cost model when built"
            return self.cost.choose(nbytes, self.topology)
        return self.algorithm

    def uncompressed_bytes(self, nbytes: int, scatter: bool = False) -> float:
        """What this rank sends, on average over the group, to all-reduce (or reduce-scatter)
        ``nbytes`` uncompressed: the reference of ``compress_ratio``. Every exact all-reduce
        here moves ``2 (p-1)`` buffers in total; a ring or NCCL reduce-scatter half that."""
        p = self.size
        name = self.pick(nbytes)
        halves = scatter and (
            name == "ring"
            or (name == "native" and not policy.reduce_scatter_by_all_reduce(self.group))
        )
        return (p - 1) / p * nbytes * (1 if halves else 2)

    def _count(self, name: str, before: float) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.bytes[name] = (
            self.bytes.get(name, 0.0) + self.group.counters.bytes_sent[self.category] - before
        )

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
        name = self.pick(flat.numel() * flat.element_size())
        before = self.group.counters.bytes_sent[self.category]
        self._run_all_reduce(name, flat)
        self._count(name, before)

    def reduce_scatter(self, flat: torch.Tensor) -> tuple[int, int]:
        """Sum over the group of ``p`` equal chunks of ``flat``; this rank's chunk gets
        the sum (the rest of ``flat`` is scratch). Returns that chunk's range."""
        p, rank = self.group.size, self.group.rank
        assert flat.numel() % p == 0, "reduce_scatter needs a multiple of the group size"
        size = flat.numel() // p
        name = self.pick(flat.numel() * flat.element_size())
        before = self.group.counters.bytes_sent[self.category]
        if name == "ring":
            ring_reduce_scatter(list(flat.split(size)), self.group, category=self.category)
        elif name == "native" and not policy.reduce_scatter_by_all_reduce(self.group):
            out = torch.empty(size, dtype=flat.dtype, device=flat.device)
            ops.reduce_scatter(out, flat, self.group, category=self.category)
            flat[rank * size : (rank + 1) * size].copy_(out)
        else:  # tree and hierarchical have no reduce-scatter of their own
            self._run_all_reduce(name, flat)
        self._count(name, before)
        return rank * size, (rank + 1) * size

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Concatenate every rank's ``inp`` (equal sizes) into ``out``, in rank order."""
        name = "native" if self.pick(out.numel() * out.element_size()) == "native" else "ring"
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
