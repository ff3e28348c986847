"""--allreduce and --compress end to end, bad values, and ``meshwise bench comm``."""

import json

import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli, run_main

STEPS = 8


def _train(tmp_path, corpus, name, *flags):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--steps",
        STEPS,
        "--metrics",
        metrics,
        *flags,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return read_metrics(metrics), result


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus):
    return _train(tmp_path_factory.mktemp("single"), corpus, "single", "--dp", "1")[0]


@pytest.mark.parametrize(
    "flags",
    [
        ["--dp", "2", "--zero", "3", "--allreduce", "ring"],
        ["--dp", "2", "--zero", "1", "--allreduce", "tree"],
        ["--dp", "4", "--zero", "2", "--allreduce", "hierarchical", "--ranks-per-node", "2"],
        ["--dp", "2", "--pp", "2", "--allreduce", "adaptive", "--ranks-per-node", "2"],
    ],
    ids=["ring-zero3", "tree-zero1", "hierarchical-zero2", "adaptive-pp2"],
)
def test_exact_algorithms_keep_the_loss_curve(tmp_path, corpus, single, flags):
    records, _ = _train(tmp_path, corpus, "algo", *flags)
    for ref, got in zip(single, records, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    algorithm = flags[flags.index("--allreduce") + 1]
    calls = records[-1]["allreduce_calls"]
    assert (algorithm in calls) if algorithm != "adaptive" else calls
    assert records[-1]["compress_ratio"] == pytest.approx(1.0, rel=0.05)
    assert sum(records[-1]["allreduce_bytes"].values()) <= records[-1]["grad_sync_bytes"]


@pytest.mark.parametrize(
    "spec,ratio,zero",
    [("bf16", 2, 2), ("int8", 3.9, 2), ("topk:0.01", 20, 2), ("powersgd:2", 4, 3)],
)
def test_compression_trains_and_reports_its_ratio(tmp_path, corpus, single, spec, ratio, zero):
    records, result = _train(
        tmp_path,
        corpus,
        "c",
        "--dp",
        "2",
        "--zero",
        zero,
        "--compress",
        spec,
        "--compress-warmup-steps",
        "2",
        *(["--topk-ramp-steps", "0"] if spec.startswith("topk") else []),
    )
    last = records[-1]
    assert last["compress_ratio"] >= ratio, last
    assert last["loss"] < records[0]["loss"]
    assert "compress ratio" in result.stdout and "exposed comm" in result.stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--compress", "zip"],
            "--compress 'zip' is not valid; valid: none, fp16, bf16, int8, "
            "topk:FRACTION, powersgd:RANK",
        ),
        (["--compress", "topk:0"], "--compress 'topk:0' is not valid"),
        (["--compress", "topk:1.5"], "--compress 'topk:1.5' is not valid"),
        (["--compress", "powersgd:0"], "--compress 'powersgd:0' is not valid"),
        (
            ["--allreduce", "star"],
            "--allreduce 'star' is not valid; valid: native, ring, tree, hierarchical, adaptive",
        ),
        (
            ["--dp", "2", "--ranks-per-node", "3"],
            "--ranks-per-node 3 does not divide the world of dp x tp x pp = 2 ranks; valid: 1, 2",
        ),
        (
            ["--dp", "2", "--allreduce", "hierarchical"],
            "--allreduce hierarchical cannot serve the dp group: all ranks of the group [0, 1] "
            "are on one node",
        ),
        (
            ["--dp", "2", "--allreduce", "hierarchical", "--ranks-per-node", "1"],
            "alone on its node",
        ),
        (
            ["--dp", "2", "--dtype", "bf16", "--grad-reduce-dtype", "bf16", "--compress", "int8"],
            "--grad-reduce-dtype bf16 with --compress int8: the compressor decides",
        ),
        (["--error-feedback", "maybe"], "--error-feedback 'maybe' is not valid; valid: on, off"),
    ],
)
def test_bad_comm_values_exit_2_with_the_valid_ones(tmp_path, corpus, flags, message):
    result = run_main("train", *SMALL, "--data", corpus, *flags, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sizes", "1x"], "--sizes"),
        (["--algorithms", "ring,star"], "'star' is not valid"),
        (["--ranks", "4", "--ranks-per-node", "3"], "does not divide"),
        (["--ranks", "2", "--algorithms", "hierarchical"], "cannot serve"),
    ],
)
def test_bench_comm_bad_values_exit_2(tmp_path, args, message):
    result = run_main("bench", "comm", *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr


def test_bench_comm_json_and_plot(tmp_path):
    plot = tmp_path / "comm.png"
    result = run_cli(
        "bench",
        "comm",
        "--ranks",
        "4",
        "--sizes",
        "4K,256K",
        "--repeats",
        "2",
        "--json",
        "--plot",
        plot,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    assert out["world_size"] == 4 and out["nodes"] == 2
    seen = {(r["algorithm"], r["bytes"]) for r in out["results"]}
    for algorithm in ("native", "ring", "tree", "hierarchical", "adaptive"):
        assert {(algorithm, 4096), (algorithm, 262144)} <= seen
    assert all(r["busbw_gbps"] > 0 and "speedup_vs_native" in r for r in out["results"])
    assert plot.stat().st_size > 1000
