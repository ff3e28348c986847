"""Watching a run as a user does: TensorBoard, W&B and MLflow hold every step, a resumed
run goes on in the same runs, the profiler's traces name meshwise's work, and
``meshwise plot`` draws metrics files."""

import json

import pytest

from tests.e2e.conftest import SMALL, read_metrics, run_cli, run_main

pytestmark = pytest.mark.timeout(240)
KEYS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "step_time_s",
    "peak_mem_bytes",
    "grad_sync_bytes",
    "comm_exposed_s",
    "mfu",
    "tflops",
    "time_breakdown/compute",
)


def _train(tmp_path, corpus, *flags, steps=6, env=None):
    result = run_cli(
        "train",
        "--data",
        corpus,
        "--steps",
        steps,
        "--dp",
        2,
        *SMALL,
        *flags,
        cwd=tmp_path,
        env_extra=env,
    )
    return result


def _tensorboard_steps(log_dir) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _mlflow_steps(log_dir) -> tuple[int, dict[str, list[int]], dict]:
    import os

    import mlflow

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    mlflow.set_tracking_uri((log_dir / "mlruns").resolve().as_uri())
    runs = mlflow.search_runs(experiment_names=["meshwise"], output_format="list")
    client = mlflow.tracking.MlflowClient()
    run = runs[0]
    steps = {
        key: [m.step for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
    }
    return len(runs), steps, run.data.params


def _key(item) -> str:
    """A W&B record item's key (newer versions give it as a path of parts)."""
    return item.key or "/".join(item.nested_key)


def _wandb_history(log_dir) -> tuple[set, dict, list[int]]:
    from tests.wandb_log import records

    ids, config, steps = set(), {}, []
    for path in sorted((log_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        ids.add(path.stem.removeprefix("run-"))
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind in ("run", "config"):  # the run's first record holds its configuration
                updates = record.run.config.update if kind == "run" else record.config.update
                config.update({_key(item): json.loads(item.value_json) for item in updates})
            elif kind == "history":
                keys = {_key(item) for item in record.history.item}
                assert {"loss", "mfu", "time_breakdown/compute"} <= keys, keys
                steps.append(record.history.step.num)
    return ids, config, sorted(steps)


def test_every_logger_holds_every_step_and_a_resumed_run_goes_on(tmp_path, corpus):
    save = tmp_path / "ckpt"
    flags = (
        "--log-to",
        "tensorboard,wandb,mlflow",
        "--save",
        save,
        "--save-every",
        3,
        "--resume",
        "auto",
    )
    first = _train(
        tmp_path,
        corpus,
        *flags,
        env={"MESHWISE_FAIL_AT": "0:4", "WANDB_MODE": None, "WANDB_API_KEY": None},
    )
    assert first.returncode == 1 and "injected failure" in first.stderr
    assert "no API key set or stored, so offline" in first.stderr
    second = _train(tmp_path, corpus, *flags, env={"WANDB_MODE": None, "WANDB_API_KEY": None})
    assert second.returncode == 0, second.stderr
    log_dir = save / "logs"  # the default beside the checkpoints: a resume finds it
    tb = _tensorboard_steps(log_dir)
    for key in KEYS:
        assert tb[key] == [1, 2, 3, 4, 5, 6], (key, tb.get(key))
    count, steps, params = _mlflow_steps(log_dir)
    assert count == 1  # the resumed run went on in the same MLflow run
    for key in KEYS:
        assert steps[key] == [1, 2, 3, 4, 5, 6], (key, steps.get(key))
    assert params["data.seq_len"] == "32" and params["parallel.dp"] == "2"
    ids, config, history = _wandb_history(log_dir)
    assert len(ids) == 1 and history == [1, 2, 3, 4, 5, 6]
    assert config["data"]["seq_len"] == 32


def test_the_profiler_names_meshwise_work_on_every_rank(tmp_path, corpus):
    traces = tmp_path / "profile"
    result = _train(
        tmp_path,
        corpus,
        "--zero",
        3,
        "--save",
        tmp_path / "c",
        "--save-every",
        2,
        "--profile-steps",
        "2-2",
        "--profile-dir",
        traces,
        steps=3,
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        trace = json.loads((traces / f"rank{rank}.steps2-2.pt.trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        for expected in (
            "meshwise/forward_backward",
            "meshwise/forward",
            "meshwise/backward",
            "meshwise/grad_sync",
            "meshwise/optimizer",
            "meshwise/checkpoint/save",
            "meshwise/wait/grad",
            "meshwise/wait/param",
        ):
            assert expected in names, (rank, expected)
        assert any(n.startswith("meshwise/zero3/gather") for n in names)


def test_pipeline_actions_are_named_in_the_trace(tmp_path, corpus):
    traces = tmp_path / "profile"
    result = run_cli(
        "train",
        "--data",
        corpus,
        "--steps",
        2,
        "--pp",
        2,
        *SMALL,
        "--profile-steps",
        "2-2",
        "--profile-dir",
        traces,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    trace = json.loads((traces / "rank0.steps2-2.pt.trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert {"meshwise/pipeline/F0", "meshwise/pipeline/B0", "meshwise/pipeline/p2p"} <= names


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--log-to", "neptune"],
            "--log-to 'neptune' is not valid; valid: tensorboard, wandb, mlflow",
        ),
        (["--profile-steps", "5-2"], "--profile-steps '5-2' is not a range of steps"),
        (["--peak-tflops", "-1"], "--peak-tflops must be a finite number >= 0, got -1.0"),
        (["--log-errors", "ignore"], "--log-errors 'ignore' is not valid; valid: warn, fatal"),
    ],
)
def test_bad_watching_flags_exit_2(tmp_path, corpus, flags, message):
    result = run_main("train", "--data", corpus, *SMALL, *flags, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_log_dir_holding_another_run_exits_2_before_launch(tmp_path, corpus):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "meshwise-run.json").write_text('{"run_name": "seed-1", "tensorboard": "x"}')
    flags = ("--log-to", "tensorboard", "--log-dir", log_dir, "--seed", 2)
    result = run_main("train", "--data", corpus, *SMALL, *flags, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--log-dir" in result.stderr and "already holds the run 'seed-1'" in result.stderr
    assert not (log_dir / "tensorboard").exists()  # nothing written into the other run


def test_a_missing_logger_library_exits_2_with_the_pip_command(tmp_path, corpus, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    result = run_main("train", "--data", corpus, *SMALL, "--log-to", "mlflow", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        "--log-to mlflow needs the mlflow library: pip install 'meshwise[mlflow]'" in result.stderr
    )


def test_plot_draws_two_runs_and_refuses_other_files(tmp_path, corpus):
    for name, peak, source in (
        ("dp1", 0, "a matrix multiply measured at start-up"),
        ("dp2", 0.5, "--peak-tflops"),
    ):
        result = run_cli(
            "train",
            "--data",
            corpus,
            "--steps",
            4,
            "--dp",
            name[-1],
            *SMALL,
            "--metrics",
            tmp_path / f"{name}.jsonl",
            "--eval-every",
            2,
            "--peak-tflops",
            peak,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr
        assert f"TFLOP/s over {name[-1]} ranks, {source})" in result.stdout
    given = read_metrics(tmp_path / "dp2.jsonl")
    assert len(given) == 4  # MFU against the peak given: 0.5 TFLOP/s per rank
    assert all(abs(r["mfu"] - r["tflops"] / (2 * 0.5)) < 1e-9 for r in given)
    out = tmp_path / "curves.png"
    result = run_main(
        "plot",
        tmp_path / "dp1.jsonl",
        tmp_path / "dp2.jsonl",
        "--out",
        out,
        "--x",
        "tokens",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 1000 and height > 600
    (tmp_path / "notes.txt").write_text("hello\n")
    result = run_main("plot", tmp_path / "notes.txt", "--out", out, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"meshwise plot: error: {tmp_path / 'notes.txt'} line 1 is "
        "not a meshwise metrics line (one JSON object with step "
        "and loss per line, as --metrics writes)"
    )
