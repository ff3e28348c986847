"""Initial values that do not depend on the layout, drawn piece by piece.

A parameter starts as the tensor a single process would build from the run's
seed (DESIGN section 1). To let a rank draw only what it keeps (a tensor-parallel
slice, a ZeRO-3 shard of it) without ever building the whole tensor, the values
are defined block by block: the row-major flattening of the logical tensor is cut
into blocks of ``BLOCK`` elements, and block ``j`` of parameter ``name`` is drawn
from a generator seeded by ``(seed, name, j)``. Any piece (a box of the logical
tensor, and a flat range inside that box; see ``meshwise.layout.pieces``) is
then produced from the blocks it touches, a few at a time, so memory stays at
the piece plus a block whatever the tensor's size.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch

from .pieces import Piece

BLOCK = 1 << 16  # elements per independently seeded block
_CHUNK = 1 << 20  # piece elements resolved to logical indices at a time
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


def _draw_block(init: Init, seed: int, name: str, block: int, numel: int) -> torch.Tensor:
    size = min(BLOCK, numel - block * BLOCK)
    gen = torch.Generator().manual_seed(block_seed(seed, name, block))
    if init.kind == "uniform":
        return torch.empty(size).uniform_(-init.bound, init.bound, generator=gen)
    return torch.empty(size).normal_(0.0, init.std, generator=gen)  # fp32, on the CPU


def init_values(init: Init, seed: int, piece: Piece, dtype: torch.dtype = torch.float32,
                device=None) -> torch.Tensor:
    """The elements of ``piece`` (flat, in its order) as one process would draw them."""
    if init.kind in ("zeros", "ones"):
        fill = 0.0 if init.kind == "zeros" else 1.0
        return torch.full((piece.numel,), fill, dtype=dtype, device=device)
    numel = math.prod(piece.shape)
    out = torch.empty(piece.numel, dtype=torch.float32)
    cached: tuple[int, torch.Tensor] | None = None
    for start in range(0, piece.numel, _CHUNK):
        end = min(start + _CHUNK, piece.numel)
        index = piece.flat(start, end).logical_indices()  # increasing
        blocks, counts = torch.unique_consecutive(index // BLOCK, return_counts=True)
        pos = start
        for block, count in zip(blocks.tolist(), counts.tolist()):
            if cached is None or cached[0] != block:  # indices increase: never needed again
                cached = (block, _draw_block(init, seed, piece.name, block, numel))
            local = index[pos - start:pos - start + count] - block * BLOCK
            out[pos:pos + count] = cached[1][local]
            pos += count
    return out.to(dtype=dtype, device=device)


def full_init(init: Init, seed: int, name: str, shape, dtype: torch.dtype = torch.float32
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

    saved = {name: getattr(init, name) for name in dir(init)
             if name.endswith("_") and not name.startswith("_")
             and callable(getattr(init, name))}
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

