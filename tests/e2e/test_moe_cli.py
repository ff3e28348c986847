"""Mixture of experts from the command line: the flags reach the run, the router
report reaches the metrics, and a layout that cannot work exits 2 in one line."""

import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli, run_main

MOE = [
    *SMALL,
    "--model",
    "llama-tiny",
    "--n-kv-head",
    "2",
    "--ffn-hidden-size",
    "64",
    "--n-experts",
    "4",
    "--moe-ffn-hidden-size",
    "32",
]


@pytest.mark.timeout(300)
def test_expert_parallel_run_reports_its_routing(tmp_path, corpus):
    metrics = tmp_path / "m.jsonl"
    result = run_cli(
        "train",
        "--data",
        corpus,
        "--steps",
        2,
        "--metrics",
        metrics,
        *MOE,
        "--dp",
        "2",
        "--ep",
        "2",
        "--moe-aux-loss-coef",
        "0.01",
        "--moe-bias-update-rate",
        "0.01",
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for record in read_metrics(metrics):
        assert record["aux_loss"] > 0 and record["moe_max_load"] >= 1
        assert record["moe_worst_layer"] in (0, 1)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dp", "2", "--ep", "4"], "--ep 4 does not divide dp x cp = 2 x 1"),
        (["--dp", "2", "--ep", "2", "--n-experts", "0"], "--ep 2 on a dense model"),
        (["--experts-per-token", "5"], "--experts-per-token 5 with 4 experts; valid: 1 to 4"),
    ],
)
def test_expert_layouts_that_cannot_work_exit_2(tmp_path, corpus, flags, message):
    result = run_main("train", *MOE, "--data", corpus, *flags, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
