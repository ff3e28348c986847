"""Token files of both dtypes, and corpora encoded in parallel with a tokenizer."""

import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from meshwise.data import corpus
from meshwise.data import files as data_files
from meshwise.data.bpe import save_tokenizer, train_bpe
from meshwise.data.dataset import TokenDataset, read_meta, resolve_data, sidecar_path
from meshwise.data.token_files import _atomic_write, _write_meta, check_tokenizer, exclusive_build
from meshwise.data.tokenizer import load_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
LLAMA3_VOCAB = 128_256


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory) -> Path:
    texts = [(STDLIB / name).read_text() for name in ("inspect.py", "argparse.py")]
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    save_tokenizer(train_bpe(texts, 600), path)
    return path


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory) -> Path:
    """A word-level tokenizer with Llama 3's 128,256 ids, end-of-text at 128,001 as there."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(128_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(
        ["<|begin_of_text|>", "<|end_of_text|>"]
        + [f"<|reserved_special_token_{i}|>" for i in range(254)]
    )
    path = tmp_path_factory.mktemp("wide") / "tokenizer.json"
    tok.save(str(path))
    return path


def _documents(root: Path, sizes: dict[str, int]) -> Path:
    """A folder of stdlib text cut to ``sizes`` bytes per file (0: an empty document)."""
    source = (STDLIB / "argparse.py").read_bytes() + (STDLIB / "inspect.py").read_bytes()
    root.mkdir()
    for name, size in sizes.items():
        (root / name).write_bytes(source[:size])
    (root / "blob.dat").write_bytes(b"\0binary")  # skipped
    return root


def test_uint32_file_round_trips_through_token_dataset(tmp_path):
    ids = (np.arange(3000, dtype=np.int64) * 97 + 60_000) % LLAMA3_VOCAB  # many above 65,535
    path = tmp_path / "wide.bin"
    ids.astype("<u4").tofile(path)
    _write_meta(
        path,
        {
            "num_tokens": len(ids),
            "vocab_size": LLAMA3_VOCAB,
            "max_token": None,
            "source": "test",
            "dtype": "uint32",
        },
    )
    ds = TokenDataset(path, seq_len=16)
    assert ds.vocab_size == LLAMA3_VOCAB and ds.dtype == np.dtype("<u4")
    batch = ds.global_batch(0, 4, seed=0)
    for row, start in zip(batch, ds.window_starts(0, 4, 0)):
        assert row.tolist() == ids[start : start + 17].tolist()
    assert batch.max() > 65_535


def test_uint16_is_the_default_without_our_sidecar(tmp_path):
    path = tmp_path / "plain.bin"
    np.arange(500, dtype="<u2").tofile(path)
    ds = TokenDataset(path, seq_len=8, vocab_size=500)
    assert ds.dtype == np.dtype("<u2") and read_meta(path)["dtype"] == "uint16"
    assert ds.global_batch(0, 2, 0)[0].tolist() == list(
        range(ds.window_starts(0, 2, 0)[0], ds.window_starts(0, 2, 0)[0] + 9)
    )


def test_a_changed_token_file_is_refused_not_rescanned(tmp_path, bpe_path):
    (tmp_path / "a.txt").write_text("def f():\n    return 1\n" * 100)
    out = corpus.build_token_file(
        tmp_path / "a.bin", [tmp_path / "a.txt"], load_tokenizer(bpe_path), "a.txt"
    )
    assert out["dtype"] == "uint16"
    with open(tmp_path / "a.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="changed since meshwise wrote it; prepare it again"):
        read_meta(tmp_path / "a.bin")


def _expected(path: Path, files: list[Path]) -> list[int]:
    """Each document encoded whole by the tokenizers library itself, joined by <|endoftext|>."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    out: list[int] = []
    for i, file in enumerate(files):
        out += [tok.token_to_id("<|endoftext|>")] if i else []
        out += tok.encode(file.read_text(), add_special_tokens=False).ids
    return out


def test_two_workers_give_the_tokens_of_one_process_in_order(tmp_path, bpe_path, monkeypatch):
    # Small pieces and tasks, so the long documents are cut and the tasks many.
    monkeypatch.setattr(corpus, "PIECE_BYTES", 2048)
    monkeypatch.setattr(corpus, "TASK_BYTES", 4096)
    sizes = {"a.py": 40_000, "b.py": 0, "c.py": 900, "d.py": 60_000, "e.py": 5_000}
    root = _documents(tmp_path / "docs", sizes)
    files = [root / name for name in sorted(sizes)]
    tokenizer = load_tokenizer(bpe_path)
    pieces, _ = corpus.plan_pieces(files, tokenizer)
    assert len(pieces) > 2 * len(files)  # long documents were cut
    built = {}
    for workers in (1, 2):
        dest = tmp_path / f"w{workers}.bin"
        listed = [root / name for name in data_files.list_files(root)]  # blob.dat among them
        stats = corpus.build_token_file(dest, listed, tokenizer, str(root), num_workers=workers)
        assert stats["files"] == 5 and stats["skipped"] == 1
        built[workers] = np.fromfile(dest, dtype="<u2").tolist()
    assert built[2] == built[1] == _expected(bpe_path, files)
    meta = read_meta(tmp_path / "w2.bin")
    assert meta["tokenizer"]["digest"] == tokenizer.digest and meta["vocab_size"] == 600


def test_a_128k_vocabulary_gives_a_uint32_file(tmp_path, wide_path):
    words = [f"w{i}" for i in (5, 70_000, 127_999, 65_536, 1)] * 40
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(" ".join(words))
    (tmp_path / "docs" / "b.txt").write_text(" ".join(reversed(words)))
    tokenizer = load_tokenizer(wide_path)
    assert tokenizer.vocab_size == 128_256 and tokenizer.separator == (128_001,)
    path = resolve_data(tmp_path / "docs", tmp_path / "cache", tokenizer)
    meta = json.loads(sidecar_path(path).read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 128_256
    ids = np.fromfile(path, dtype="<u4").tolist()
    assert (
        ids
        == [5, 70_000, 127_999, 65_536, 1] * 40 + [128_001] + [1, 65_536, 127_999, 70_000, 5] * 40
    )
    ds = TokenDataset(path, seq_len=32, val_fraction=0.0)
    assert ds.vocab_size == 128_256 and ds.global_batch(0, 8, 0).max() > 65_535


def test_the_cache_key_holds_the_tokenizer(tmp_path, bpe_path):
    (tmp_path / "a.txt").write_text("x = 1\n" * 300)
    by_bytes = resolve_data(tmp_path / "a.txt", tmp_path / "c")
    by_bpe = resolve_data(tmp_path / "a.txt", tmp_path / "c", load_tokenizer(bpe_path))
    assert by_bpe != by_bytes and read_meta(by_bpe)["vocab_size"] == 600
    assert resolve_data(tmp_path / "a.txt", tmp_path / "c", load_tokenizer(bpe_path)) == by_bpe


def test_a_bin_names_the_tokenizer_that_wrote_it(tmp_path, bpe_path, wide_path):
    (tmp_path / "a.txt").write_text("x = 1\n" * 300)
    path = resolve_data(tmp_path / "a.txt", tmp_path / "c", load_tokenizer(bpe_path))
    check_tokenizer(read_meta(path), load_tokenizer(bpe_path), path)
    with pytest.raises(ValueError) as err:
        resolve_data(path, tokenizer=load_tokenizer(wide_path))
    message = str(err.value)
    assert str(bpe_path.resolve()) in message and str(wide_path.resolve()) in message
    raw = tmp_path / "raw.bin"
    np.array([1, 700], dtype="<u2").tofile(raw)
    with pytest.raises(ValueError, match="holds token id 700, outside the vocabulary"):
        resolve_data(raw, tokenizer=load_tokenizer(bpe_path))


def test_a_byte_level_bin_from_before_tokenizers_is_known_as_byte_level(tmp_path, bpe_path):
    path = tmp_path / "old.bin"
    np.frombuffer(b"hello", np.uint8).astype("<u2").tofile(path)
    _write_meta(path, {"num_tokens": 5, "vocab_size": 256, "max_token": None, "source": "x"})
    with pytest.raises(
        ValueError, match="tokenized with byte-level, not with --tokenizer .*valid: no --tokenizer"
    ):
        resolve_data(path, tokenizer=load_tokenizer(bpe_path))


def test_token_files_get_the_usual_permissions(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    saved = os.umask(0o022)
    try:
        out = resolve_data(tmp_path / "a.txt", tmp_path / "c")
    finally:
        os.umask(saved)
    assert out.stat().st_mode & 0o777 == 0o644
    assert sidecar_path(out).stat().st_mode & 0o777 == 0o644


def test_a_build_first_removes_what_a_killed_builder_of_that_file_left(tmp_path):
    """A builder killed between writing and renaming leaves a hidden temporary; the next
    build of that file removes it (and no other file's), and leaves no lock behind."""
    dest = tmp_path / "corpus.bin"
    stale, others = tmp_path / ".corpus.bin.k3j2.tmp", tmp_path / ".other.bin.k3j2.tmp"
    stale.write_bytes(b"half")
    others.write_bytes(b"half")
    with exclusive_build(dest):
        _atomic_write(dest, [b"\x01\x00"])
    assert dest.read_bytes() == b"\x01\x00"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.bin.k3j2.tmp", "corpus.bin"]
