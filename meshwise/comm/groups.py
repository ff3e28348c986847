"""Process groups for ``meshwise.comm.ops``: the ``Group`` a collective runs on, the
default group's start and end, this rank's ``CommContext`` (NCCL's rules, the ledger), and
an issued operation entered there and finished into a ``Handle``.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from meshwise.comm.checks.context import CommContext, default_device
from meshwise.comm.handle import CommCounters, Handle
from meshwise.device.choice import rank_device


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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def with_counters(group: Group, counters: CommCounters) -> Group:
    """The same process group, feeding other counters (e.g. one reducer's own, so that
    what it sent is known exactly even while other code records on the shared ones)."""
    twin = copy.copy(group)
    twin.counters = counters
    return twin
