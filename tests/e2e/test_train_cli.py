"""``meshwise train`` as a user runs it: a subprocess on a tiny model."""

import time

import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli

STEPS = 10
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s",
               "grad_sync_bytes", "model_state_bytes", "peak_rss_bytes"}


def train_losses(tmp_path, corpus, name, *layout):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_cli("train", "--data", corpus, "--steps", STEPS, "--metrics", metrics,
                     *SMALL, *layout, cwd=tmp_path)
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


@pytest.mark.parametrize("flags, message", [
    (["--dp", "3"], "--batch-size 8 is not divisible by dp x grad-accum"),
    (["--model", "huge"], "--model 'huge' is not valid; valid: tiny, small, medium"),
    (["--data", "/no/such/path"], "/no/such/path"),
    (["--seq-len", "4096"], "--seq-len 4096 exceeds the model's context"),
    (["--steps", "0"], "--steps must be > 0, got 0"),
    (["--zero", "5"], "--zero 5 is not valid; valid: 0, 1, 2, 3"),
])
def test_bad_config_exits_2_with_one_line(tmp_path, corpus, flags, message):
    args = ["train", *SMALL, "--data", corpus, *flags]
    result = run_cli(*args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_torchrun_world_size_mismatch_exits_2(tmp_path, corpus):
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999"}
    result = run_cli("train", *SMALL, "--data", corpus, "--dp", "2", cwd=tmp_path,
                     env_extra=env, timeout=60)
    assert result.returncode == 2
    assert "torchrun started 3 processes but --dp x --tp x --pp = 2" in result.stderr


def test_failing_rank_ends_the_job_with_its_traceback(tmp_path, corpus):
    start = time.monotonic()
    result = run_cli("train", *SMALL, "--data", corpus, "--dp", "2", "--steps", "50",
                     cwd=tmp_path, env_extra={"MESHWISE_FAIL_AT": "1:2"}, timeout=120)
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
    skipped = run_cli("train", *SMALL, "--data", corpus, *blow_up, "--on-nan", "skip",
                      cwd=tmp_path, timeout=60)
    assert skipped.returncode == 0, skipped.stderr
    assert "non-finite values at step 2" in skipped.stderr and "step skipped" in skipped.stderr
