"""Initial values drawn piece by piece equal the slices of the whole tensor."""

import torch

from meshwise.layout.init import BLOCK, ONES, full_init, init_values, normal
from meshwise.layout.pieces import Piece


def test_any_box_and_flat_range_is_a_slice_of_the_whole_tensor():
    shape = (300, 700)  # 210,000 elements: several blocks
    whole = full_init(normal(0.5), 7, "w", shape)
    assert abs(whole.std().item() - 0.5) < 0.01
    for offsets, sizes in (((0, 350), (300, 350)), ((150, 0), (150, 700)), ((7, 3), (11, 690))):
        box = Piece.box("w", shape, offsets, sizes)
        expected = whole[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]]
        assert torch.equal(init_values(normal(0.5), 7, box).view(sizes), expected)
        start, end = 5, max(6, box.numel - BLOCK // 3)  # a shard cutting rows and blocks
        assert torch.equal(init_values(normal(0.5), 7, box.flat(start, end)),
                           expected.reshape(-1)[start:end])


def test_seed_and_name_change_the_values_and_constants_are_constant():
    a = full_init(normal(1.0), 1, "a", (64,))
    assert not torch.equal(a, full_init(normal(1.0), 2, "a", (64,)))
    assert not torch.equal(a, full_init(normal(1.0), 1, "b", (64,)))
    assert torch.equal(full_init(ONES, 1, "n", (3, 2), torch.bfloat16),
                       torch.ones(3, 2, dtype=torch.bfloat16))
