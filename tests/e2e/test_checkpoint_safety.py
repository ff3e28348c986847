"""What no second job, rollback, damage or full disk may do to a ``--save`` directory.

Each test acts as a user would (the CLI, in a subprocess where ranks must really
run, in-process where the job must stop before any rank starts) and checks the
directory afterwards.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import SMALL, in_small_filesystem, run_cli, run_main

pytestmark = pytest.mark.timeout(240)
# Runs here go on past the --steps they started with: a schedule that does not stretch.
RUN = [*SMALL, "--lr-schedule", "constant"]


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))


def _train(tmp_path, corpus, *flags, steps=6, timeout=120):
    return run_cli(
        "train",
        *RUN,
        "--data",
        corpus,
        "--dp",
        "1",
        "--steps",
        steps,
        *flags,
        cwd=tmp_path,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, corpus) -> Path:
    """A finished run's ``--save`` directory: steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("saved")
    result = _train(root, corpus, "--save", root / "C", "--save-every", 2)
    assert result.returncode == 0, result.stderr
    assert _steps(root / "C") == ["step-00000002", "step-00000004", "step-00000006"]
    return root / "C"


def _copy(saved_run, tmp_path) -> Path:
    save = tmp_path / "C"
    shutil.copytree(saved_run, save, symlinks=True)
    return save


def test_a_rollback_keeps_its_source_and_branches_only_when_asked(tmp_path, corpus, saved_run):
    save = _copy(saved_run, tmp_path)
    rollback = [
        "--save",
        save,
        "--save-every",
        1,
        "--resume",
        save / "step-00000002",
        "--keep-last",
        1,
    ]
    refused = run_main(
        "train", *RUN, "--data", corpus, "--dp", "1", "--steps", 8, *rollback, cwd=tmp_path
    )
    assert refused.returncode == 2, refused.stderr
    assert "step-00000004, step-00000006" in refused.stderr and "--branch" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert _steps(save) == ["step-00000002", "step-00000004", "step-00000006"]  # untouched

    branched = _train(tmp_path, corpus, *rollback, "--branch", steps=8)
    assert branched.returncode == 0, branched.stderr
    # The source stays (a rollback never deletes what it resumed from); of this run's own
    # checkpoints the newest is kept; the abandoned steps were set aside, whole.
    assert _steps(save) == ["step-00000002", "step-00000008"]
    aside = [p for p in save.iterdir() if p.name.startswith("set-aside-")]
    assert len(aside) == 1 and _steps(aside[0]) == ["step-00000004", "step-00000006"]
    manifest = json.loads((save / "step-00000008" / "manifest.json").read_text())
    parent = json.loads((save / "step-00000002" / "manifest.json").read_text())
    assert manifest["meta"]["lineage"]["ancestors"] == [[parent["meta"]["lineage"]["run"], 2]]


def test_a_damaged_newer_step_is_named_before_training(tmp_path, corpus, saved_run):
    save = _copy(saved_run, tmp_path)
    (save / "step-00000006" / "manifest.json").unlink()
    result = run_main(
        "train",
        *RUN,
        "--data",
        corpus,
        "--dp",
        "1",
        "--steps",
        8,
        "--save",
        save,
        "--resume",
        "auto",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "step-00000006 (no manifest.json" in result.stderr and "step 4" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not [p for p in save.iterdir() if p.name.startswith(".tmp-")]


def test_keep_last_removes_a_symlinked_checkpoint_as_a_link(tmp_path, corpus, saved_run):
    save = _copy(saved_run, tmp_path)
    elsewhere = tmp_path / "elsewhere" / "step-00000002"
    elsewhere.parent.mkdir()
    (save / "step-00000002").rename(elsewhere)
    (save / "step-00000002").symlink_to(elsewhere)
    result = _train(tmp_path, corpus, "--save", save, "--resume", "auto", "--keep-last", 1, steps=7)
    assert result.returncode == 0, result.stderr
    assert _steps(save) == ["step-00000006", "step-00000007"]  # the source, the newest
    assert (elsewhere / "manifest.json").is_file()  # the link went, not its target


def test_leftovers_of_a_dead_job_are_removed_at_start(tmp_path, corpus, saved_run):
    save = _copy(saved_run, tmp_path)
    dead = save / ".tmp-step-00000007-20240101-000000-dead00"
    dead.mkdir()
    (dead / "rank-00000.safetensors").write_bytes(b"partial")
    (save / ".meshwise-lock").write_text('{"pid": 999999, "host": "gone"}\n')  # a crash's lock
    result = _train(tmp_path, corpus, "--save", save, "--resume", "auto", steps=7)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in save.iterdir()) == [
        "step-00000002",
        "step-00000004",
        "step-00000006",
        "step-00000007",
    ]


@pytest.mark.parametrize("trial", range(5))
def test_two_jobs_started_together_never_share_a_save_directory(tmp_path, corpus, trial):
    save = tmp_path / "S"
    env = dict(os.environ, MESHWISE_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    jobs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshwise",
                "train",
                *map(str, RUN),
                "--data",
                str(corpus),
                "--dp",
                "1",
                "--steps",
                "4",
                "--save",
                str(save),
                "--save-every",
                "1",
                "--seed",
                str(seed),
            ],
            cwd=tmp_path,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    errs = [job.communicate(timeout=120)[1] for job in jobs]
    codes = sorted(job.returncode for job in jobs)
    assert codes == [0, 2], errs
    loser = errs[[job.returncode for job in jobs].index(2)]
    # Started together, the second finds the directory locked; had it started only after
    # the first ended, it would find its checkpoints (a fresh run does not write there).
    assert "is in use by another meshwise job" in loser or "already holds checkpoints" in loser
    assert len(loser.strip().splitlines()) == 1, loser
    winner_seed = 1 + [job.returncode for job in jobs].index(0)
    for step in _steps(save):  # every checkpoint is the winner's, whole and verified
        meta = json.loads((save / step / "manifest.json").read_text())["meta"]
        assert meta["config"]["data"]["seed"] == winner_seed
        check = run_main("export", save / step, "--out", tmp_path / f"x{step}", cwd=tmp_path)
        assert check.returncode == 0, check.stderr
    assert not (save / ".meshwise-lock").exists()


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_a_damaged_manifest_stops_the_job_before_any_rank(tmp_path, corpus, saved_run, where):
    save = _copy(saved_run, tmp_path)
    manifest = save / "step-00000006" / "manifest.json"
    data = bytearray(manifest.read_bytes())
    data[int(len(data) * where)] ^= 0x04  # one bit, as a bad disk flips it
    manifest.write_bytes(bytes(data))
    result = run_main(
        "train",
        *RUN,
        "--data",
        corpus,
        "--dp",
        "1",
        "--steps",
        8,
        "--resume",
        manifest.parent,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "manifest" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _train_command(tmp_path, corpus, *flags) -> list[str]:
    return [
        sys.executable,
        "-m",
        "meshwise",
        "train",
        *map(str, RUN),
        "--data",
        str(corpus),
        "--dp",
        "1",
        *map(str, flags),
    ]


@pytest.mark.parametrize("keep_last", [None, 2])
def test_a_full_disk_prunes_first_or_says_what_is_needed(tmp_path, corpus, keep_last):
    """Room for two and a half checkpoints (1.6 MB each): the third fits only if --keep-last
    prunes before writing; without it the save fails with one line, the others intact."""
    save = tmp_path / "S"
    flags = ["--steps", 4, "--save", save, "--save-every", 1, "--metrics", tmp_path / "m.jsonl"]
    flags += ["--keep-last", keep_last] if keep_last else []
    env_cache = ["env", f"MESHWISE_CACHE={tmp_path / 'cache'}"]
    start = time.monotonic()
    result = in_small_filesystem(
        "4608k", save, [*env_cache, *_train_command(tmp_path, corpus, *flags)], timeout=180
    )
    took = time.monotonic() - start
    if keep_last:
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in (tmp_path / "S-after").iterdir()) == [
            "step-00000003",
            "step-00000004",
        ]
        return
    assert result.returncode == 1, result.stderr
    line = [ln for ln in result.stderr.splitlines() if "cannot save step 3" in ln]
    assert line and "the checkpoint needs about" in line[0] and "free" in line[0], result.stderr
    assert "Traceback" not in result.stderr and took < 120
    # The earlier checkpoints are whole; nothing half-written is left.
    assert sorted(p.name for p in (tmp_path / "S-after").iterdir()) == [
        "step-00000001",
        "step-00000002",
    ]


def test_too_small_a_disk_for_one_checkpoint_exits_2(tmp_path, corpus):
    save = tmp_path / "S"
    result = in_small_filesystem(
        "256k",
        save,
        [
            "env",
            f"MESHWISE_CACHE={tmp_path / 'cache'}",
            *_train_command(tmp_path, corpus, "--steps", 3, "--save", save),
        ],
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "one checkpoint of this run needs about" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
