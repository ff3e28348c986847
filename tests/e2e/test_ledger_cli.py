"""The collective ledger as a user meets it: a rank out of step ends the job at once,
named with both call sites, and every rank's ledger is kept."""

import json
import time

import pytest

from tests.e2e.conftest import SMALL, run_cli

pytestmark = pytest.mark.timeout(120)


def test_an_extra_collective_on_one_rank_is_named_within_seconds(tmp_path, corpus):
    metrics = tmp_path / "m.jsonl"
    start = time.monotonic()
    result = run_cli(
        "train",
        "--data",
        corpus,
        "--dp",
        "2",
        "--steps",
        1000,
        "--timeout-s",
        300,
        "--metrics",
        metrics,
        *SMALL,
        cwd=tmp_path,
        env_extra={"MESHWISE_FAIL_AT": "1:3:desync"},
    )
    took = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert took < 30, took  # start-up, two steps and the diagnosis; not the 300 s timeout
    line = result.stderr.strip().splitlines()[-1]
    assert "rank 1 diverged on group dp (ranks [0, 1])" in line, line
    assert "rank 1 issued all_reduce sum float32[1] at meshwise/train/faults.py" in line, line
    assert "rank 0 issued all_reduce sum float32[" in line and "sharding/" in line, line
    kept = sorted(p.name for p in (tmp_path / "m.jsonl.ledger").iterdir())
    assert kept == ["ledger-rank00000.json", "ledger-rank00001.json"]
    entries = json.loads((tmp_path / "m.jsonl.ledger" / kept[1]).read_text())["entries"]
    assert entries[-1]["site"].startswith("meshwise/train/faults.py")
