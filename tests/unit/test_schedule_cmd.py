"""The ``meshwise schedule`` subcommand, driven through its own ArgumentParser."""

import argparse
import json

import pytest

from meshwise.cli.schedule import add_schedule_arguments, run_schedule


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="meshwise schedule")
    add_schedule_arguments(parser)
    status = run_schedule(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_json_output(capsys):
    status, out, err = run(["--pp", "2", "--micro-batches", "4", "--json"], capsys)
    assert status == 0 and err == ""
    data = json.loads(out)
    assert data["schedule"] == "1f1b"
    assert (data["pp"], data["micro_batches"], data["virtual_stages"]) == (2, 4, 1)
    assert data["ranks"] == [
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    ]
    assert data["bubble_fraction"] == pytest.approx(1 / 5, abs=1e-12)
    assert data["bubble_fraction_formula"] == pytest.approx(1 / 5, abs=1e-12)
    assert data["step_time"] == 15.0 and data["peak_in_flight"] == [2, 1]
    assert "SF0>1" in data["ranks_with_comms"][0]


def test_json_interleaved_names_chunks(capsys):
    status, out, _ = run(
        [
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--virtual-stages",
            "2",
            "--schedule",
            "interleaved-1f1b",
            "--json",
        ],
        capsys,
    )
    data = json.loads(out)
    assert status == 0 and data["ranks"][0][:4] == ["F0.0", "F1.0", "F0.1", "F1.1"]


def test_text_output(capsys):
    status, out, _ = run("--pp 4 --micro-batches 8 --schedule gpipe --comms".split(), capsys)
    assert status == 0
    assert "rank 0: F0 [SF0>1] F1" in out
    assert "rank 3 |" in out and "bubble fraction: 0.2727" in out and "3/11" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--pp", "0", "--micro-batches", "4"], ["pp", "got 0"]),
        (["--pp", "2", "--micro-batches", "4", "--schedule", "zigzag"], ["zigzag", "1f1b"]),
        (
            "--pp 4 --micro-batches 6 --virtual-stages 2 --schedule interleaved-1f1b".split(),
            ["micro-batches=6", "4, 8, 12"],
        ),
        (["--pp", "2", "--micro-batches", "4", "--virtual-stages", "2"], ["interleaved-1f1b"]),
    ],
)
def test_bad_values_exit_2_with_one_line(argv, words, capsys):
    status, out, err = run(argv, capsys)
    assert status == 2 and out == ""
    assert err.startswith("meshwise schedule: error: ") and err.count("\n") == 1
    for word in words:
        assert word in err


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    status, out, _ = run(
        [
            "--pp",
            "2",
            "--micro-batches",
            "4",
            "--virtual-stages",
            "2",
            "--schedule",
            "interleaved-1f1b",
            "--plot",
            str(path),
        ],
        capsys,
    )
    assert status == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in out


def test_plot_to_unwritable_path(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    missing_dir = str(tmp_path / "no" / "x.png")
    status, _, err = run(["--pp", "2", "--micro-batches", "2", "--plot", missing_dir], capsys)
    assert status == 2 and "cannot write --plot" in err
