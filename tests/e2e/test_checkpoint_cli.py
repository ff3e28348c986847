"""Checkpoints as a user meets them: save, resume, reshard, damage, a killed rank."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli, run_main

STEPS = 10


def _train(tmp_path, corpus, name, *flags, steps=STEPS):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--steps",
        steps,
        "--metrics",
        metrics,
        *flags,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    return {r["step"]: r for r in read_metrics(metrics)}, result


def _saved_run(tmp_path, corpus, name, *layout):
    """An uninterrupted run that saves at step 5 and at the end."""
    records, _ = _train(
        tmp_path, corpus, name, *layout, "--save", tmp_path / name, "--save-every", 5
    )
    assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["step-00000005", "step-00000010"]
    return records, tmp_path / name / "step-00000005"


@pytest.mark.parametrize(
    "layout",
    [
        ["--dp", "2", "--zero", "1"],
        ["--dp", "2", "--tp", "2", "--pp", "2"],
        ["--dp", "2", "--zero", "3", "--dtype", "bf16"],
        # The resume lands inside top-k's density ramp, with
        # errors carried: both must come back.
        [
            "--dp",
            "2",
            "--compress",
            "topk:0.05",
            "--compress-warmup-steps",
            "2",
            "--topk-ramp-steps",
            "6",
        ],
        ["--dp", "2", "--zero", "2", "--compress", "powersgd:2", "--compress-warmup-steps", "2"],
        ["--dp", "2", "--compress", "int8", "--allreduce", "ring"],
    ],
    ids=["dp2-zero1", "dp2-tp2-pp2", "dp2-zero3-bf16", "topk-ramp", "zero2-powersgd", "int8-ring"],
)
def test_same_layout_resume_is_bit_exact(tmp_path, corpus, layout):
    whole, step5 = _saved_run(tmp_path, corpus, "whole", *layout)
    resumed, result = _train(tmp_path, corpus, "resumed", *layout, "--resume", step5)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    assert [resumed[s]["loss"] for s in resumed] == [whole[s]["loss"] for s in resumed]
    assert [resumed[s]["grad_norm"] for s in resumed] == [whole[s]["grad_norm"] for s in resumed]


@pytest.mark.parametrize(
    "saved, loaded",
    [
        (["--dp", "2", "--zero", "3"], ["--tp", "2", "--pp", "2"]),
        (["--tp", "2"], ["--dp", "2", "--zero", "2"]),
        # ZeRO-3 shards over dp x cp, read back by 4 cp ranks at ZeRO-1
        (["--dp", "2", "--cp", "2", "--zero", "3"], ["--cp", "4", "--zero", "1"]),
    ],
    ids=["dp2-zero3-to-tp2-pp2", "tp2-to-dp2-zero2", "dp2-cp2-zero3-to-cp4"],
)
def test_another_layout_resumes_within_round_off(tmp_path, corpus, saved, loaded):
    whole, step5 = _saved_run(tmp_path, corpus, "whole", *saved)
    resumed, _ = _train(tmp_path, corpus, "resumed", *loaded, "--resume", step5)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for step, record in resumed.items():
        assert abs(record["loss"] - whole[step]["loss"]) <= 1e-4 * whole[step]["loss"]
    # One process generates from whatever layout saved it (cp 1 at inference).
    generated = run_cli(
        "generate",
        "--checkpoint",
        step5,
        "--prompt",
        "def ",
        "--max-new-tokens",
        8,
        "--temperature",
        0,
        cwd=tmp_path,
    )
    assert generated.returncode == 0 and generated.stdout.startswith("def "), generated.stderr


def test_keep_last_and_resume_auto(tmp_path, corpus):
    save = tmp_path / "ckpts"
    constant = ("--lr-schedule", "constant")  # the longer run continues its schedule
    fresh, _ = _train(
        tmp_path,
        corpus,
        "fresh",
        "--save",
        save,
        "--save-every",
        2,
        "--keep-last",
        2,
        "--resume",
        "auto",
        *constant,
        steps=6,
    )
    assert sorted(fresh) == list(range(1, 7))  # nothing to resume: started fresh
    assert sorted(p.name for p in save.iterdir()) == ["step-00000004", "step-00000006"]
    # A save that died half way is not a checkpoint: auto skips it.
    (save / ".tmp-step-00000008").mkdir()
    (save / ".tmp-step-00000008" / "rank-00000.safetensors").write_bytes(b"partial")
    more, _ = _train(
        tmp_path, corpus, "more", "--save", save, "--resume", "auto", *constant, steps=8
    )
    assert sorted(more) == [7, 8]  # from step 6, the newest complete checkpoint


def _damage(path: Path, how: str) -> str:
    victim = path / "rank-00001.safetensors"
    if how == "missing":
        victim.unlink()
        return "missing from the checkpoint"
    if how == "truncated":
        victim.write_bytes(victim.read_bytes()[:-100])
        return "truncated"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x55
    victim.write_bytes(bytes(data))
    return "checksum mismatch"


def test_damaged_checkpoint_exits_2_naming_the_file(tmp_path, corpus):
    _, step5 = _saved_run(tmp_path, corpus, "run", "--dp", "2")
    for how in ("missing", "truncated", "corrupted"):
        damaged = tmp_path / how
        shutil.copytree(step5, damaged)
        message = _damage(damaged, how)
        result = run_main(
            "train", *SMALL, "--data", corpus, "--dp", "2", "--resume", damaged, cwd=tmp_path
        )
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "rank-00001.safetensors" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_bad_checkpoint_flags_exit_2(tmp_path, corpus):
    _, step5 = _saved_run(tmp_path, corpus, "run")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cases = [
        (["--resume", step5, "--d-model", "32"], "holds a model with d_model 64"),
        (["--resume", tmp_path / "nowhere"], "no such file or directory"),
        (["--resume", blocker.parent / "corpus"], "neither a checkpoint"),
        (["--save", blocker / "sub"], "cannot write there"),
        (["--save", tmp_path / "s", "--save-every", "0"], "--save-every must be >= 1, got 0"),
        (["--save", tmp_path / "s", "--keep-last", "0"], "--keep-last must be >= 1, got 0"),
        (["--save-every", "2"], "--save-every needs --save DIR"),
        (["--resume", "auto"], "--resume auto needs --save DIR"),
        (["--save", step5.parent], "already holds checkpoints (newest: step-00000010)"),
    ]
    (tmp_path / "corpus").mkdir()
    for flags, message in cases:
        result = run_main("train", *SMALL, "--data", corpus, *flags, cwd=tmp_path)
        assert result.returncode == 2, (flags, result.stderr)
        assert message in result.stderr, (flags, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in step5.parent.iterdir()) == ["step-00000005", "step-00000010"]


def _rank_pids(launcher_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def test_sigkilled_rank_restarts_from_the_newest_checkpoint(tmp_path, corpus):
    steps = 40
    reference, _ = _train(tmp_path, corpus, "reference", "--dp", "2", steps=steps)
    metrics = tmp_path / "killed.jsonl"
    env = dict(os.environ, MESHWISE_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshwise",
            "train",
            *SMALL,
            "--data",
            str(corpus),
            "--dp",
            "2",
            "--steps",
            str(steps),
            "--metrics",
            str(metrics),
            "--save",
            str(tmp_path / "ck"),
            "--save-every",
            "5",
            "--max-restarts",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = False
    deadline = time.monotonic() + 120
    while not killed and proc.poll() is None and time.monotonic() < deadline:
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        ranks = _rank_pids(proc.pid)
        if done >= 7 and len(ranks) == 2:
            os.kill(max(ranks), signal.SIGKILL)  # the last spawned: rank 1
            killed = True
        time.sleep(0.005)  # polling the metrics file, not standing in for work
    out, err = proc.communicate(timeout=180)
    assert killed, f"the run ended before a rank could be killed:\n{err}"
    assert proc.returncode == 0, err
    assert "signal SIGKILL" in err and "restart 1 of 1 from" in err
    restarted = {r["step"]: r for r in read_metrics(metrics)}
    assert sorted(restarted) == list(range(1, steps + 1))
    assert [restarted[s]["loss"] for s in restarted] == [reference[s]["loss"] for s in restarted]
