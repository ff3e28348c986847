"""Initial values drawn piece by piece equal the slices of the whole tensor."""

import hashlib
import math
import zlib

import pytest
import torch

from meshwise.geometry.init import BLOCK, ONES, full_init, init_values, normal, uniform
from meshwise.geometry.pieces import Piece


def test_any_box_and_flat_range_is_a_slice_of_the_whole_tensor():
    shape = (300, 700)  # 210,000 elements: several blocks
    whole = full_init(normal(0.5), 7, "w", shape)
    assert abs(whole.std().item() - 0.5) < 0.01
    for offsets, sizes in (((0, 350), (300, 350)), ((150, 0), (150, 700)), ((7, 3), (11, 690))):
        box = Piece.box("w", shape, offsets, sizes)
        expected = whole[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
        assert torch.equal(init_values(normal(0.5), 7, box).view(sizes), expected)
        start, end = 5, max(6, box.numel - BLOCK // 3)  # a shard cutting rows and blocks
        assert torch.equal(
            init_values(normal(0.5), 7, box.flat(start, end)), expected.reshape(-1)[start:end]
        )


def test_seed_and_name_change_the_values_and_constants_are_constant():
    a = full_init(normal(1.0), 1, "a", (64,))
    assert not torch.equal(a, full_init(normal(1.0), 2, "a", (64,)))
    assert not torch.equal(a, full_init(normal(1.0), 1, "b", (64,)))
    assert torch.equal(
        full_init(ONES, 1, "n", (3, 2), torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16)
    )


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def test_values_are_pinned():
    """Checkpoints and parity runs rely on these exact values: a change of ``BLOCK``, of
    the seeding or of how a block is drawn shows here."""
    w = full_init(normal(0.02), 1234, "layers.0.mlp.down_proj.weight", (256, 1024))
    assert _hash(w) == "e4f35043278bd7cd"
    assert w.view(-1)[[0, 65535, 65536, 262143]].tolist() == [
        -0.012164577841758728,
        0.014300146140158176,
        -0.015296357683837414,
        -0.00034581124782562256,
    ]
    assert _hash(full_init(uniform(0.05), 7, "lin.weight", (300, 700))) == "ebd83656258f25d0"
    column = Piece.box("lin.weight", (300, 700), (0, 350), (300, 350))
    assert _hash(init_values(uniform(0.05), 7, column)) == "3e6d4be417433d12"
    irregular = Piece.box("x", (3, 50, 700), (1, 10, 100), (2, 30, 500)).flat(123, 25000)
    assert _hash(init_values(normal(1.0), 3, irregular)) == "b6d4885c431077c9"
    rows = Piece.box("y", (4, 64, 1024), (0, 0, 256), (4, 64, 512)).flat(1000, 100000)
    assert _hash(init_values(normal(1.0), 3, rows)) == "73909b01176799ce"
    assert _hash(full_init(normal(1.0), 5, "t", (2 * BLOCK + 7,))) == "0a522513f8a2f423"


def _by_definition(init, seed: int, name: str, shape) -> torch.Tensor:
    """The whole tensor as the module docstring defines it, block after block."""
    numel = math.prod(shape)
    blocks = []
    for block in range(-(-numel // BLOCK)):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}:{block}".encode()))
        values = torch.empty(min(BLOCK, numel - block * BLOCK))
        if init.kind == "uniform":
            blocks.append(values.uniform_(-init.bound, init.bound, generator=gen))
        else:
            blocks.append(values.normal_(0.0, init.std, generator=gen))
    return torch.cat(blocks).view(shape)


@pytest.mark.parametrize("threads", [1, 2])
def test_every_kind_of_piece_is_the_definition_sliced(threads):
    """Tensor-parallel slices (one run, rows a block or more apart, rows close together
    across several windows), ZeRO ranges cutting rows and blocks, boxes cut in two
    dimensions, drawn on one thread or several."""
    shape = (2048, 1536)  # 3.1M elements: more than one window of rows
    init = normal(0.02)
    whole = _by_definition(init, 11, "m", shape)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(full_init(init, 11, "m", shape), whole)
        for tp in (2, 8):
            for rank in (0, tp - 1):
                rows, cols = 2048 // tp, 1536 // tp
                for box, expected in (
                    (
                        Piece.box("m", shape, (rank * rows, 0), (rows, 1536)),
                        whole[rank * rows : (rank + 1) * rows],
                    ),
                    (
                        Piece.box("m", shape, (0, rank * cols), (2048, cols)),
                        whole[:, rank * cols : (rank + 1) * cols],
                    ),
                ):
                    flat = expected.reshape(-1)
                    assert torch.equal(init_values(init, 11, box), flat)
                    for start, end in (
                        (0, BLOCK + 5),
                        (cols // 2, box.numel - cols // 3),
                        (box.numel // 3, 2 * box.numel // 3),
                        (7, 8),
                    ):
                        assert torch.equal(
                            init_values(init, 11, box.flat(start, end)), flat[start:end]
                        )
        long_rows = (4, 3 * BLOCK)  # rows longer than a block: each its own run
        whole = _by_definition(uniform(0.1), 2, "e", long_rows)
        box = Piece.box("e", long_rows, (1, BLOCK // 2), (3, BLOCK))
        assert torch.equal(
            init_values(uniform(0.1), 2, box.flat(100, 2 * BLOCK + 9)),
            whole[1:, BLOCK // 2 : BLOCK // 2 + BLOCK].reshape(-1)[100 : 2 * BLOCK + 9],
        )
        cube = (6, 40, 300)  # cut in two outer dimensions: runs not evenly spaced
        whole = _by_definition(init, 4, "c", cube)
        box = Piece.box("c", cube, (1, 5, 10), (4, 30, 200))
        assert box.rows() is None
        assert torch.equal(
            init_values(init, 4, box.flat(301, 20001)),
            whole[1:5, 5:35, 10:210].reshape(-1)[301:20001],
        )
    finally:
        torch.set_num_threads(saved)
