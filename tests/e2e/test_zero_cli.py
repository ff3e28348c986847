"""``meshwise train --zero Z``: every ZeRO stage trains exactly like stage 0.

Same global batches, same AdamW arithmetic: only the layout of parameters,
gradients and optimizer state changes, so per-step losses and gradient norms
match stage 0 up to fp32 re-association, while the model-state bytes per rank
fall stage by stage (ZeRO, Rajbhandari et al. 2020, section 5).

Each CLI run takes seconds, so runs are cached per module: the stage-0
reference runs once and tests share it.
"""

import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli

STEPS = 10
RTOL = 1e-4


@pytest.fixture(scope="module")
def train(tmp_path_factory, corpus):
    """``train(*layout)``: the metrics records of a 10-step run, each layout run once."""
    workdir = tmp_path_factory.mktemp("zero_cli")
    cache: dict[tuple, list[dict]] = {}

    def run(*layout) -> list[dict]:
        key = tuple(map(str, layout))
        if key not in cache:
            metrics = workdir / f"{'_'.join(key).replace('-', '')}.jsonl"
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
                cwd=workdir,
            )
            assert result.returncode == 0, result.stderr
            records = read_metrics(metrics)
            assert [r["step"] for r in records] == list(range(1, STEPS + 1))
            cache[key] = records
        return cache[key]

    return run


@pytest.fixture(scope="module")
def zero0(train):
    return train("--dp", "2", "--zero", "0")


def assert_same_training(reference, other):
    for ref, got in zip(reference, other, strict=True):
        assert abs(got["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (ref, got)
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= RTOL * ref["grad_norm"], (ref, got)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_stage_0(train, zero0, stage):
    records = train("--dp", "2", "--zero", stage)
    assert_same_training(zero0, records)
    assert records[-1]["loss"] < records[0]["loss"]


def test_model_state_bytes_fall_stage_by_stage(train, zero0):
    state = [zero0[-1]["model_state_bytes"]]
    state += [train("--dp", "2", "--zero", z)[-1]["model_state_bytes"] for z in (1, 2, 3)]
    assert state[0] > state[1] > state[2] > state[3], state
    # And close to the formula (fp32 AdamW, N = 2): 16, 8 + 8/N, 4 + 12/N, 16/N bytes
    # per parameter; padding to a multiple of N is the only difference.
    psi = state[0] / 16
    for measured, per_param in zip(state, (16, 12, 10, 8)):
        assert abs(measured - per_param * psi) <= 0.05 * per_param * psi, (state, psi)


def test_zero2_on_one_rank_has_nothing_to_shard(train, zero0):
    records = train("--dp", "1", "--zero", "2")
    assert_same_training(zero0, records)
    assert records[0]["grad_sync_bytes"] == 0
    # N = 1: 4 + 12/1 = 16 bytes per parameter, what stage 0 holds.
    state, reference = records[-1]["model_state_bytes"], zero0[-1]["model_state_bytes"]
    assert abs(state - reference) <= 0.01 * reference, (state, reference)


def test_zero3_with_grad_accum_matches_stage_0(train, zero0):
    records = train("--dp", "2", "--zero", "3", "--grad-accum", "2")
    assert_same_training(zero0, records)
