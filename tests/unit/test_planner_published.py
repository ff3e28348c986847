"""The GPU profiles held to published runs (``benchmarks/planner_published.py``).

Each run's layout, planned on the profile of the GPUs it ran on, is predicted within
20% of the tokens/s per GPU it reported, and never above a figure measured with eager
PyTorch: meshwise runs eagerly, so it should not be promised more than an eager run
of the same layout was measured to give.
"""

import pytest

from benchmarks.planner_published import PUBLISHED, PublishedRun, predict


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda run: run.name)
def test_each_published_run_is_predicted_within_20_percent(run, tmp_path):
    row = predict(run, tmp_path)
    assert abs(row["error"]) <= 0.20, row
    if run.eager:
        assert row["pred_tokens_per_gpu"] <= row["published_tokens_per_gpu"], row


def test_the_measured_step_on_an_h200_is_predicted_within_10_percent(tmp_path):
    (run,) = [r for r in PUBLISHED if r.model == "llama-1b"]
    assert abs(predict(run, tmp_path)["error"]) <= 0.10


@pytest.mark.parametrize(
    "faster, slower", [("h100", "h100-hbm2e"), ("h200", "h100"), ("h100", "a100")]
)
def test_a_faster_gpu_is_never_predicted_slower(faster, slower, tmp_path):
    # torchtitan's 8B layout: more compute and bandwidth give at least as many tokens
    base = PUBLISHED[0]
    rates = {
        device: predict(PublishedRun(**{**base.__dict__, "device": device}), tmp_path)[
            "pred_tokens_per_gpu"
        ]
        for device in (faster, slower)
    }
    assert rates[faster] > rates[slower]
