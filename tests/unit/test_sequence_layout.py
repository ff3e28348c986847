"""Which tokens a cp / sp rank holds, and what is keyed by their global positions."""

import pytest
import torch

from meshwise.geometry.sequence import (
    SequenceShard,
    padded_length,
    position_owner,
    zigzag_positions,
    zigzag_slice,
)
from meshwise.models.context import ForwardContext
from meshwise.models.dropout import keep_mask


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_chunks_tile_the_sequence_and_balance_causal_work(cp):
    seq_len = 8 * cp
    positions = [zigzag_positions(seq_len // cp, r, cp) for r in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(seq_len))
    # Keys each rank's queries see under the causal mask: the same on every rank.
    work = {int((p + 1).sum()) for p in positions}
    assert len(work) == 1, work
    for r, p in enumerate(positions):
        assert torch.equal(zigzag_slice(torch.arange(seq_len)[None], 1, r, cp)[0], p)
        assert bool((p[1:] > p[:-1]).all())  # increasing: a causal mask stays causal


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert zigzag_positions(4, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(4, 1, 2).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp, seq_len", [(1, 5), (2, 8), (3, 12), (4, 32)])
def test_every_position_has_one_owner(cp, seq_len):
    for position in range(seq_len):
        rank, index = position_owner(position, seq_len, cp)
        assert zigzag_positions(seq_len // cp, rank, cp)[index] == position


def test_sp_splits_a_cp_ranks_tokens_in_runs():
    shard = SequenceShard(cp_rank=1, cp_size=2, sp_rank=1, sp_size=2)
    assert shard.local_positions(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard.stream_positions(4).tolist() == [8, 9, 10, 11]
    assert padded_length(33, 8) == 40 and padded_length(32, 8) == 32


@pytest.mark.parametrize("cp, sp", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (2, 4)])
def test_a_shard_cuts_its_tokens_and_pads_to_a_length_it_splits(cp, sp):
    """What a rank is fed: its zigzag chunks; a window padded to the smallest length
    whose chunks hold whole sp runs (what the trainer's config checks too)."""
    for rank in range(cp):
        shard = SequenceShard(rank, cp, 0, sp)
        divisor = shard.tokens_divisor
        assert divisor % (2 * cp if cp > 1 else 1) == 0 and (divisor // cp) % sp == 0
        real = 3 * divisor - 1
        window = torch.arange(1, real + 1)[None]  # (1, real): one token short of a split
        padded, length = shard.padded(window)
        assert length % divisor == 0 and real <= length < real + divisor
        assert padded[0, :real].tolist() == window[0].tolist() and not padded[0, real:].any()
        held = shard.cut(padded)[0]
        assert torch.equal(held, padded[0, shard.local_positions(length // cp)])


def test_uneven_chunks_are_refused():
    with pytest.raises(ValueError, match="10 tokens do not split into 2 x cp = 4 chunks"):
        zigzag_slice(torch.zeros(1, 10), 1, 0, 2)


@pytest.mark.parametrize("cp, sp", [(2, 1), (1, 2), (2, 2), (3, 2)])
def test_stream_dropout_masks_are_slices_of_one_processs(cp, sp):
    """A rank's residual-stream mask is its tokens' rows of the single-process mask."""
    seq_len, shape = 12 * cp * sp, (3, 12 * cp * sp, 5)
    whole = ForwardContext(seed=4, step=2, first_sample=6)
    expected = keep_mask(whole, "blocks.0.mlp.out", torch.Size(shape), 0.3, "cpu")
    for cp_rank in range(cp):
        for sp_rank in range(sp):
            part = ForwardContext(
                seed=4, step=2, first_sample=6, tokens=SequenceShard(cp_rank, cp, sp_rank, sp)
            )
            held = seq_len // cp // sp
            got = keep_mask(part, "blocks.0.mlp.out", torch.Size((3, held, 5)), 0.3, "cpu")
            rows = part.tokens.stream_positions(held)
            assert torch.equal(got, expected[:, rows]), (cp_rank, sp_rank)
