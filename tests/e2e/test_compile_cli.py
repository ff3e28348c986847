"""``meshwise train --compile`` with inductor's own kernels, once in the suite: 20 steps
equal eager's, nothing compiles after the first step, and the kernels land in the run's
cache (the layouts' parity is tests/dist/test_compile.py's, traced the same way)."""

import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli

STEPS = 20


def _train(workdir, name, *flags) -> list[dict]:
    metrics = workdir / f"{name}.jsonl"
    result = run_cli(
        "train",
        *("--model", "llama-tiny", *SMALL, "--steps", STEPS, "--metrics", metrics),
        *("--activation-checkpointing", "full", "--eval-batches", "1", *flags),
        cwd=workdir,
        env_extra={"TORCHINDUCTOR_CACHE_DIR": None},  # the run's own: <cache>/inductor
        timeout=400,
    )
    assert result.returncode == 0, result.stderr
    return [r for r in read_metrics(metrics) if "loss" in r and "step" in r]


@pytest.mark.timeout(500)
def test_inductor_compiled_run_equals_eager_and_compiles_once(tmp_path, corpus):
    # Sequences of 48: the end's 10 sampled tokens see 10 lengths, past dynamo's limit of
    # 8 compiles per region (fullgraph stops there): they decode eager.
    flags = ("--data", corpus, "--seq-len", "48")
    compiled = _train(tmp_path, "compiled", *flags, "--compile", "--sample-tokens", "10")
    eager = _train(tmp_path, "eager", *flags)
    assert len(compiled) == len(eager) == STEPS
    for want, got in zip(eager, compiled, strict=True):
        # The checkpointed recompute replays the compiled block; the loss is compiled too.
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), got["step"]
    # fullgraph: a graph break fails the run. The first step compiles, no later one does.
    compile_s = [r["time_breakdown"]["compile"] for r in compiled]
    assert compile_s[0] > 0 and compile_s[1:] == [0.0] * (STEPS - 1), compile_s
    assert any((tmp_path / "cache" / "inductor").rglob("*.py"))  # kept for the next run
