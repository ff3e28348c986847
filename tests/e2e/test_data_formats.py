"""Data as users hold it, through the CLI: records as documents, epochs, schedules that resume."""

import json
import sysconfig
from pathlib import Path

import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli, run_main

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def records(tmp_path) -> Path:
    """About 90 KB of JSON lines, one paragraph of argparse.py per record."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": i, "text": chunk}) + "\n"
            for i, chunk in enumerate(source.split("\n\n"))
        )
    )
    return path


def _one_line(result) -> str:
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def test_bad_records_and_values_exit_2_naming_them(tmp_path, records):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(records.read_text() + '{"text": "no end\n{"title": "t"}\n')
    lines = len(records.read_text().splitlines())
    err = _one_line(run_main("train", *SMALL, "--data", bad, cwd=tmp_path))
    assert f"bad.jsonl:{lines + 1}: not a JSON object" in err and "--skip-bad-records" in err
    err = _one_line(
        run_main(
            "data", "prepare", bad, "--out", tmp_path / "b.bin", "--text-field", "id", cwd=tmp_path
        )
    )
    assert "bad.jsonl:1: field 'id' is int, not a string" in err
    done = run_main(
        "data", "prepare", bad, "--out", tmp_path / "b.bin", "--skip-bad-records", cwd=tmp_path
    )
    assert done.returncode == 0 and "2 bad records skipped" in done.stdout, done.stderr
    assert (
        f"bad.jsonl:{lines + 2}: the record has no field 'text' (its fields: title)" in done.stdout
    )
    for flag, value, valid in (
        ("--data-order", "shuffled", "random-windows, epochs"),
        ("--lr-schedule", "step", "cosine, wsd, constant"),
        ("--data-format", "xml", "auto, text, jsonl"),
    ):
        err = _one_line(run_main("train", *SMALL, flag, value, cwd=tmp_path))
        assert f"{flag} '{value}' is not valid; valid: {valid}" in err, err


def test_records_train_in_epochs_and_a_longer_wsd_resumes_on_another_layout(tmp_path, records):
    data = [*SMALL, "--data", records, "--data-order", "epochs", "--eval-batches", "1"]
    common = [*data, "--lr-schedule", "wsd", "--decay-steps", "2"]
    first = run_cli(
        "train",
        *common,
        "--dp",
        "2",
        "--steps",
        10,
        "--save",
        tmp_path / "ck",
        "--save-every",
        5,
        "--metrics",
        tmp_path / "first.jsonl",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    whole = {r["step"]: r for r in read_metrics(tmp_path / "first.jsonl")}
    per_epoch = whole[1]["windows_per_epoch"]
    assert [whole[s]["epoch_windows"] for s in (1, 2)] == [8, 16] and per_epoch > 100
    step5 = tmp_path / "ck" / "step-00000005"
    # A cosine over more steps would re-stretch what the checkpoint trained under.
    err = _one_line(
        run_main(
            "train",
            *data,
            "--lr-schedule",
            "cosine",
            "--steps",
            12,
            "--resume",
            step5,
            cwd=tmp_path,
        )
    )
    assert "--resume: this run's --lr-schedule cosine" in err and "--lr-restart" in err, err
    # The stable phase goes on longer: the same learning rates up to step 8, where the
    # first run's decay began.
    longer = run_cli(
        "train",
        *common,
        "--tp",
        "2",
        "--dp",
        "1",
        "--steps",
        12,
        "--resume",
        step5,
        "--metrics",
        tmp_path / "longer.jsonl",
        cwd=tmp_path,
    )
    assert longer.returncode == 0, longer.stderr
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "longer.jsonl")}
    for step in range(6, 10):  # step 9's loss still comes from weights stepped at lr 3e-3
        assert resumed[step]["lr"] == whole[step]["lr"] or step == 9
        assert abs(resumed[step]["loss"] - whole[step]["loss"]) <= 1e-4 * whole[step]["loss"]
    assert resumed[10]["lr"] == pytest.approx(3e-3) and whole[10]["lr"] < 2e-3
