"""``meshwise plan``'s memory predictions hold against the process's own peak.

A few layouts that hold their memory differently (replicated state, ZeRO-3's
shards and gathered units, a pipeline's micro-batches in flight, tensor and
sequence parallelism) each run as ``meshwise train`` on 2 ranks; the worst
rank's peak resident set over the whole run (read from the operating system,
``MALLOC_MMAP_THRESHOLD_=65536``) must be within 15% of what ``meshwise plan
--explain`` predicts for the same layout, with the CPU profile's defaults (no
calibration is stored in a fresh cache). Step time is too noisy on a shared
2-core machine for a test: ``benchmarks/planner.py`` compares it.
"""

import json

import pytest

from tests.e2e.conftest import read_metrics, run_cli, run_main

MODEL = ["--model", "small", "--n-layer", "4", "--seq-len", "128", "--batch-size", "8"]
LAYOUTS = ["--dp 2 --tp 1 --pp 1 --zero 0", "--dp 2 --tp 1 --pp 1 --zero 3",
           "--dp 1 --tp 1 --pp 2 --schedule 1f1b --micro-batches 4 --zero 0",
           "--dp 1 --tp 2 --pp 1 --sp --zero 0"]
GLIBC_RETURNS_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536", "MESHWISE_COMM_CHECK": None}


def predicted(tmp_path, layout: str) -> int:
    out = run_main("plan", *MODEL, "--world", 2, "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = {row["layout"]: row for row in json.loads(out.stdout)}
    assert layout in rows, f"{layout} is not among the planner's layouts"
    return rows[layout]["peak_mem_bytes"]


@pytest.mark.timeout(300)
def test_predicted_peak_memory_is_within_15_percent_of_the_measured(tmp_path, corpus):
    errors = {}
    for layout in LAYOUTS:
        metrics = tmp_path / f"{len(errors)}.jsonl"
        result = run_cli("train", *MODEL, *layout.split(), "--steps", 2, "--eval-batches", 1,
                         "--data", corpus, "--metrics", metrics, "-q", cwd=tmp_path,
                         env_extra=GLIBC_RETURNS_MEMORY)
        assert result.returncode == 0, result.stderr
        measured = read_metrics(metrics)[-1]["peak_rss_bytes"]
        errors[layout] = predicted(tmp_path, layout) / measured - 1
    assert all(abs(e) <= 0.15 for e in errors.values()), errors
