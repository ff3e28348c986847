"""The correctness invariant end to end: every layout gives the single-process
loss curve (DESIGN section 1), and the same global gradient norm at every step."""

import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli, run_main

STEPS = 6
MODEL = [*SMALL, "--n-layer", "4"]

LAYOUTS = {
    # pipeline (every schedule's runtime is checked against one process in float64 in
    # tests/dist/test_pipeline_runtime.py; here the trainer's use of them)
    "pp2": ["--pp", "2"],
    "pp4": ["--pp", "4"],
    "pp2-gpipe": ["--pp", "2", "--schedule", "gpipe", "--micro-batches", "4"],
    "pp2-interleaved": [
        "--pp",
        "2",
        "--schedule",
        "interleaved-1f1b",
        "--virtual-stages",
        "2",
        "--micro-batches",
        "4",
    ],
    "dp2-pp2": ["--dp", "2", "--pp", "2"],
    "pp2-accum2": ["--pp", "2", "--grad-accum", "2"],
    # tensor parallel and 3D
    "dp2-tp2": ["--dp", "2", "--tp", "2"],
    "tp2-pp2": ["--tp", "2", "--pp", "2"],
    "dp2-tp2-pp2-zero1": ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1"],
    "dp2-tp2-zero2": ["--dp", "2", "--tp", "2", "--zero", "2"],
    "dp2-tp2-zero3": ["--dp", "2", "--tp", "2", "--zero", "3"],
    # split backwards (runtime parity at pp 2 and 4, with checkpointing, in
    # tests/dist/test_pipeline_runtime.py) and pipeline x ZeRO-2/3 (engine parity in
    # tests/dist/test_pipeline_zero.py); the tied embedding spans both ends of each
    "pp4-zb-h1-ckpt": [
        "--pp",
        "4",
        "--schedule",
        "zb-h1",
        "--micro-batches",
        "4",
        "--activation-checkpointing",
        "full",
    ],
    "tp2-pp2-zbv": [
        "--tp",
        "2",
        "--pp",
        "2",
        "--schedule",
        "zbv",
        "--virtual-stages",
        "2",
        "--micro-batches",
        "4",
    ],
    "dp2-pp2-dualpipev-zero2": [
        "--dp",
        "2",
        "--pp",
        "2",
        "--schedule",
        "dualpipev",
        "--virtual-stages",
        "2",
        "--micro-batches",
        "4",
        "--zero",
        "2",
    ],
    "dp2-pp2-zero3": ["--dp", "2", "--pp", "2", "--zero", "3"],
    "dp2-pp2-zbv-zero3-reshard-ckpt": [
        "--dp",
        "2",
        "--pp",
        "2",
        "--schedule",
        "zbv",
        "--virtual-stages",
        "2",
        "--micro-batches",
        "4",
        "--zero",
        "3",
        "--reshard-after-forward",
        "--activation-checkpointing",
        "full",
    ],
    # context parallel: learned positions of the zigzag chunks, ring attention
    "cp2": ["--cp", "2"],
}


# The Llama family: its plan split by tp, cut into stages and sharded by ZeRO-3.
LLAMA = [*MODEL, "--model", "llama-tiny", "--n-kv-head", "2", "--ffn-hidden-size", "96"]
LLAMA_LAYOUTS = {
    "tp2": ["--tp", "2"],
    "pp2-interleaved": LAYOUTS["pp2-interleaved"],
    "dp2-tp2-zero3": LAYOUTS["dp2-tp2-zero3"],
    "dp2-tp2-pp2-zero1": LAYOUTS["dp2-tp2-pp2-zero1"],
    "dp2-pp2-zbv-zero3-reshard-ckpt": LAYOUTS["dp2-pp2-zbv-zero3-reshard-ckpt"],
    # rotary positions of the zigzag chunks, kv heads around the ring, sequence parallel
    "cp2-tp2-sp": ["--cp", "2", "--tp", "2", "--sp"],
}


def run_layout(tmp_path, corpus, name, flags, model=MODEL):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_cli(
        "train",
        "--data",
        corpus,
        "--steps",
        STEPS,
        "--metrics",
        metrics,
        *model,
        *flags,
        cwd=tmp_path,
        timeout=300,
    )  # later flags win
    assert result.returncode == 0, result.stderr
    return read_metrics(metrics)


def assert_same_curve(name, reference, records):
    assert len(records) == STEPS
    for ref, got in zip(reference, records, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (name, ref, got)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), (name, ref, got)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    return run_layout(tmp_path_factory.mktemp("ref"), corpus, "single", ["--dp", "1"])


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory, corpus):
    return run_layout(tmp_path_factory.mktemp("ref"), corpus, "llama", ["--dp", "1"], LLAMA)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(tmp_path, corpus, reference, name):
    assert_same_curve(name, reference, run_layout(tmp_path, corpus, name, LAYOUTS[name]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", LLAMA_LAYOUTS)
def test_llama_layout_matches_single_process(tmp_path, corpus, llama_reference, name):
    records = run_layout(tmp_path, corpus, name, LLAMA_LAYOUTS[name], LLAMA)
    assert_same_curve(f"llama {name}", llama_reference, records)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pp", "3"], "--n-layer 4 does not split into pp x virtual-stages = 3 x 1 = 3"),
        (["--pp", "2", "--virtual-stages", "2"], "needs schedule interleaved-1f1b"),
        (
            [
                "--pp",
                "2",
                "--schedule",
                "interleaved-1f1b",
                "--virtual-stages",
                "2",
                "--micro-batches",
                "3",
            ],
            "multiple of pp",
        ),
        (["--tp", "3"], "--n-head 4 is not divisible by --tp 3"),
        (
            ["--pp", "2", "--zero", "2", "--reshard-after-forward"],
            "--reshard-after-forward needs --zero 3 (got --zero 2)",
        ),
        (
            [
                "--pp",
                "2",
                "--schedule",
                "dualpipev",
                "--virtual-stages",
                "2",
                "--micro-batches",
                "2",
            ],
            "dualpipev needs micro-batches >= 2 x pp",
        ),
        (["--pp", "2", "--schedule", "zbv", "--micro-batches", "4"], "virtual stages must be 2"),
        (["--micro-batches", "2"], "--micro-batches 2 needs --pp > 1"),
        (
            ["--cp", "3"],
            "--seq-len 32 does not split into 2 x cp = 6 load-balanced chunks; valid: "
            "a multiple of 6, e.g. --seq-len 30 or 36",
        ),
        (
            ["--sp"],
            "--sp splits the sequence across the tp ranks between their layers and needs --tp > 1",
        ),
    ],
)
def test_layouts_that_cannot_work_exit_2(tmp_path, corpus, flags, message):
    result = run_main("train", *MODEL, "--data", corpus, *flags, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.timeout(300)
def test_vocabulary_padded_for_tp_does_not_change_the_loss(tmp_path, corpus):
    """tp=3 does not divide the 256-byte vocabulary: the padded rows must not count."""
    model = ["--n-head", "6", "--d-model", "48", "--steps", "5"]
    single = run_layout(tmp_path, corpus, "tp1", [*model, "--dp", "1"])
    padded = run_layout(tmp_path, corpus, "tp3", [*model, "--tp", "3"])
    for ref, got in zip(single, padded, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


@pytest.mark.timeout(300)
def test_dropout_keeps_the_loss_curve_layout_independent(tmp_path, corpus, reference):
    drop = ["--dropout", "0.1"]
    single = run_layout(tmp_path, corpus, "drop-single", [*drop, "--dp", "1"])
    assert single[0]["loss"] != reference[0]["loss"]  # dropout is on
    for name, flags in {"tp2": ["--tp", "2"], "dp2-pp2": ["--dp", "2", "--pp", "2"]}.items():
        records = run_layout(tmp_path, corpus, f"drop-{name}", [*drop, *flags])
        for ref, got in zip(single, records, strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (name, ref, got)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), (name, ref, got)
