"""``meshwise data prepare | train-tokenizer`` and ``train --tokenizer`` from the command line."""

import json
import os
import re

import numpy as np
import pytest

from tests.e2e.conftest import SMALL, run_cli, run_main


@pytest.fixture(scope="module")
def tok(tmp_path_factory, corpus):
    """A tokenizer trained by the CLI on the e2e corpus (two stdlib modules)."""
    root = tmp_path_factory.mktemp("tok")
    result = run_main(
        "data",
        "train-tokenizer",
        corpus,
        "--vocab-size",
        512,
        "--out",
        root / "tokenizer.json",
        cwd=root,
    )
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(
        r"wrote \S+tokenizer.json: byte-level BPE, vocab 512; from 1 files "
        r"\(0.2 MB\) in \d+\.\d s\n",
        result.stdout,
    ), result.stdout
    return root / "tokenizer.json"


def test_trained_tokenizer_loads_in_transformers(tok, corpus):
    transformers = pytest.importorskip("transformers")

    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok))
    text = corpus.read_text()[:5000]
    assert fast.decode(fast(text)["input_ids"]) == text and len(fast) == 512


def test_prepare_writes_the_tokens_and_says_how_many(tmp_path, tok, corpus):
    from tokenizers import Tokenizer

    result = run_main(
        "data",
        "prepare",
        corpus,
        "--out",
        tmp_path / "c.bin",
        "--tokenizer",
        tok,
        "--workers",
        2,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    expected = Tokenizer.from_file(str(tok)).encode(corpus.read_text()).ids
    assert np.fromfile(tmp_path / "c.bin", dtype="<u2").tolist() == expected
    assert re.match(
        rf"wrote \S+c.bin: {len(expected):,} uint16 tokens from 1 files in "
        r"\d+\.\d s \(\d+\.\d MB/s, 2 workers\); tokenizer ",
        result.stdout,
    )
    meta = json.loads((tmp_path / "c.bin.meshwise.json").read_text())
    assert meta["tokenizer"]["path"] == str(tok.resolve()) and meta["dtype"] == "uint16"
    again = run_main("data", "prepare", corpus, "--out", tmp_path / "c.bin", cwd=tmp_path)
    assert again.returncode == 0, again.stderr  # ours: replaced, now byte-level
    assert read_bytes_tokens(tmp_path / "c.bin") == corpus.read_bytes()


def read_bytes_tokens(path) -> bytes:
    return bytes(np.fromfile(path, dtype="<u2").astype(np.uint8))


def test_train_with_a_tokenizer_samples_text_and_generate_uses_it(tmp_path, tok, corpus):
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--tokenizer",
        tok,
        "--dp",
        1,
        "--steps",
        3,
        "--sample-tokens",
        12,
        "--save",
        tmp_path / "ckpt",
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    sample = result.stdout.split("sample (prompt in [brackets]):\n[", 1)[1]
    assert not re.fullmatch(r"[\d ]+\].*", sample, re.S)  # text, not token ids
    manifest = next((tmp_path / "ckpt").glob("step-*/manifest.json"))
    data = json.loads(manifest.read_text())["meta"]["config"]["data"]
    assert data["tokenizer"] == str(tok.resolve()) and len(data["tokenizer_digest"]) == 16
    assert json.loads(manifest.read_text())["meta"]["model"]["vocab_size"] == 512
    args = [
        "generate",
        "--checkpoint",
        tmp_path / "ckpt",
        "--prompt",
        "def main(",
        "--max-new-tokens",
        8,
        "--temperature",
        0,
    ]
    generated = run_main(*args, cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("def main(") and len(generated.stdout) > 10
    moved = tmp_path / "elsewhere.json"
    os.rename(tok, moved)
    try:
        missing = run_main(*args, cwd=tmp_path)
        assert missing.returncode == 2 and str(tok.resolve()) in missing.stderr
        assert "pass --tokenizer PATH" in missing.stderr
        assert run_main(*args, "--tokenizer", moved, cwd=tmp_path).stdout == generated.stdout
    finally:
        os.rename(moved, tok)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tok, corpus):
    """Files the bad-input cases point at."""
    root = tmp_path_factory.mktemp("bad")
    (root / "empty").mkdir()
    (root / "not-a-tokenizer.json").write_text('{"hello": "world"}')
    (root / "theirs.bin").write_bytes(b"\1\0\2\0")
    result = run_main("data", "prepare", corpus, "--out", root / "bytes.bin", cwd=root)
    assert result.returncode == 0, result.stderr
    return root


TRAIN = ["train", *SMALL, "--steps", 2, "--dp", 1]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            TRAIN + ["--tokenizer", "missing.json"],
            "--tokenizer missing.json: no such file; expected",
        ),
        (TRAIN + ["--tokenizer", "not-a-tokenizer.json"], "is not a tokenizer.json"),
        (
            TRAIN + ["--tokenizer", "TOK", "--vocab-size", 300],
            "--vocab-size 300 is smaller than the vocabulary of 512",
        ),
        (
            TRAIN + ["--data", "bytes.bin", "--tokenizer", "TOK"],
            "--data bytes.bin was tokenized with byte-level",
        ),
        (
            ["data", "prepare", "CORPUS", "--out", "x.bin", "--workers", 0],
            "--workers must be >= 1, got 0",
        ),
        (["data", "prepare", "empty", "--out", "x.bin"], "holds no text"),
        (["data", "prepare", "nowhere", "--out", "x.bin"], "INPUT nowhere does not exist"),
        (["data", "prepare", "CORPUS", "--out", "x.txt"], "--out x.txt is not valid"),
        (["data", "prepare", "CORPUS", "--out", "theirs.bin"], "was not written by meshwise"),
        (
            ["data", "prepare", "CORPUS", "--out", "x.bin", "--tokenizer", "missing.json"],
            "no such file",
        ),
        (
            ["data", "train-tokenizer", "CORPUS", "--vocab-size", 1, "--out", "t.json"],
            "--vocab-size 1 is not valid",
        ),
        (
            ["data", "train-tokenizer", "empty", "--vocab-size", 300, "--out", "t.json"],
            "holds no text",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(inputs, tok, corpus, args, message):
    given = {"TOK": tok, "CORPUS": corpus}
    result = run_main(*[given.get(a, a) for a in args], cwd=inputs)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (inputs / "x.bin").exists() and not (inputs / "t.json").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_tokenizer_exits_2(tmp_path, tok):
    locked = tmp_path / "tokenizer.json"
    locked.write_bytes(tok.read_bytes())
    locked.chmod(0)
    result = run_main(*TRAIN, "--tokenizer", locked, cwd=tmp_path)
    assert result.returncode == 2 and "cannot read it" in result.stderr


def test_a_prepared_bin_brings_its_tokenizer_and_resume_checks_it(tmp_path, tok, corpus):
    from meshwise.cli.preflight import check_same_tokenizer, prepare_data
    from meshwise.data.tokenizer import load_tokenizer
    from meshwise.train.config import TrainConfig

    result = run_main(
        "data", "prepare", corpus, "--out", tmp_path / "c.bin", "--tokenizer", tok, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    cfg = TrainConfig()
    cfg.data.path = str(tmp_path / "c.bin")
    assert prepare_data(cfg) == tmp_path / "c.bin"
    assert cfg.data.tokenizer == str(tok.resolve()) and cfg.model.vocab_size == 512
    digest = load_tokenizer(cfg.data.tokenizer).digest
    check_same_tokenizer({"data": {"tokenizer_digest": digest}}, cfg, digest)
    with pytest.raises(ValueError, match="trained with the tokenizer byte-level"):
        check_same_tokenizer({"data": {}}, cfg, digest)  # a checkpoint of a byte-level run
