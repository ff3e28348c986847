"""Initial values that do not depend on the layout (DESIGN section 1): block ``j`` of
``BLOCK`` elements of a logical tensor's row-major flattening is drawn from a generator
seeded by ``(seed, name, j)``, so a rank draws only the blocks its piece touches.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .pieces import Piece, Rows

BLOCK = 1 << 16  # elements per independently seeded block
_CHUNK = 1 << 20  # piece elements resolved to logical indices at a time
WINDOW = 32 * BLOCK  # logical elements one job draws: a thread's share of work and memory
INIT_KINDS = ("normal", "uniform", "zeros", "ones")


@dataclass(frozen=True)
class Init:
    """How a parameter's single-process values are drawn: N(0, std^2), U(-bound, bound)
    (``nn.Linear``'s own initialisation), zeros or ones."""

    kind: str = "normal"
    std: float = 0.02
    bound: float = 0.0

    def __post_init__(self):
        if self.kind not in INIT_KINDS:
            raise ValueError(f"init kind {self.kind!r}; valid: {', '.join(INIT_KINDS)}")


ZEROS = Init("zeros")
ONES = Init("ones")


def normal(std: float) -> Init:
    return Init("normal", std)


def uniform(bound: float) -> Init:
    return Init("uniform", bound=bound)


def block_seed(seed: int, name: str, block: int) -> int:
    """A stable seed per (run seed, parameter, block); not Python's salted ``hash``."""
    return zlib.crc32(f"{seed}:{name}:{block}".encode())


class _Blocks:
    """Draws the blocks of one parameter: whole blocks straight into their place in
    the output, partly wanted ones into a scratch block first."""

    def __init__(self, init: Init, seed: int, name: str, numel: int):
        self.init, self.seed, self.name, self.numel = init, seed, name, numel

    def draw(self, block: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (contiguous fp32, the block's size) with block ``block``."""
        gen = torch.Generator().manual_seed(block_seed(self.seed, self.name, block))
        if self.init.kind == "uniform":
            return out.uniform_(-self.init.bound, self.init.bound, generator=gen)
        return out.normal_(0.0, self.init.std, generator=gen)

    def block(self, block: int) -> torch.Tensor:
        return self.draw(block, torch.empty(min(BLOCK, self.numel - block * BLOCK)))

    def fill_run(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out`` (contiguous) gets logical elements ``[lo, hi)``."""
        for block in range(lo // BLOCK, -(-hi // BLOCK)):
            first = block * BLOCK
            a, b = max(lo, first), min(hi, first + BLOCK, self.numel)
            if a == first and b == min(first + BLOCK, self.numel):
                self.draw(block, out[a - lo : b - lo])  # the same stream as a scratch block
            else:
                out[a - lo : b - lo] = self.block(block)[a - first : b - first]

    def fill_rows(self, rows: Rows, first: int, count: int, out: torch.Tensor) -> None:
        """``out`` (contiguous, ``count x rows.length``) gets rows ``[first, first +
        count)``, drawn as the one run that spans them (their gaps are shorter than a
        block, so every block of it is needed anyway) and taken out as a strided view."""
        lo = rows.start + first * rows.stride
        span = (count - 1) * rows.stride + rows.length
        window = torch.empty(span)
        self.fill_run(lo, lo + span, window)
        out.view(count, rows.length).copy_(
            window.as_strided((count, rows.length), (rows.stride, 1))
        )


def _row_jobs(rows: Rows, flat_start: int, flat_end: int) -> list[tuple]:
    """The piece's flat range ``[flat_start, flat_end)`` of ``rows`` as jobs that fill
    disjoint parts of the output: ``("run", lo, hi, pos)`` logical ``[lo, hi)`` at
    ``pos``; ``("rows", first, count, pos)`` whole rows at ``pos``."""
    jobs, length = [], rows.length
    r0, c0 = divmod(flat_start, length)
    r1, c1 = divmod(flat_end, length)
    if rows.stride == length or r0 == r1:  # one contiguous run
        lo = rows.start + r0 * rows.stride + c0
        return _split_run(lo, lo + flat_end - flat_start, 0)
    pos = 0
    if c0:  # the end of a row the range starts inside
        lo = rows.start + r0 * rows.stride + c0
        jobs += _split_run(lo, lo + length - c0, pos)
        r0, pos = r0 + 1, pos + length - c0
    if length >= BLOCK or rows.stride - length >= BLOCK:  # rows apart: each its own run
        for r in range(r0, r1):
            lo = rows.start + r * rows.stride
            jobs += _split_run(lo, lo + length, pos + (r - r0) * length)
    else:  # rows close together: many per window
        per_window = max(1, WINDOW // rows.stride)
        for r in range(r0, r1, per_window):
            jobs.append(("rows", r, min(per_window, r1 - r), pos + (r - r0) * length))
    pos += (r1 - r0) * length
    if c1:  # the start of the row the range ends inside
        lo = rows.start + r1 * rows.stride
        jobs += _split_run(lo, lo + c1, pos)
    return jobs


def _split_run(lo: int, hi: int, pos: int) -> list[tuple]:
    """A run cut at block boundaries into jobs of at most ``WINDOW`` elements."""
    cuts = [lo, *range((lo // WINDOW + 1) * WINDOW, hi, WINDOW), hi]
    return [("run", a, b, pos + a - lo) for a, b in itertools.pairwise(cuts)]


def _run_jobs(blocks: _Blocks, rows: Rows, jobs: list[tuple], out: torch.Tensor) -> None:
    def run(job):
        kind, a, b, pos = job
        if kind == "run":
            blocks.fill_run(a, b, out[pos : pos + b - a])
        else:
            blocks.fill_rows(rows, a, b, out[pos : pos + b * rows.length])

    threads = min(torch.get_num_threads(), len(jobs))
    if threads <= 1:
        for job in jobs:
            run(job)
        return
    # Blocks have their own generators, so threads may draw them in any order; the
    # drawing kernels release the GIL.
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(run, jobs):
            pass


def _fill_by_index(blocks: _Blocks, piece: Piece, out: torch.Tensor) -> None:
    """Any piece, element by element: its logical indices, grouped by block."""
    cached: tuple[int, torch.Tensor] | None = None
    for start in range(0, piece.numel, _CHUNK):
        end = min(start + _CHUNK, piece.numel)
        index = piece.flat(start, end).logical_indices()  # increasing
        found, counts = torch.unique_consecutive(index // BLOCK, return_counts=True)
        pos = start
        for block, count in zip(found.tolist(), counts.tolist()):
            if cached is None or cached[0] != block:  # indices increase: never needed again
                cached = (block, blocks.block(block))
            local = index[pos - start : pos - start + count] - block * BLOCK
            out[pos : pos + count] = cached[1][local]
            pos += count


def init_values(
    init: Init, seed: int, piece: Piece, dtype: torch.dtype = torch.float32, device=None
) -> torch.Tensor:
    """The elements of ``piece`` (flat, in its order) as one process would draw them."""
    if init.kind in ("zeros", "ones"):
        fill = 0.0 if init.kind == "zeros" else 1.0
        return torch.full((piece.numel,), fill, dtype=dtype, device=device)
    out = torch.empty(piece.numel, dtype=torch.float32)  # drawn in fp32, on the CPU
    if piece.numel:
        blocks = _Blocks(init, seed, piece.name, math.prod(piece.shape))
        rows = piece.rows()
        if rows is None:
            _fill_by_index(blocks, piece, out)
        else:
            _run_jobs(blocks, rows, _row_jobs(rows, piece.flat_start, piece.flat_end), out)
    return out.to(dtype=dtype, device=device)


def full_init(
    init: Init, seed: int, name: str, shape, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The whole logical tensor ``name`` (for one process, or small tensors)."""
    return init_values(init, seed, Piece.whole(name, shape), dtype).view(tuple(shape))


@torch.no_grad()
def init_module(model: torch.nn.Module, init_of, seed: int, logical_name=lambda n: n) -> None:
    """Give every parameter of a whole (single-process) model its initial values.

    ``init_of(name) -> Init``; ``logical_name`` maps a parameter's name to the one
    its values are drawn under (a tie's first member)."""
    for name, param in model.named_parameters():  # a tied parameter appears once
        logical = logical_name(name)
        param.copy_(full_init(init_of(logical), seed, logical, param.shape, param.dtype))


@contextlib.contextmanager
def on_meta():
    """Modules built inside hold shapes only, on the meta device, and ``torch.nn.init``
    does nothing to them: their values come from this module later. (Initialising a
    meta tensor imports torch's compiler, a second or more in every process.) The
    init functions are swapped process-wide while inside: build on one thread."""
    from torch.nn import init

    saved = {
        name: getattr(init, name)
        for name in dir(init)
        if name.endswith("_") and not name.startswith("_") and callable(getattr(init, name))
    }
    try:
        for name in saved:
            setattr(init, name, _unchanged)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def _unchanged(tensor, *args, **kwargs):
    return tensor
