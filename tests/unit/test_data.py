"""Token files, corpus building and caching, and deterministic global batches."""

import json
import os
import pickle
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from meshwise.data.dataset import (
    ACCEPTED,
    TokenDataset,
    rank_slice,
    read_meta,
    resolve_data,
    resolve_vocab_size,
    sidecar_path,
)


def _tokens(path):
    return np.fromfile(path, dtype="<u2")


def _write_bin(path, values):
    np.asarray(values, dtype="<u2").tofile(path)
    return path


def _no_temp_files(folder):
    return not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_text_file_is_byte_tokens_with_sidecar(tmp_path):
    text = tmp_path / "a.txt"
    text.write_bytes("hé\nllo".encode())
    cache = tmp_path / "cache"
    out = resolve_data(str(text), cache_dir=str(cache))
    assert out.parent == cache and out.suffix == ".bin"
    assert _tokens(out).tolist() == list("hé\nllo".encode())
    meta = json.loads(sidecar_path(out).read_text())
    assert meta == read_meta(out)
    assert meta["num_tokens"] == 7 and meta["vocab_size"] == 256 and meta["format"] == 2
    assert meta["source"] == str(text.resolve())
    assert _no_temp_files(cache)


def test_cached_second_call_does_not_rebuild(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("abc" * 10)
    out = resolve_data(text, cache_dir=tmp_path / "c")
    before = out.stat().st_mtime_ns, sidecar_path(out).stat().st_mtime_ns
    assert resolve_data(text, cache_dir=tmp_path / "c") == out
    assert (out.stat().st_mtime_ns, sidecar_path(out).stat().st_mtime_ns) == before
    text.write_text("changed")  # new size and mtime: a new cache entry
    assert resolve_data(text, cache_dir=tmp_path / "c") != out


def test_concurrent_builders_agree(tmp_path):
    text = tmp_path / "a.txt"
    text.write_bytes(b"xyz" * 100_000)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: resolve_data(text, tmp_path / "c"), range(4)))
    assert len(set(outs)) == 1 and _tokens(outs[0]).size == 300_000
    visible = [p for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")]
    assert sorted(p.suffix for p in visible) == [".bin", ".json"]


def test_folder_sorted_recursive_skips_binary(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_bytes(b"BB")
    (root / "a.txt").write_bytes(b"AA")
    (root / "sub" / "c.py").write_bytes(b"CC")
    (root / "blob.dat").write_bytes(b"xx\0yy")
    out = resolve_data(root, cache_dir=tmp_path / "c")
    assert bytes(_tokens(out).astype(np.uint8)) == b"AA\nBB\nCC"
    assert read_meta(out)["vocab_size"] == 256
    assert _no_temp_files(tmp_path / "c")


def test_empty_corpus_and_binary_file_raise(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="empty corpus"):
        resolve_data(tmp_path / "empty", cache_dir=tmp_path / "c")
    blob = tmp_path / "blob.dat"
    blob.write_bytes(b"\0\1\2")
    with pytest.raises(ValueError, match="only binary files"):
        resolve_data(blob, cache_dir=tmp_path / "c")
    assert not any(p.suffix == ".bin" for p in (tmp_path / "c").iterdir())
    assert _no_temp_files(tmp_path / "c")


def test_missing_path_message(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError) as err:
        resolve_data(str(missing), cache_dir=tmp_path)
    message = str(err.value)
    assert str(missing) in message and ACCEPTED in message and "\n" not in message


def test_bin_without_sidecar_gets_one(tmp_path):
    path = _write_bin(tmp_path / "toks.bin", [3, 700, 5, 699])
    assert resolve_data(path, cache_dir=tmp_path / "c") == path
    meta = json.loads((tmp_path / "toks.bin.meshwise.json").read_text())
    assert meta["num_tokens"] == 4 and meta["max_token"] == 700 and meta["vocab_size"] is None
    assert meta["written_by"] == "meshwise"


def test_our_sidecar_is_trusted(tmp_path):
    path = _write_bin(tmp_path / "toks.bin", [1, 2, 3])
    meta = {
        "num_tokens": 3,
        "vocab_size": 50257,
        "max_token": None,
        "source": "x",
        "format": 2,
        "written_by": "meshwise",
    }
    sidecar_path(path).write_text(json.dumps(meta))
    assert read_meta(resolve_data(path)) == meta


def test_a_users_files_are_never_read_as_sidecars_or_replaced(tmp_path):
    path = _write_bin(tmp_path / "corpus.bin", [1, 2, 3])
    users = tmp_path / "corpus.json"
    users.write_text('{"my": "notes"}')
    assert read_meta(path)["max_token"] == 3
    assert users.read_text() == '{"my": "notes"}'
    sidecar_path(path).unlink()
    sidecar_path(path).write_text('{"also": "mine"}')
    with pytest.raises(ValueError, match="was not written by meshwise; it is left alone"):
        read_meta(path)
    assert sidecar_path(path).read_text() == '{"also": "mine"}'


def test_vocabulary_is_explicit_past_the_byte_default():
    bytes_meta = {"vocab_size": 256, "max_token": None, "source": "c"}
    assert resolve_vocab_size(bytes_meta) == 256
    assert resolve_vocab_size({"vocab_size": None, "max_token": 200, "source": "b"}) == 201
    big = {"vocab_size": None, "max_token": 60000, "source": "b.bin"}
    with pytest.raises(ValueError, match="up to 60000.*--vocab-size \\(at least 60001\\)"):
        resolve_vocab_size(big)
    assert resolve_vocab_size(big, 65536) == 65536
    with pytest.raises(ValueError, match="holds token id 60000, outside --vocab-size 50000"):
        resolve_vocab_size(big, 50000)
    with pytest.raises(ValueError, match="smaller than the vocabulary of 256"):
        resolve_vocab_size(bytes_meta, 100)
    # The .bin given is named, not the folder it was prepared from.
    with pytest.raises(ValueError, match="of 256 that data/c.bin was tokenized with"):
        resolve_vocab_size(bytes_meta, 100, "data/c.bin")
    with pytest.raises(ValueError, match="^data/b.bin holds token id 60000, outside"):
        resolve_vocab_size(big, 50000, "data/b.bin")


def test_bin_in_read_only_folder_keeps_meta_in_memory(tmp_path, monkeypatch):
    path = _write_bin(tmp_path / "toks.bin", [9, 1])
    monkeypatch.setattr("meshwise.data.dataset.os.access", lambda *args: False)
    assert read_meta(path)["max_token"] == 9
    assert read_meta(path)["num_tokens"] == 2
    assert not sidecar_path(path).exists()


def test_bad_bin_raises(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="uint16"):
        resolve_data(tmp_path / "odd.bin")


@pytest.fixture
def dataset(tmp_path):
    path = _write_bin(tmp_path / "ramp.bin", np.arange(5000) % 1000)
    return TokenDataset(path, seq_len=16, val_fraction=0.1, vocab_size=1000)


def test_batch_shape_and_windows(dataset):
    batch = dataset.global_batch(step=0, batch_size=8, seed=1)
    assert batch.shape == (8, 17) and batch.dtype == torch.int64
    starts = dataset.window_starts(0, 8, 1)
    for row, start in zip(batch, starts):  # ramp data: row i is start..start+16 (mod 1000)
        assert row.tolist() == [(start + k) % 1000 for k in range(17)]
    assert dataset.vocab_size == 1000


def test_batches_deterministic_per_seed_and_step(dataset, tmp_path):
    a = dataset.global_batch(3, 8, seed=7)
    assert torch.equal(a, dataset.global_batch(3, 8, seed=7))
    other = TokenDataset(dataset.path, seq_len=16, val_fraction=0.1, vocab_size=1000)
    assert torch.equal(a, other.global_batch(3, 8, seed=7))
    assert torch.equal(a, pickle.loads(pickle.dumps(dataset)).global_batch(3, 8, seed=7))
    assert not torch.equal(a, dataset.global_batch(4, 8, seed=7))
    assert not torch.equal(a, dataset.global_batch(3, 8, seed=8))
    assert not torch.equal(a, dataset.global_batch(3, 8, seed=7, split="val"))


def test_val_split_disjoint_from_train(dataset):
    assert dataset.num_val_tokens == 500 and dataset.num_train_tokens == 4500
    train_ends = [dataset.window_starts(s, 64, 0).max() + 17 for s in range(20)]
    val_starts = [dataset.window_starts(s, 64, 0, "val") for s in range(20)]
    assert max(train_ends) <= dataset.num_train_tokens
    assert min(v.min() for v in val_starts) >= dataset.num_train_tokens
    assert max(v.max() + 17 for v in val_starts) <= 5000


def test_val_split_has_minimum_size(tmp_path):
    path = _write_bin(tmp_path / "t.bin", np.zeros(1000))
    ds = TokenDataset(path, seq_len=31, val_fraction=0.001)
    assert ds.num_val_tokens == 4 * 32


def test_short_corpus_raises_with_numbers(tmp_path):
    path = _write_bin(tmp_path / "t.bin", np.zeros(100))
    with pytest.raises(ValueError, match=r"has 100 tokens; --seq-len 64 needs at least 325"):
        TokenDataset(path, seq_len=64)
    with pytest.raises(ValueError, match="100 tokens"):
        TokenDataset(path, seq_len=128, val_fraction=0.0)
    assert TokenDataset(path, seq_len=99, val_fraction=0.0).global_batch(0, 2, 0).shape == (2, 100)


def test_bad_arguments_raise(dataset):
    with pytest.raises(ValueError, match="split"):
        dataset.global_batch(0, 2, 0, split="test")
    with pytest.raises(ValueError, match="step"):
        dataset.global_batch(-1, 2, 0)


def test_rank_slice_is_contiguous(dataset):
    batch = dataset.global_batch(0, 8, 0)
    parts = [rank_slice(batch, r, 4) for r in range(4)]
    assert all(p.shape == (2, 17) for p in parts)
    assert torch.equal(torch.cat(parts), batch)
    with pytest.raises(ValueError, match="not divisible"):
        rank_slice(batch, 0, 3)


def test_default_corpus_is_stdlib(tmp_path):
    out = resolve_data(None, cache_dir=tmp_path)
    assert out.name.startswith("stdlib-") and _no_temp_files(tmp_path)
    meta = read_meta(out)
    assert meta["vocab_size"] == 256 and meta["num_tokens"] == out.stat().st_size // 2
    assert meta["num_tokens"] > 1_000_000
    stdlib = sysconfig.get_paths()["stdlib"]
    head = open(os.path.join(stdlib, "__future__.py"), "rb").read(64)
    assert bytes(np.memmap(out, dtype="<u2", mode="r")[:64].astype(np.uint8)) == head
    mtime = out.stat().st_mtime_ns
    assert resolve_data(None, cache_dir=tmp_path) == out and out.stat().st_mtime_ns == mtime


def test_processes_started_together_tokenize_once(tmp_path):
    """Like every rank of a torchrun node preparing the same corpus at once."""
    import subprocess
    import sys

    text = tmp_path / "a.txt"
    text.write_bytes(b"abc" * 2_000_000)
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
        "from meshwise.data.dataset import resolve_data; "
        f"print(resolve_data({str(text)!r}, {str(tmp_path / 'c')!r}))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(out.count("built corpus") for out in outs) == 1, outs
    assert len({out.strip().splitlines()[-1] for out in outs}) == 1
