"""Where a stored or wanted slice sits inside its logical tensor (pure).

A ``Piece`` is a tensor-parallel box of the logical tensor plus a flat range inside
it (a ZeRO shard cuts the row-major flattening), so every layout's shard is one piece
and loading into another layout copies what two pieces share.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rows:
    """``count`` runs of ``length`` contiguous elements of a flattened logical tensor,
    run ``i`` starting at ``start + i * stride`` (``stride >= length``)."""

    start: int
    stride: int
    count: int
    length: int


@dataclass(frozen=True)
class Piece:
    """Elements of logical tensor ``name`` (full shape ``shape``) held as one flat run."""

    name: str
    shape: tuple[int, ...]
    box_offsets: tuple[int, ...]
    box_sizes: tuple[int, ...]
    flat_start: int
    flat_end: int

    def __post_init__(self):
        if not (len(self.shape) == len(self.box_offsets) == len(self.box_sizes)):
            raise ValueError(f"{self.name}: box rank does not match shape {self.shape}")
        for dim, (off, size, full) in enumerate(zip(self.box_offsets, self.box_sizes, self.shape)):
            if off < 0 or size < 0 or off + size > full:
                raise ValueError(
                    f"{self.name}: box [{off}, {off + size}) outside dim {dim} of size {full}"
                )
        if not 0 <= self.flat_start <= self.flat_end <= self.box_numel:
            raise ValueError(
                f"{self.name}: flat range [{self.flat_start}, {self.flat_end}) "
                f"outside a box of {self.box_numel} elements"
            )

    @classmethod
    def whole(cls, name: str, shape) -> "Piece":
        shape = tuple(shape)
        return cls(name, shape, (0,) * len(shape), shape, 0, math.prod(shape))

    @classmethod
    def box(cls, name: str, shape, offsets, sizes) -> "Piece":
        sizes = tuple(sizes)
        return cls(name, tuple(shape), tuple(offsets), sizes, 0, math.prod(sizes))

    def flat(self, start: int, end: int) -> "Piece":
        """The sub-run ``[start, end)`` of this piece's elements."""
        if not 0 <= start <= end <= self.numel:
            raise ValueError(f"{self.name}: [{start}, {end}) outside a piece of {self.numel}")
        return Piece(
            self.name,
            self.shape,
            self.box_offsets,
            self.box_sizes,
            self.flat_start + start,
            self.flat_start + end,
        )

    @property
    def box_numel(self) -> int:
        return math.prod(self.box_sizes)

    @property
    def numel(self) -> int:
        return self.flat_end - self.flat_start

    @property
    def is_whole_box(self) -> bool:
        return self.flat_start == 0 and self.flat_end == self.box_numel

    def logical_indices(self) -> torch.Tensor:
        """Row-major indices into the flattened logical tensor, one per element, increasing.

        Only the piece's own range is resolved (never the whole box), so a small
        run of a large tensor costs what the run holds."""
        position = torch.arange(self.flat_start, self.flat_end)  # flat positions in the box
        index = torch.zeros_like(position)
        if position.numel() == 0:
            return index
        stride = 1
        for dim in reversed(range(len(self.shape))):
            size = self.box_sizes[dim]
            index += (position % size + self.box_offsets[dim]) * stride
            position = position // size
            stride *= self.shape[dim]
        return index

    def rows(self) -> Rows | None:
        """The box as evenly spaced runs of contiguous logical elements, or None where
        its runs are not evenly spaced (a box cut in two or more outer dimensions).

        Trailing dimensions the box holds whole join the last one it cuts into one run
        (a tensor-parallel row slice of a matrix: one run per row; a column slice, or
        a whole tensor: a single run)."""
        strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
        start = sum(o * s for o, s in zip(self.box_offsets, strides))
        cut = [d for d in range(len(self.shape)) if self.box_sizes[d] != self.shape[d]]
        if not cut:
            return Rows(start, self.box_numel, 1, self.box_numel)
        last = cut[-1]
        length = self.box_sizes[last] * strides[last]
        outer = [d for d in range(last) if self.box_sizes[d] > 1]
        for d, inner in itertools.pairwise(outer):
            if strides[d] != self.box_sizes[inner] * strides[inner]:
                return None
        count = math.prod(self.box_sizes[:last])
        stride = strides[outer[-1]] if outer else length
        return Rows(start, stride, count, length)

    def to_dict(self) -> dict:
        return {
            "box_offsets": list(self.box_offsets),
            "box_sizes": list(self.box_sizes),
            "flat": [self.flat_start, self.flat_end],
        }

    @classmethod
    def from_dict(cls, name: str, shape, d: dict) -> "Piece":
        return cls(
            name,
            tuple(shape),
            tuple(d["box_offsets"]),
            tuple(d["box_sizes"]),
            d["flat"][0],
            d["flat"][1],
        )


def copy_overlap(dst: torch.Tensor, dst_piece: Piece, src: torch.Tensor, src_piece: Piece) -> int:
    """Copy into flat ``dst`` (elements of ``dst_piece``) those of flat ``src`` it shares
    with ``src_piece``; return how many elements were copied."""
    if dst_piece.shape != src_piece.shape:
        raise ValueError(
            f"{dst_piece.name}: stored shape {src_piece.shape} differs from "
            f"the model's {dst_piece.shape}"
        )
    same_box = (
        dst_piece.box_offsets == src_piece.box_offsets
        and dst_piece.box_sizes == src_piece.box_sizes
    )
    if same_box:
        start = max(dst_piece.flat_start, src_piece.flat_start)
        end = min(dst_piece.flat_end, src_piece.flat_end)
        if end <= start:
            return 0
        dst[start - dst_piece.flat_start : end - dst_piece.flat_start].copy_(
            src[start - src_piece.flat_start : end - src_piece.flat_start]
        )
        return end - start
    if dst_piece.is_whole_box and src_piece.is_whole_box:
        return _copy_box_overlap(dst, dst_piece, src, src_piece)
    return _copy_index_overlap(dst, dst_piece, src, src_piece)


def _copy_box_overlap(dst, dst_piece: Piece, src, src_piece: Piece) -> int:
    dst_view = dst.view(dst_piece.box_sizes)
    src_view = src.view(src_piece.box_sizes)
    for dim in range(len(dst_piece.shape)):
        lo = max(dst_piece.box_offsets[dim], src_piece.box_offsets[dim])
        hi = min(
            dst_piece.box_offsets[dim] + dst_piece.box_sizes[dim],
            src_piece.box_offsets[dim] + src_piece.box_sizes[dim],
        )
        if hi <= lo:
            return 0
        dst_view = dst_view.narrow(dim, lo - dst_piece.box_offsets[dim], hi - lo)
        src_view = src_view.narrow(dim, lo - src_piece.box_offsets[dim], hi - lo)
    dst_view.copy_(src_view)
    return dst_view.numel()


def _copy_index_overlap(dst, dst_piece: Piece, src, src_piece: Piece) -> int:
    # A flat range of a row-major box visits logical indices in increasing order, so
    # the overlap is a sorted-array intersection.
    dst_index = dst_piece.logical_indices()
    src_index = src_piece.logical_indices()
    if dst_index.numel() == 0 or src_index.numel() == 0:
        return 0
    pos = torch.searchsorted(src_index, dst_index).clamp_(max=src_index.numel() - 1)
    hit = src_index[pos] == dst_index
    dst[hit] = src[pos[hit]]
    return int(hit.sum())


def pieces_in_range(
    layout: list[tuple[Piece, int]], start: int, end: int
) -> list[tuple[Piece, int, int]]:
    """Which parts of which pieces a flat buffer's run ``[start, end)`` holds.

    ``layout``: ``(piece, offset)`` for each piece packed into the buffer (a ZeRO
    flat buffer: parameters back to back, padding after the last). Returns
    ``(sub_piece, buffer_start, buffer_end)`` for every non-empty overlap; padding
    belongs to no piece and is left out.
    """
    found = []
    for piece, offset in layout:
        lo, hi = max(start, offset), min(end, offset + piece.numel)
        if lo < hi:
            found.append((piece.flat(lo - offset, hi - offset), lo, hi))
    return found
