"""Which contiguous range of a flat buffer each data-parallel rank owns (pure).

A buffer of ``numel`` elements is padded up to a multiple of ``num_shards`` and
cut into equal slices, so every rank holds the same number of elements and
reduce-scatter / all-gather work on equal chunks (ZeRO, Rajbhandari et al. 2020,
section 5). The padding is at the end and belongs to the last shard(s).
"""

from __future__ import annotations

from dataclasses import dataclass


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
