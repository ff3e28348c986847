"""``meshwise train`` as a user runs it: a subprocess on a tiny model."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli, run_main

STEPS = 10
METRIC_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "step_time_s",
    "tokens_per_s",
    "grad_sync_bytes",
    "model_state_bytes",
    "peak_rss_bytes",
}


def train_losses(tmp_path, corpus, name, *layout):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_cli(
        "train",
        "--data",
        corpus,
        "--steps",
        STEPS,
        "--metrics",
        metrics,
        *SMALL,
        *layout,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert METRIC_KEYS <= set(records[0])
    return records


def assert_same_curve(reference, other, rtol=1e-4):
    for ref, got in zip(reference, other, strict=True):
        assert abs(got["loss"] - ref["loss"]) <= rtol * abs(ref["loss"]), (ref, got)
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-3 * ref["grad_norm"], (ref, got)


def test_data_parallel_layouts_give_the_same_losses(tmp_path, corpus):
    single = train_losses(tmp_path, corpus, "dp1", "--dp", "1")
    assert single[-1]["loss"] < single[0]["loss"]
    assert single[0]["grad_sync_bytes"] == 0
    dp2 = train_losses(tmp_path, corpus, "dp2", "--dp", "2")
    assert_same_curve(single, dp2)
    assert dp2[0]["grad_sync_bytes"] > 0
    accum = train_losses(tmp_path, corpus, "dp2acc", "--dp", "2", "--grad-accum", "2")
    assert_same_curve(single, accum)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dp", "3"], "--batch-size 8 is not divisible by dp x grad-accum"),
        (["--model", "huge"], "--model 'huge' is not valid; valid: tiny, small, medium"),
        (["--data", "/no/such/path"], "/no/such/path"),
        (["--seq-len", "4096"], "--seq-len 4096 exceeds the model's context"),
        (["--steps", "0"], "--steps must be a finite number > 0, got 0"),
        (["--zero", "5"], "--zero 5 is not valid; valid: 0, 1, 2, 3"),
        (["--seed", "-1"], "--seed must be a finite number >= 0, got -1"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
        (["--clip", "nan"], "--clip must be a finite number >= 0, got nan"),
        (["--beta2", "1"], "--beta2 must be in [0, 1), got 1.0"),
        (["--metrics", "/proc/no/such/m.jsonl"], "--metrics /proc/no/such/m.jsonl: cannot write"),
        (["--timeout-s", "0.001"], "--timeout-s 0.001 is out of range; valid: 1 to 31536000"),
        (["--timeout-s", "1e15"], "--timeout-s 1e+15 is out of range; valid: 1 to 31536000"),
        (
            ["--vocab-size", "3000000000"],
            "the model has 192.00 B parameters (--vocab-size 3000000000",
        ),
        (
            ["--vocab-size", "5000000000"],
            "--vocab-size 5000000000 is more ids than token files hold",
        ),
        (["--token-dtype", "int8"], "--token-dtype 'int8' is not valid; valid: uint16, uint32"),
    ],
)
def test_bad_config_exits_2_with_one_line(tmp_path, corpus, flags, message):
    result = run_main("train", *SMALL, "--data", corpus, *flags, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    "toml, message",
    [
        ("dp = 2.7", "dp = 2.7 is not an integer"),
        ("steps = true", "steps = True is not an integer"),
        ('lr = "1e-3"', "lr = '1e-3' is not a number"),
        ("[trainer]\nsteps = 3", "unknown section [trainer]"),
        ("[optim]\nbatch-size = 4", "'batch-size' belongs under [data], not [optim]"),
        ("stepz = 3", "unknown key 'stepz'"),
        ("steps = 3\n[optim]\nsteps = 4", "'steps' and '[optim] steps' both set --steps; keep one"),
        ("batch-size = 4\nbatch_size = 8", "'batch-size' and 'batch_size' both set --batch-size"),
    ],
)
def test_bad_toml_exits_2_naming_file_and_key(tmp_path, corpus, toml, message):
    config = tmp_path / "run.toml"
    config.write_text(toml + "\n")
    result = run_main("train", *SMALL, "--data", corpus, "--config", config, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"--config {config}: {message}" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_unusable_cache_and_data_exit_2(tmp_path, corpus):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = run_main(
        "train", *SMALL, "--data", corpus, cwd=tmp_path, env_extra={"MESHWISE_CACHE": str(blocker)}
    )
    assert result.returncode == 2, result.stderr
    assert f"cache directory {blocker} (from MESHWISE_CACHE)" in result.stderr
    big = tmp_path / "big.bin"
    np.array([1, 2, 60000] * 400, dtype="<u2").tofile(big)
    result = run_main("train", *SMALL, "--data", big, cwd=tmp_path)
    assert result.returncode == 2 and "--vocab-size (at least 60001)" in result.stderr
    result = run_main("train", *SMALL, "--data", big, "--vocab-size", "1000", cwd=tmp_path)
    assert result.returncode == 2 and "token id 60000, outside --vocab-size 1000" in result.stderr
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short")
    result = run_main("train", *SMALL, "--data", tiny, cwd=tmp_path)
    assert result.returncode == 2
    assert f"the corpus '{tiny}' has 9 tokens; --seq-len 32 needs at least 165" in result.stderr


def test_torchrun_world_size_mismatch_exits_2(tmp_path, corpus):
    env = {
        "RANK": "0",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }
    result = run_cli(
        "train", *SMALL, "--data", corpus, "--dp", "2", cwd=tmp_path, env_extra=env, timeout=60
    )
    assert result.returncode == 2
    assert "torchrun started 3 processes but --dp x --tp x --pp = 2" in result.stderr


def test_failing_rank_ends_the_job_with_its_traceback(tmp_path, corpus):
    start = time.monotonic()
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--dp",
        "2",
        "--steps",
        "50",
        cwd=tmp_path,
        env_extra={"MESHWISE_FAIL_AT": "1:2"},
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "rank 1 failed" in result.stderr
    assert "Traceback" in result.stderr and "injected failure on rank 1 at step 2" in result.stderr
    assert elapsed < 60, f"the job took {elapsed:.0f}s to fail"


def test_non_finite_loss_stops_the_run_with_the_step(tmp_path, corpus):
    # A huge learning rate blows the parameters up after the first update.
    blow_up = ["--lr", "1e30", "--warmup-steps", "0", "--steps", "5", "--dp", "1"]
    result = run_cli("train", *SMALL, "--data", corpus, *blow_up, cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert "non-finite values at step 2" in result.stderr
    assert "Traceback" not in result.stderr  # an expected stop: one line
    # Skipping cannot rescue a diverged model: it stops, never exits 0.
    skipped = run_cli(
        "train", *SMALL, "--data", corpus, *blow_up, "--on-nan", "skip", cwd=tmp_path, timeout=60
    )
    assert skipped.returncode == 1, skipped.stderr
    assert (
        "the weights themselves are non-finite" in skipped.stderr
        or "4 steps in a row skipped (--max-skipped-steps 3)" in skipped.stderr
    )


def test_skip_gets_past_one_bad_step_and_writes_strict_json(tmp_path, corpus):
    metrics = tmp_path / "m.jsonl"
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--dp",
        "2",
        "--steps",
        "4",
        "--on-nan",
        "skip",
        "--metrics",
        metrics,
        cwd=tmp_path,
        timeout=120,
        env_extra={"MESHWISE_FAIL_AT": "0:2:nan"},
    )
    assert result.returncode == 0, result.stderr
    assert "non-finite values at step 2" in result.stderr and "step skipped" in result.stderr
    lines = metrics.read_text().splitlines()
    assert "NaN" not in metrics.read_text()
    records = [json.loads(line) for line in lines]
    assert records[1]["loss"] is None and records[1]["non_finite"] == ["loss"]
    assert all(isinstance(r["loss"], float) for r in records[2:])


def test_ranks_started_with_different_flags_stop_at_once(tmp_path, corpus):
    """Two torchrun-style ranks, one given another --lr: both stop, naming the key."""
    from meshwise.cli.launch import free_port

    env = dict(
        os.environ,
        MESHWISE_CACHE=str(tmp_path / "cache"),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    base = [
        sys.executable,
        "-m",
        "meshwise",
        "train",
        *map(str, SMALL),
        "--data",
        str(corpus),
        "--dp",
        "2",
        "--steps",
        "50",
        "--timeout-s",
        "60",
    ]
    procs = [
        subprocess.Popen(
            base + ["--lr", lr],
            cwd=tmp_path,
            env=dict(env, RANK=str(r)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, lr in enumerate(["3e-3", "1e-3"])
    ]
    start = time.monotonic()
    errs = [p.communicate(timeout=90)[1] for p in procs]
    assert time.monotonic() - start < 60
    for p, err in zip(procs, errs):
        assert p.returncode == 1, err
        assert "rank 1 was started with optim.lr = 0.001 but rank 0 with 0.003" in err, err
        assert "Traceback" not in err


def test_a_full_disk_for_metrics_ends_with_one_line(tmp_path, corpus):
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--steps",
        "3",
        "--metrics",
        "/dev/full",
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "cannot write --metrics /dev/full: No space left on device" in result.stderr
    assert "Traceback" not in result.stderr


def test_effective_config_is_shown_and_kept_and_the_sample_marks_its_prompt(tmp_path, corpus):
    config = tmp_path / "run.toml"
    config.write_text("[optim]\nweight_decay = 0.05\n")
    metrics = tmp_path / "m.jsonl"
    args = [a for a in SMALL if a != "-q"]
    result = run_cli(
        "train",
        *args,
        "--data",
        corpus,
        "--dp",
        "1",
        "--steps",
        "2",
        "--config",
        config,
        "--metrics",
        metrics,
        "--sample-tokens",
        "8",
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "m.jsonl.config.json").read_text())
    assert saved["config"]["optim"]["weight_decay"] == 0.05
    assert saved["origins"]["weight_decay"] == "toml" and saved["origins"]["steps"] == "flag"
    shown = result.stdout + result.stderr
    assert "--weight-decay 0.05  [toml]" in shown and "--steps 2  [flag]" in shown
    assert "sample (prompt in [brackets]):\n[" in shown


def test_a_toml_file_that_is_not_utf8_is_named(tmp_path, corpus):
    config = tmp_path / "run.toml"
    config.write_bytes("# réglages\nsteps = 3\n".encode("latin-1"))
    result = run_main("train", *SMALL, "--data", corpus, "--config", config, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"--config {config}: not UTF-8 text (byte 0xe9 at offset 3)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_max_restarts_says_when_it_gives_up(tmp_path, corpus):
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--dp",
        "1",
        "--steps",
        "4",
        "--save",
        tmp_path / "ck",
        "--max-restarts",
        "1",
        cwd=tmp_path,
        env_extra={"MESHWISE_FAIL_AT": "0:2"},
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "restart 1 of 1 from the beginning" in result.stderr
    assert result.stderr.strip().endswith("gave up: the job failed 2 times (--max-restarts 1)")


def test_max_restarts_under_torchrun_is_refused_before_starting(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr("meshwise.cli.launch.die_with_torchrun", lambda: None)  # not pytest
    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "9",
        "LOCAL_WORLD_SIZE": "1",
    }
    result = run_main(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--dp",
        "2",
        "--save",
        tmp_path / "ck",
        "--max-restarts",
        "2",
        "--timeout-s",
        "5",
        cwd=tmp_path,
        env_extra=env,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "--max-restarts 2 does not work under torchrun (every node would restart on its "
        "own); valid: torchrun --max-restarts 2 with --save DIR --resume auto" in result.stderr
    ), result.stderr
