"""Rank topology: how ``world_size`` ranks are laid out as dp x pp x tp.

Ranks are numbered with tp fastest, then pp, then dp, so tensor-parallel peers
(which talk the most) are neighbours, as in Megatron-LM:

    rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank

``ParallelDims`` and the rank arithmetic are pure; ``Mesh.build`` creates one
process group per axis through ``meshwise.comm.ops`` and is the only part that
needs a live ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the three parallel axes; ``world_size`` is their product."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{axis} must be a positive integer, got {size!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def coords(self, rank: int) -> dict[str, int]:
        """The (dp, pp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp_rank = rank % self.tp
        pp_rank = (rank // self.tp) % self.pp
        dp_rank = rank // (self.tp * self.pp)
        return {"dp": dp_rank, "pp": pp_rank, "tp": tp_rank}

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``axis`` (each sorted)."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; valid: {', '.join(AXES)}")
        others = [a for a in AXES if a != axis]
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        groups = []
        for fixed in product(*(range(sizes[a]) for a in others)):
            coord = dict(zip(others, fixed))
            ranks = []
            for i in range(sizes[axis]):
                coord[axis] = i
                ranks.append(self.rank_of(coord["dp"], coord["pp"], coord["tp"]))
            groups.append(ranks)
        return groups


class Mesh:
    """This rank's place in the layout and one process group per axis.

    Built with ``Mesh.build(dims)`` after ``torch.distributed`` is initialised
    (see ``meshwise.cli.launch``). Pass it explicitly to whatever needs a group.
    """

    def __init__(self, dims: ParallelDims, rank: int, world, dp, pp, tp, embed=None):
        self.dims = dims
        self.rank = rank
        self.world = world
        self.dp = dp
        self.pp = pp
        self.tp = tp
        # First and last pipeline stage of this (dp, tp) position, which both hold
        # the tied token embedding; None on other stages and when pp == 1.
        self.embed = embed
        coords = dims.coords(rank)
        self.dp_rank, self.pp_rank, self.tp_rank = coords["dp"], coords["pp"], coords["tp"]

    @classmethod
    def build(cls, dims: ParallelDims, timeout_s: float | None = None, device=None) -> "Mesh":
        """Create the groups; ``timeout_s`` bounds every wait on them (``None``:
        torch.distributed's default, 30 minutes for gloo); ``device``: where the
        tensors handed to them live (default: the backend's, CPU for gloo)."""
        from meshwise.comm import ops

        world = ops.world_group(timeout_s=timeout_s, device=device)
        if world.size != dims.world_size:
            raise ValueError(
                f"world size {world.size} does not match dp*tp*pp = "
                f"{dims.dp}*{dims.tp}*{dims.pp} = {dims.world_size}"
            )
        groups = {}
        for axis in AXES:
            # Every rank must create every group, in the same order.
            for ranks in dims.axis_groups(axis):
                group = ops.new_group(ranks, axis, world.counters, timeout_s, device)
                if world.rank in ranks:
                    groups[axis] = group
        embed = None
        if dims.pp > 1:
            for ranks in dims.axis_groups("pp"):
                group = ops.new_group([ranks[0], ranks[-1]], "embed", world.counters, timeout_s,
                                      device)
                embed = group or embed
        return cls(dims, world.rank, world, groups["dp"], groups["pp"], groups["tp"], embed)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the pipeline stage ``pp_rank`` in this rank's pp group."""
        return self.dims.rank_of(self.dp_rank, pp_rank, self.tp_rank)

    def __repr__(self) -> str:
        return (f"Mesh(rank={self.rank}, dp={self.dp_rank}/{self.dims.dp}, "
                f"pp={self.pp_rank}/{self.dims.pp}, tp={self.tp_rank}/{self.dims.tp})")
