"""Experiment loggers that fail: the log folder checked before launch, a failing logger
reported in one line and turned off (or the run stopped), W&B's own errors surfaced."""

import json
import logging
from collections import namedtuple

import pytest

from meshwise.train import log_folder, loggers
from meshwise.train.log_folder import check_log_dir
from meshwise.train.loggers import ExperimentLog, LoggerError, wandb_error


def test_a_log_dir_holding_another_run_is_refused_unless_it_resumes(tmp_path):
    check_log_dir(tmp_path / "new", resuming=False)  # created, writable, room: fine
    (tmp_path / "new" / loggers.RUN_FILE).write_text(json.dumps({"run_name": "seed-1"}))
    with pytest.raises(ValueError, match=r"already holds the run 'seed-1'.*--resume.*--run-name"):
        check_log_dir(tmp_path / "new", resuming=False)
    check_log_dir(tmp_path / "new", resuming=True)


def test_an_unwritable_or_full_log_dir_is_refused(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--log-dir .*file/logs: cannot write there"):
        check_log_dir(tmp_path / "file" / "logs", resuming=False)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(log_folder.shutil, "disk_usage", lambda path: usage(1 << 30, 0, 5 << 20))
    with pytest.raises(ValueError, match=r"5 MiB free; the loggers need at least 64 MiB"):
        check_log_dir(tmp_path / "full", resuming=False)


class _Fake:
    """A logger that records what it got, and fails from step ``fails_at``."""

    def __init__(self, name, fails_at=None, problem=None):
        self.name, self.fails_at, self.problem = name, fails_at, problem
        self.steps, self.run_id = [], name

    def log(self, values, step):
        if self.fails_at is not None and step >= self.fails_at:
            raise OSError(28, "No space left on device")
        self.steps.append(step)

    def close(self):
        return self.problem


def _with(monkeypatch, *fakes):
    by_name = {fake.name: fake for fake in fakes}
    monkeypatch.setattr(
        loggers, "_BACKENDS", {name: (lambda *a, f=fake: f) for name, fake in by_name.items()}
    )
    return list(by_name)


def test_a_logger_failing_mid_run_is_one_line_and_goes_off_while_the_others_go_on(
    tmp_path, monkeypatch, caplog
):
    failing, fine = _Fake("tensorboard", fails_at=2), _Fake("mlflow")
    names = _with(monkeypatch, failing, fine)
    experiment = ExperimentLog(names, tmp_path, "run", "p", {})
    with caplog.at_level(logging.WARNING, logger="meshwise"):
        for step in range(1, 5):
            experiment.log({"step": step, "loss": 1.0})
        experiment.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "warning: --log-to tensorboard failed at step 2: [Errno 28] No space left on device; "
        "tensorboard is off from now on (--log-errors fatal stops instead)"
    ]
    assert failing.steps == [1] and fine.steps == [1, 2, 3, 4]


def test_log_errors_fatal_stops_the_run_at_the_next_step(tmp_path, monkeypatch):
    names = _with(monkeypatch, _Fake("tensorboard", fails_at=1))
    experiment = ExperimentLog(names, tmp_path, "run", "p", {}, on_error="fatal")
    experiment.log({"step": 1, "loss": 1.0})
    with pytest.raises(LoggerError, match=r"tensorboard failed at step 1: .*No space left"):
        experiment.close()
    experiment.close()  # said once: a second close, as the run unwinds, adds nothing


def test_what_wandb_reports_only_in_its_own_log_is_surfaced(tmp_path, monkeypatch, caplog):
    internal = tmp_path / "debug-internal.log"
    internal.write_text(
        '{"level":"INFO","msg":"stream: started"}\n'
        '{"level":"ERROR","msg":"writer: failed to write","error":"no space left on device"}\n'
    )
    problem = wandb_error(internal)
    assert problem.startswith("writer: failed to write: no space left on device (in ")
    names = _with(monkeypatch, _Fake("wandb", problem=problem))
    experiment = ExperimentLog(names, tmp_path, "run", "p", {})
    with caplog.at_level(logging.WARNING, logger="meshwise"):
        experiment.close()
    assert "--log-to wandb reported: writer: failed to write" in caplog.text
    assert wandb_error(tmp_path / "absent.log") is None


def test_a_logger_that_cannot_start_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    def refuse(*args):
        raise PermissionError(13, "Permission denied", "mlruns")

    monkeypatch.setattr(loggers, "_BACKENDS", {"mlflow": refuse})
    with caplog.at_level(logging.WARNING, logger="meshwise"):
        ExperimentLog(["mlflow"], tmp_path, "run", "p", {}).close()
    assert "--log-to mlflow could not start: [Errno 13] Permission denied" in caplog.text
    with pytest.raises(LoggerError, match="mlflow could not start"):
        ExperimentLog(["mlflow"], tmp_path, "run", "p", {}, on_error="fatal")
