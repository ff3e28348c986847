"""The checkpoint format: any layout's shards written, any layout's shards read back."""

import math

import pytest
import torch

from meshwise.checkpoint.save_dir import prune
from meshwise.checkpoint.store import (
    Checkpoint,
    CheckpointError,
    complete_checkpoints,
    finalize,
    resolve,
    temp_dir,
    write_rank_file,
)
from meshwise.geometry.pieces import Piece, copy_overlap, pieces_in_range

SHAPES = {"emb": (10, 6), "w": (6, 12), "b": (12,), "norm": (), "cube": (4, 6, 5)}


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}


def _tp_box(name, shape, tp_rank, tp):
    """Split dim 0 (dim 1 for w) into tp equal boxes; scalars and odd dims stay whole."""
    dim = 1 if name == "w" else 0
    if not shape or shape[dim] % tp:
        return Piece.whole(name, shape)
    size = shape[dim] // tp
    offsets = [0] * len(shape)
    sizes = list(shape)
    offsets[dim], sizes[dim] = tp_rank * size, size
    return Piece.box(name, shape, offsets, sizes)


def _slice(full, piece):
    """The elements of ``piece`` in ``full``, flat (the reference every layout must hold)."""
    return full.reshape(-1)[piece.logical_indices()]


def _layout(tp, dp, writing=True):
    """Per rank: (piece, values) pairs of a tp x ZeRO(dp) layout, like the engines hold.

    When ``writing``, a tp-replicated tensor is written by tp rank 0 only (every
    tp rank holds it, and a tensor is stored once)."""
    model = _model()
    ranks = []
    for tp_rank in range(tp):
        boxes = [_tp_box(n, s, tp_rank, tp) for n, s in SHAPES.items()]
        if writing and tp_rank > 0:
            boxes = [b for b in boxes if b.box_sizes != b.shape]
        layout, offset = [], 0
        for piece in boxes:
            layout.append((piece, offset))
            offset += piece.numel
        shard = -(-offset // dp)
        for dp_rank in range(dp):
            pieces = pieces_in_range(layout, dp_rank * shard, (dp_rank + 1) * shard)
            ranks.append([(p, _slice(model[p.name], p)) for p, _, _ in pieces])
    return model, ranks


def _save(tmp_path, ranks, step=5):
    tmp = temp_dir(tmp_path, step)
    tmp.mkdir(parents=True)
    fragments = [write_rank_file(tmp, r, entries) for r, entries in enumerate(ranks)]
    return finalize(tmp, fragments, {"step": step})


@pytest.mark.parametrize("saved", [(1, 1), (2, 1), (1, 3), (2, 2), (3, 2)])
@pytest.mark.parametrize("loaded", [(1, 1), (2, 2), (1, 4), (3, 1)])
def test_any_layout_reads_any_other(tmp_path, saved, loaded):
    model, ranks = _layout(*saved)
    ckpt = Checkpoint(_save(tmp_path, ranks))
    ckpt.verify()
    _, wanted = _layout(*loaded, writing=False)
    for entries in wanted:
        for piece, expected in entries:
            out = torch.full((piece.numel,), float("nan"), dtype=torch.float64)
            ckpt.read_into(out, piece)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for name, full in model.items():
        torch.testing.assert_close(ckpt.read(name), full, rtol=0, atol=0)


def test_logical_indices_match_slicing():
    full = torch.arange(4 * 6 * 5).view(4, 6, 5)
    piece = Piece.box("x", (4, 6, 5), (1, 2, 0), (2, 3, 5)).flat(4, 23)
    expected = full[1:3, 2:5, :].reshape(-1)[4:23]
    assert torch.equal(piece.logical_indices(), expected)


def test_copy_overlap_counts_and_leaves_the_rest():
    src_piece = Piece.whole("x", (8,)).flat(2, 6)
    dst_piece = Piece.whole("x", (8,)).flat(4, 8)
    dst = torch.zeros(4)
    assert copy_overlap(dst, dst_piece, torch.tensor([2.0, 3.0, 4.0, 5.0]), src_piece) == 2
    assert dst.tolist() == [4.0, 5.0, 0.0, 0.0]


def test_padding_is_not_stored(tmp_path):
    layout = [(Piece.whole("a", (3,)), 0), (Piece.whole("b", (2,)), 3)]  # 5 of a padded 6
    pieces = pieces_in_range(layout, 3, 6)
    assert [(p.name, p.numel, lo, hi) for p, lo, hi in pieces] == [("b", 2, 3, 5)]


def test_missing_shard_is_refused_at_save(tmp_path):
    _, ranks = _layout(1, 2)
    tmp = temp_dir(tmp_path, 1)
    tmp.mkdir()
    with pytest.raises(ValueError, match="missing or written twice"):
        finalize(tmp, [write_rank_file(tmp, 0, ranks[0])], {"step": 1})
    assert complete_checkpoints(tmp_path) == []  # nothing became visible


def _damaged(tmp_path, how):
    path = _save(tmp_path, _layout(2, 2)[1])
    victim = path / "rank-00001.safetensors"
    if how == "missing":
        victim.unlink()
    elif how == "truncated":
        victim.write_bytes(victim.read_bytes()[:-7])
    elif how == "flipped":
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0xFF
        victim.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    "how,message",
    [
        ("missing", "missing from the checkpoint"),
        ("truncated", "truncated"),
        ("flipped", "checksum mismatch"),
    ],
)
def test_damage_is_named(tmp_path, how, message):
    ckpt = Checkpoint(_damaged(tmp_path, how))
    with pytest.raises(CheckpointError, match=message) as err:
        ckpt.verify()
    assert "rank-00001.safetensors" in str(err.value)
    assert "\n" not in str(err.value)


def test_other_model_shape_is_named(tmp_path):
    ckpt = Checkpoint(_save(tmp_path, _layout(1, 1)[1]))
    with pytest.raises(CheckpointError, match=r"w has shape \(6, 12\)"):
        ckpt.read_into(torch.empty(6 * 8), Piece.whole("w", (6, 8)))
    with pytest.raises(CheckpointError, match="no tensor 'lm_head'"):
        ckpt.read_into(torch.empty(4), Piece.whole("lm_head", (4,)))


def test_incomplete_directories_are_not_checkpoints(tmp_path):
    first = _save(tmp_path, _layout(1, 1)[1], step=3)
    temp_dir(tmp_path, 9).mkdir()  # a save that died half way
    (tmp_path / "step-00000007").mkdir()  # no manifest
    assert complete_checkpoints(tmp_path) == [first]
    assert resolve(tmp_path) == first
    assert resolve(first) == first
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        Checkpoint(tmp_path / "step-00000007")
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        resolve(tmp_path / "nothing")


def test_prune_keeps_the_newest(tmp_path):
    saved = [_save(tmp_path, _layout(1, 1)[1], step=s) for s in (1, 2, 3)]
    assert prune(tmp_path, keep_last=2) == saved[:1]
    assert complete_checkpoints(tmp_path) == saved[1:]


def test_scalar_and_dtype_round_trip(tmp_path):
    entries = [
        (Piece.whole("s", ()), torch.tensor([2.5])),
        (Piece.whole("h", (3,)), torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)),
    ]
    ckpt = Checkpoint(_save(tmp_path, [entries]))
    assert ckpt.read("s").shape == () and ckpt.read("s").item() == 2.5
    assert ckpt.read("h").dtype == torch.bfloat16
    assert math.prod(ckpt.shape("h")) == 3
