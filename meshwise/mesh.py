"""Rank topology: ``world_size`` ranks as dp x pp x cp x tp, tp fastest (Megatron-LM's
order; docs/layouts.md "Rank order"), one process group per axis and ``dp_cp`` for the
gradients (torchtitan's ``dp_shard_cp``). Only ``Mesh.build`` needs ``torch.distributed``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from itertools import product

AXES = ("dp", "pp", "cp", "tp")  # outermost first: the order of the rank formula


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four parallel axes; ``world_size`` is their product. ``ep``: expert
    parallelism, folded into dp x cp (not an axis of the world: ``ep_groups``);
    ``dp_shard``: the dp ranks ZeRO shards over (0: all of dp; ``shard_groups``)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int = 0

    def __post_init__(self):
        for axis in (*AXES, "ep"):
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{axis} must be a positive integer, got {size!r}")
        if (self.dp * self.cp) % self.ep:
            valid = [e for e in range(1, self.dp * self.cp + 1) if self.dp * self.cp % e == 0]
            raise ValueError(
                f"--ep {self.ep} does not divide dp x cp = {self.dp * self.cp} (expert "
                f"parallelism borrows the dp x cp ranks); valid: {', '.join(map(str, valid))}"
            )
        if self.dp_shard < 0 or self.dp % max(self.dp_shard, 1):
            valid = [n for n in range(1, self.dp + 1) if self.dp % n == 0]
            raise ValueError(
                f"--dp-shard {self.dp_shard} does not divide dp = {self.dp} (dp is replicas x "
                f"dp-shard); valid: {', '.join(map(str, valid))}"
            )

    @property
    def shard_size(self) -> int:
        """The dp ranks of one replica (ZeRO's group, with the cp ranks)."""
        return self.dp_shard or self.dp

    @property
    def num_replicas(self) -> int:
        return self.dp // self.shard_size

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    def coords(self, rank: int) -> dict[str, int]:
        """The (dp, pp, cp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        coords = {}
        for axis in reversed(AXES):  # the fastest axis is the last digit
            size = getattr(self, axis)
            coords[axis] = rank % size
            rank //= size
        return {axis: coords[axis] for axis in AXES}

    def rank_of(self, dp: int, pp: int, cp: int, tp: int) -> int:
        """The global rank at these coordinates (the formula above, its axes in order)."""
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``axis`` (each sorted)."""
        return self.axes_groups((axis,))

    def axes_groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only along ``axes`` (each sorted by rank,
        so ``("dp", "cp")`` lists dp-major: the order of a flat buffer's shards)."""
        for axis in axes:
            if axis not in AXES:
                raise ValueError(f"unknown axis {axis!r}; valid: {', '.join(AXES)}")
        sizes = self.sizes()
        others = [a for a in AXES if a not in axes]
        groups = []
        for fixed in product(*(range(sizes[a]) for a in others)):
            coord = dict(zip(others, fixed))
            ranks = []
            for free in product(*(range(sizes[a]) for a in axes)):
                coord.update(zip(axes, free))
                ranks.append(self.rank_of(coord["dp"], coord["pp"], coord["cp"], coord["tp"]))
            groups.append(sorted(ranks))
        return groups

    def ep_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """The expert-parallel groups and the expert-data-parallel groups: each run of
        ``ep`` consecutive members of a dp x cp group (sorted by rank) is an ep group;
        the members at the same place of every run form an expert-data-parallel group,
        over which expert gradients are reduced (torchtitan's and Megatron-LM's folding)."""
        return self._dp_cp_runs(self.ep)

    def shard_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """Hybrid sharding's groups: each run of ``dp_shard`` consecutive dp coordinates
        (with every cp rank) of a dp x cp group is a replica, the group ZeRO shards over;
        the members at the same place of every replica form a replicate group, over which
        the shards' gradients are all-reduced (torchtitan's ``dp_replicate x dp_shard``).
        cp stays inside the shard group: dp-shard splits dp only."""
        return self._dp_cp_runs(self.shard_size * self.cp)  # dp-major: a replica is a run

    def expert_shard_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """Hybrid sharding of the experts: the members of an expert-data-parallel group
        inside one replica shard its experts, those at the same place of every replica
        replicate them (ep divides a replica's dp x cp ranks: ``replica_holds_ep``)."""
        per_replica = self.shard_size * self.cp // self.ep
        return _runs_and_columns(self.ep_groups()[1], per_replica)

    @property
    def replica_holds_ep(self) -> bool:
        """Whether each replica holds whole ep groups (every expert, as dp x cp does)."""
        return (self.shard_size * self.cp) % self.ep == 0

    def _dp_cp_runs(self, length: int) -> tuple[list[list[int]], list[list[int]]]:
        """Each run of ``length`` consecutive members of every dp x cp group (sorted by
        rank), and the columns: the members at the same place of every run."""
        return _runs_and_columns(self.axes_groups(("dp", "cp")), length)


def _runs_and_columns(groups, length: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each run of ``length`` consecutive members of every group (sorted by rank), and
    the columns: the members at the same place of every run of a group."""
    runs, columns = [], []
    for ranks in groups:
        these = [ranks[i : i + length] for i in range(0, len(ranks), length)]
        runs += these
        columns += [list(column) for column in zip(*these)]
    return runs, sorted(columns)


class Mesh:
    """This rank's place in the layout and one process group per axis.

    ``dims.tp`` is an axis's size, ``tp_group`` its group, ``tp_rank`` this rank's
    coordinate. ``cp_group`` is None when cp is 1; ``dp_cp_group`` is ``dp_group`` when cp is
    1 and ``cp_group`` when dp is 1; ``tie_group`` pairs the first and last pipeline stage of
    this (dp, cp, tp) position (None when pp is 1). ``ep_group`` holds this rank's experts'
    peers (None when ep is 1) and ``edp_group`` the ranks holding the same experts
    (``dp_cp_group`` when ep is 1; ``ParallelDims.ep_groups``). ``shard_group``: the ranks
    ZeRO shards over (``dp_cp_group`` unless ``--dp-shard``), ``replicate_group``: the ranks
    holding the same shard in the other replicas (None: one replica;
    ``ParallelDims.shard_groups``); ``expert_shard_group`` and ``expert_replicate_group``
    split ``edp_group`` so (``ParallelDims.expert_shard_groups``). Build it after
    ``torch.distributed`` is initialised (``Mesh.build(dims)``) and pass it explicitly.
    """

    def __init__(
        self,
        dims: ParallelDims,
        rank: int,
        world_group,
        dp_group,
        pp_group,
        tp_group,
        tie_group=None,
        cp_group=None,
        dp_cp_group=None,
        ep_group=None,
        edp_group=None,
        shard_group=None,
        replicate_group=None,
        expert_shard_group=None,
        expert_replicate_group=None,
    ):
        self.dims = dims
        self.rank = rank
        self.world_group = world_group
        self.dp_group, self.pp_group, self.tp_group = dp_group, pp_group, tp_group
        self.cp_group = cp_group
        self.dp_cp_group = dp_cp_group if dp_cp_group is not None else dp_group
        self.tie_group = tie_group
        self.ep_group = ep_group
        self.edp_group = edp_group if edp_group is not None else self.dp_cp_group
        self.shard_group = shard_group if shard_group is not None else self.dp_cp_group
        self.replicate_group = replicate_group
        self.expert_shard_group = (
            expert_shard_group if expert_shard_group is not None else self.edp_group
        )
        self.expert_replicate_group = expert_replicate_group
        coords = dims.coords(rank)
        self.dp_rank, self.pp_rank, self.tp_rank = coords["dp"], coords["pp"], coords["tp"]
        self.cp_rank = coords["cp"]

    @classmethod
    def build(cls, dims: ParallelDims, timeout_s: float | None = None, device=None) -> "Mesh":
        """Create the groups; ``timeout_s`` bounds every wait on them (``None``:
        torch.distributed's default, 30 minutes for gloo); ``device``: where the
        tensors handed to them live (default: the backend's, CPU for gloo)."""
        from meshwise.comm import ops

        world = ops.world_group(timeout_s=timeout_s, device=device)
        if world.size != dims.world_size:
            raise ValueError(
                f"world size {world.size} does not match dp*cp*tp*pp = "
                f"{dims.dp}*{dims.cp}*{dims.tp}*{dims.pp} = {dims.world_size}"
            )

        def mine(name: str, groups: list[list[int]]):
            found = None
            for ranks in groups:  # every rank must create every group, in the same order
                group = ops.new_group(ranks, name, world.counters, timeout_s, device)
                found = group or found
            return found

        # No cp groups without context parallelism: the start-up and the groups of
        # a dp x pp x tp run stay what they were.
        axes = [axis for axis in AXES if axis != "cp" or dims.cp > 1]
        groups = {axis: mine(axis, dims.axis_groups(axis)) for axis in axes}
        dp_cp = None
        if dims.dp > 1 and dims.cp > 1:
            dp_cp = mine("dp_cp", dims.axes_groups(("dp", "cp")))
        elif dims.cp > 1:
            dp_cp = groups["cp"]
        embed = None
        if dims.pp > 1:
            embed = mine("embed", [[ranks[0], ranks[-1]] for ranks in dims.axis_groups("pp")])
        ep = edp = None
        if dims.ep > 1:
            ep_groups, edp_groups = dims.ep_groups()
            ep, edp = mine("ep", ep_groups), mine("edp", edp_groups)
        shard = replicate = None
        if dims.num_replicas > 1:
            shard_groups, replicate_groups = dims.shard_groups()
            shard, replicate = mine("shard", shard_groups), mine("replicate", replicate_groups)
        expert_shard = expert_replicate = None
        if dims.ep > 1 and dims.num_replicas > 1:
            shard_groups, replicate_groups = dims.expert_shard_groups()
            expert_shard = mine("expert_shard", shard_groups)
            expert_replicate = mine("expert_replicate", replicate_groups)
        return cls(
            dims,
            world.rank,
            world,
            groups["dp"],
            groups["pp"],
            groups["tp"],
            embed,
            cp_group=groups.get("cp"),
            dp_cp_group=dp_cp,
            ep_group=ep,
            edp_group=edp,
            shard_group=shard,
            replicate_group=replicate,
            expert_shard_group=expert_shard,
            expert_replicate_group=expert_replicate,
        )

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the pipeline stage ``pp_rank`` in this rank's pp group."""
        return self.dims.rank_of(self.dp_rank, pp_rank, self.cp_rank, self.tp_rank)

    # The groups' names before they said what they are: kept for code written then.
    dp = property(lambda self: _renamed(self, "dp", "dp_group"))
    pp = property(lambda self: _renamed(self, "pp", "pp_group"))
    tp = property(lambda self: _renamed(self, "tp", "tp_group"))
    cp = property(lambda self: _renamed(self, "cp", "cp_group"))
    dp_cp = property(lambda self: _renamed(self, "dp_cp", "dp_cp_group"))
    world = property(lambda self: _renamed(self, "world", "world_group"))
    embed = property(lambda self: _renamed(self, "embed", "tie_group"))

    def __repr__(self) -> str:
        return (
            f"Mesh(rank={self.rank}, dp={self.dp_rank}/{self.dims.dp}, "
            f"pp={self.pp_rank}/{self.dims.pp}, cp={self.cp_rank}/{self.dims.cp}, "
            f"tp={self.tp_rank}/{self.dims.tp})"
        )


def _renamed(mesh: Mesh, old: str, new: str):
    warnings.warn(
        f"Mesh.{old} is now Mesh.{new} (ParallelDims.{old} is the axis's size)",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(mesh, new)
