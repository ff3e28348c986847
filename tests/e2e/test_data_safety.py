"""Data that cannot silently train on garbage, hang, or leave temporaries behind.

Bad data must stop ``meshwise train`` before any rank starts (in-process runs:
exit 2 with one line naming the file); interruptions are real signals to real
processes, each bounded in time.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.conftest import SMALL, in_small_filesystem, run_main

pytestmark = pytest.mark.timeout(120)


def _one_line(result, code=2):
    assert result.returncode == code, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--dp", "2"]])
def test_ids_past_the_vocabulary_are_refused_on_every_layout(tmp_path, corpus, layout):
    prepared = tmp_path / "c.bin"
    assert run_main("data", "prepare", corpus, "--out", prepared, cwd=tmp_path).returncode == 0
    ids = np.memmap(prepared, dtype="<u2", mode="r+")
    ids[np.random.default_rng(0).choice(len(ids), len(ids) // 100, replace=False)] = 60000
    ids.flush()
    del ids  # the sidecar is left as it was: only the tokens changed
    err = _one_line(run_main("train", *SMALL, "--data", prepared, *layout, cwd=tmp_path))
    assert "holds token id 60000, outside the vocabulary of 256" in err, err


def test_chat_data_truncated_to_no_reply_is_refused_before_training(tmp_path):
    # Every conversation longer than a row, its reply past the cut: nothing to learn.
    chats = [
        [
            {"role": "user", "content": f"Please add {a} and {a + 7} for me, thank you."},
            {"role": "assistant", "content": str(2 * a + 7)},
        ]
        for a in range(121)
    ]
    data = tmp_path / "chat_long.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    flags = ("--format", "chat", "--chat-template", "chatml", "--steps", "2")
    result = run_main("train", "--data", data, *SMALL, *flags, cwd=tmp_path)
    line = _one_line(result)
    assert "keep no assistant token to learn from" in line, line
    assert "valid: --seq-len" in line and "--long-conversations" in line, line


def test_the_largest_id_is_scanned_once_per_version_of_the_file(tmp_path, corpus):
    from meshwise.data.dataset import TokenDataset, sidecar_path

    prepared = tmp_path / "c.bin"
    assert run_main("data", "prepare", corpus, "--out", prepared, cwd=tmp_path).returncode == 0
    TokenDataset(prepared, 32)
    scanned = json.loads(sidecar_path(prepared).read_text())["scanned"]
    assert scanned == {"bytes": prepared.stat().st_size, "mtime_ns": prepared.stat().st_mtime_ns}


def test_a_bin_without_sidecar_that_could_be_uint32_needs_its_dtype(tmp_path, corpus):
    from meshwise.data.dataset import TokenDataset

    wide = tmp_path / "wide.bin"
    np.frombuffer(corpus.read_bytes(), dtype=np.uint8).astype("<u4").tofile(wide)
    err = _one_line(run_main("train", *SMALL, "--data", wide, cwd=tmp_path))
    assert "could hold uint16 or uint32 ids" in err and "--token-dtype uint32" in err, err
    assert not Path(str(wide) + ".meshwise.json").exists()
    data = TokenDataset(wide, 32, token_dtype="uint32")  # said once, recorded in the sidecar
    assert data.vocab_size == max(corpus.read_bytes()) + 1 and data.dtype == np.dtype("<u4")
    err = _one_line(
        run_main("train", *SMALL, "--data", wide, "--token-dtype", "uint16", cwd=tmp_path)
    )
    assert "--token-dtype uint16, but" in err and "records uint32" in err, err


def test_a_fifo_is_refused_or_skipped_naming_it(tmp_path, corpus, caplog):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_bytes(corpus.read_bytes())
    os.mkfifo(folder / "b.txt")  # opening it to read would wait for a writer forever
    err = _one_line(run_main("train", *SMALL, "--data", folder / "b.txt", cwd=tmp_path))
    assert "b.txt' is not a regular file (a FIFO)" in err, err
    result = run_main("data", "prepare", folder, "--out", tmp_path / "d.bin", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"skipping {folder / 'b.txt'}: not a regular file (a FIFO)" in caplog.text


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_a_bad_symlink_in_the_data_is_named_not_the_cache_or_out(tmp_path, corpus, kind):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_bytes(corpus.read_bytes())
    bad = folder / "b.txt"
    bad.symlink_to(folder / "gone.txt" if kind == "dangling" else bad)
    what = "a symbolic link to nothing" if kind == "dangling" else "a symbolic link loop"
    for args in (
        ["train", *SMALL, "--data", folder],
        ["data", "prepare", folder, "--out", tmp_path / "d.bin"],
    ):
        err = _one_line(run_main(*args, cwd=tmp_path))
        assert f"{bad} is {what}" in err and "cache" not in err and "--out" not in err, err


@pytest.fixture(scope="module")
def long_line(tmp_path_factory, corpus):
    """A BPE tokenizer and 8 MB of text on one line: seconds of encoding in one piece."""
    root = tmp_path_factory.mktemp("long")
    assert (
        run_main(
            "data",
            "train-tokenizer",
            corpus,
            "--vocab-size",
            "1000",
            "--out",
            root / "tok.json",
            cwd=root,
        ).returncode
        == 0
    )
    words = corpus.read_text().split()
    (root / "one.txt").write_text(" ".join(words * (8_000_000 // len(" ".join(words)) + 1)))
    return root


def _stop_while_encoding(command, cwd, temp_glob, signum, whole_group):
    """Start ``command``, wait until its temp file exists, signal it; (rc, stderr, seconds)."""
    env = dict(os.environ, MESHWISE_CACHE=str(cwd / "cache"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshwise", *map(str, command)],
        cwd=cwd,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(cwd.glob(temp_glob)) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)  # polling for the temp file, not standing in for work
        assert list(cwd.glob(temp_glob)), "encoding never started"
        time.sleep(0.5)  # well inside the encoding, which takes seconds
        start = time.monotonic()
        (os.killpg if whole_group else os.kill)(proc.pid, signum)
        err = proc.communicate(timeout=60)[1]
        return proc.returncode, err, time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "signum, whole_group",
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["ctrl-c", "sigterm"],
)
def test_data_prepare_stops_at_once_and_leaves_nothing(tmp_path, long_line, signum, whole_group):
    out = tmp_path / "out"
    out.mkdir()
    command = [
        "data",
        "prepare",
        long_line / "one.txt",
        "--out",
        out / "one.bin",
        "--tokenizer",
        long_line / "tok.json",
        "--workers",
        "2",
    ]
    code, err, took = _stop_while_encoding(
        command, tmp_path, "out/.one.bin.*.tmp", signum, whole_group
    )
    assert code == 128 + signum, err
    assert took < 5, f"took {took:.1f} s to stop"  # well under 1 s on an idle machine
    assert "Traceback" not in err and "stopped, nothing written" in err, err
    assert list(out.iterdir()) == []


def test_sigterm_during_a_corpus_build_leaves_no_temporary(tmp_path, long_line):
    command = [
        "train",
        *SMALL,
        "--data",
        long_line / "one.txt",
        "--tokenizer",
        long_line / "tok.json",
    ]
    code, err, took = _stop_while_encoding(
        command, tmp_path, "cache/.one-*.bin.*.tmp", signal.SIGTERM, False
    )
    assert code == 128 + signal.SIGTERM, err
    assert took < 5 and "Traceback" not in err, err
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


def test_a_full_disk_leaves_no_half_metrics_line(tmp_path, corpus):
    disk = tmp_path / "M"
    result = in_small_filesystem(
        "8k",
        disk,
        [
            "env",
            f"MESHWISE_CACHE={tmp_path / 'cache'}",
            sys.executable,
            "-m",
            "meshwise",
            "train",
            *SMALL,
            "--data",
            corpus,
            "--dp",
            "1",
            "--steps",
            "200",
            "--metrics",
            disk / "m.jsonl",
        ],
        timeout=100,
    )
    assert result.returncode == 1, result.stderr
    assert "cannot write --metrics" in result.stderr and "No space left" in result.stderr
    text = (tmp_path / "M-after" / "m.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
