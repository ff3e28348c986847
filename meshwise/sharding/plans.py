"""How parameters are packed into flat buffers and cut into dp shards (pure).

``BucketPlan`` packs parameters into flat buckets in reverse registration order,
because backward produces gradients roughly back to front (Li et al. 2020,
"PyTorch Distributed", section 3.2.3), so a bucket is complete, and its
reduction can start, while the rest of backward still runs.

``ShardPlan`` says which contiguous range of a flat buffer each data-parallel
rank owns: the buffer is padded up to a multiple of the number of shards and
cut into equal slices, so reduce-scatter and all-gather work on equal chunks
(ZeRO, Rajbhandari et al. 2020, section 5). The padding is at the end and
belongs to the last shard(s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(frozen=True)
class ShardPlan:
    """Even split of a flat buffer of ``numel`` elements over ``num_shards`` ranks."""

    numel: int
    num_shards: int

    def __post_init__(self):
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")

    @property
    def shard_numel(self) -> int:
        """Elements per shard, padding included."""
        return -(-self.numel // self.num_shards)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.num_shards

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the padded buffer."""
        self._check(rank)
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def owned_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of real (unpadded) elements ``rank`` owns; may be empty."""
        start, end = self.shard_range(rank)
        start, end = min(start, self.numel), min(end, self.numel)
        return start, end

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"rank {rank} outside 0..{self.num_shards - 1}")


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about a parameter."""

    name: str
    numel: int
    element_size: int
    group_key: Hashable = None  # buckets never mix keys, e.g. (dtype, device, decays)


@dataclass(frozen=True)
class Slot:
    """Where a parameter lives: ``[offset, offset + numel)`` of bucket ``bucket``."""

    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    index: int
    names: tuple[str, ...]  # in buffer order, i.e. reverse registration order
    group_key: Hashable
    numel: int  # real elements
    padded_numel: int  # numel rounded up to a multiple of pad_to


class BucketPlan:
    """Assignment of parameters to flat buckets (pure; no process groups).

    Parameters are visited in reverse registration order. Each group key has one
    open bucket; a parameter joins its key's open bucket unless that would pass
    ``bucket_cap_mb`` (MiB), in which case the open bucket is closed first. A
    parameter larger than the cap thus gets a bucket alone. Buckets are numbered
    by when they become complete in a back-to-front backward (the position of
    their last member), which is the order they are launched in. Each bucket's
    length is padded to a multiple of ``pad_to`` (the dp size) so ZeRO can cut
    it into equal shards with ``ShardPlan``.
    """

    def __init__(self, params: Sequence[ParamSpec], bucket_cap_mb: float, pad_to: int = 1):
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to!r}")
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique")
        cap_bytes = bucket_cap_mb * 2**20
        open_buckets: dict[Hashable, list[ParamSpec]] = {}
        used_bytes: dict[Hashable, int] = {}
        closed: list[list[ParamSpec]] = []
        for spec in reversed(params):
            key, nbytes = spec.group_key, spec.numel * spec.element_size
            if key in open_buckets and used_bytes[key] + nbytes > cap_bytes:
                closed.append(open_buckets.pop(key))
            if key not in open_buckets:
                open_buckets[key], used_bytes[key] = [], 0
            open_buckets[key].append(spec)
            used_bytes[key] += nbytes
            if used_bytes[key] >= cap_bytes:
                closed.append(open_buckets.pop(key))
        closed.extend(open_buckets.values())
        # Launch order = completion order: sort by the reverse position of the last member.
        position = {name: i for i, name in enumerate(reversed(names))}
        closed.sort(key=lambda members: position[members[-1].name])

        self.pad_to = pad_to
        self.buckets: list[Bucket] = []
        self.slots: dict[str, Slot] = {}
        for index, members in enumerate(closed):
            offset = 0
            for spec in members:
                self.slots[spec.name] = Slot(index, offset, spec.numel)
                offset += spec.numel
            padded = -(-offset // pad_to) * pad_to
            self.buckets.append(
                Bucket(index, tuple(p.name for p in members), members[0].group_key, offset, padded)
            )

    def __repr__(self) -> str:
        sizes = ", ".join(str(b.padded_numel) for b in self.buckets)
        return f"BucketPlan({len(self.buckets)} buckets: [{sizes}] elements)"
