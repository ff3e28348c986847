"""Experiment loggers (TensorBoard, Weights & Biases, MLflow) through their own libraries,
called from a thread of their own so the loop only queues a record; a resume with the
same ``--log-dir`` continues the same runs (``meshwise-run.json``). See docs/watching.md.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

log = logging.getLogger("meshwise")

LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # name -> module
RUN_FILE = "meshwise-run.json"
LOG_ERRORS = ("warn", "fatal")  # a logger that fails: turned off with a warning, or the end


class LoggerError(RuntimeError):
    """A logger failed and ``--log-errors fatal`` asked for the run to stop; one line."""


def run_names(runtime, save_dir: str | None) -> dict[str, str]:
    """The run's name, its loggers' folder and the profile folder: ``runtime``'s (the
    settings, or a run state) where given, else from ``--save`` (or the time). Named
    once, before any rank starts (every rank must agree)."""
    run_name = runtime.run_name or (
        Path(save_dir).name if save_dir else time.strftime("run-%Y%m%d-%H%M%S")
    )
    log_dir = runtime.log_dir or str(
        Path(save_dir) / "logs" if save_dir else Path("runs") / run_name
    )
    return {
        "run_name": run_name,
        "log_dir": log_dir,
        "profile_dir": runtime.profile_dir or str(Path(log_dir) / "profile"),
    }


def parse_log_to(text: str | None) -> list[str]:
    """``--log-to`` as a list of logger names (ValueError naming a bad one)."""
    names = [n.strip() for n in (text or "").split(",") if n.strip() and n.strip() != "none"]
    for name in names:
        if name not in LOGGERS:
            raise ValueError(
                f"--log-to {name!r} is not valid; valid: "
                f"{', '.join(LOGGERS)} (comma-separated), or none"
            )
    return list(dict.fromkeys(names))


def missing_extra(names: list[str]) -> str | None:
    """Why a named logger cannot run here (its library is not installed), or None."""
    for name in names:
        if importlib.util.find_spec(LOGGERS[name]) is None:
            return (
                f"--log-to {name} needs the {LOGGERS[name]} library: pip install "
                f"'meshwise[{name}]' (or pip install -e '.[{name}]' in a checkout)"
            )
    return None


def flatten(record: dict, prefix: str = "") -> dict[str, float]:
    """Numbers of a metrics record, nested dictionaries as ``outer/inner`` keys."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            out[prefix + key] = float(value)
    return out


class ExperimentLog:
    """The loggers of ``names`` for one run; ``log(record)`` per step, ``close()``.

    A logger that fails (to start, to log, to close) is reported in one line and turned
    off, the training going on; with ``on_error`` "fatal" the next ``log`` or ``close``
    raises ``LoggerError`` instead."""

    def __init__(
        self,
        names: list[str],
        log_dir: str | os.PathLike,
        run_name: str,
        project: str,
        config: dict,
        on_error: str = "warn",
    ):
        self.log_dir = Path(log_dir)
        self.on_error, self._fatal = on_error, ""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ids = self._load_ids()
        self._backends = []
        for name in names:
            try:
                self._backends.append(
                    _BACKENDS[name](self.log_dir, run_name, project, config, ids.get(name))
                )
            except Exception as exc:  # noqa: BLE001 - its library's own errors, named
                self._failed(name, "could not start", exc)
        try:
            self._save_ids({"run_name": run_name, **{b.name: b.run_id for b in self._backends}})
        except OSError as exc:
            log.warning(
                "warning: cannot keep the loggers' run ids in %s (%s): a resume starts new runs",
                self.log_dir / RUN_FILE,
                exc.strerror or exc,
            )
        self._raise_if_fatal()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="meshwise-loggers", daemon=True)
        self._thread.start()

    def log(self, record: dict) -> None:
        """Queue one step's record (the thread sends it to every logger)."""
        self._raise_if_fatal()
        self._queue.put((flatten(record), int(record["step"])))

    def close(self) -> None:
        """Send what is queued, then close every logger."""
        self._queue.put(None)
        self._thread.join()
        for backend in self._backends:
            try:
                problem = backend.close()
            except Exception as exc:  # noqa: BLE001
                self._failed(backend.name, "failed to close", exc)
                continue
            if problem:  # what the library reported only in its own log
                self._failed(backend.name, "reported", problem)
        self._raise_if_fatal()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            values, step = item
            for backend in list(self._backends):
                try:
                    backend.log(values, step)
                except Exception as exc:  # noqa: BLE001 - a logger's trouble, not the run's
                    self._backends.remove(backend)
                    self._failed(backend.name, f"failed at step {step}", exc)

    def _failed(self, name: str, what: str, exc: BaseException | str) -> None:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        line = f"--log-to {name} {what}: {text}"
        if self.on_error == "fatal":
            self._fatal = self._fatal or f"{line} (--log-errors fatal)"
        else:
            log.warning(
                "warning: %s; %s is off from now on (--log-errors fatal stops instead)", line, name
            )

    def _raise_if_fatal(self) -> None:
        if self._fatal:  # once: a close() while the run unwinds must not mask the first
            message, self._fatal = self._fatal, ""
            raise LoggerError(message)

    def _load_ids(self) -> dict:
        path = self.log_dir / RUN_FILE
        return json.loads(path.read_text()) if path.is_file() else {}

    def _save_ids(self, ids: dict) -> None:
        (self.log_dir / RUN_FILE).write_text(json.dumps(ids, indent=1) + "\n")


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, log_dir: Path, run_name: str, project: str, config: dict, run_id):
        from torch.utils.tensorboard import SummaryWriter

        self.run_id = run_id or run_name
        self.writer = SummaryWriter(str(log_dir / "tensorboard"))
        if run_id is None:  # a resumed run keeps the hyper-parameters it started with
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```")

    def log(self, values: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event per step holding every scalar (add_scalar writes one event each).
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        file_writer = self.writer.file_writer
        assert file_writer is not None, "the writer is open until close()"
        file_writer.add_summary(summary, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, log_dir: Path, run_name: str, project: str, config: dict, run_id):
        import wandb

        if not os.environ.get("WANDB_MODE") and not _wandb_key():
            os.environ["WANDB_MODE"] = "offline"
            log.warning(
                "warning: --log-to wandb: no API key set or stored, so offline in %s "
                "(upload later with wandb sync)",
                log_dir / "wandb",
            )
        self.run = wandb.init(
            project=project,
            name=run_name,
            dir=str(log_dir),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
        )
        self.run_id = self.run.id

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> str | None:
        """Finish the run; the first error W&B wrote only to its own log (a full disk
        leaves the run empty, and W&B raises nothing), or None."""
        internal = Path(self.run.dir).parent / "logs" / "debug-internal.log"
        self.run.finish()
        return wandb_error(internal)


def wandb_error(internal_log: Path) -> str | None:
    """The first ERROR line of W&B's ``debug-internal.log`` (JSON lines), or None."""
    try:
        lines = internal_log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("level") == "ERROR":
            detail = entry.get("error")
            message = str(entry.get("msg", "error"))
            return (
                f"{message}: {detail} (in {internal_log})"
                if detail
                else (f"{message} (in {internal_log})")
            )
    return None


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")


class _MLflow:
    name = "mlflow"

    def __init__(self, log_dir: Path, run_name: str, project: str, config: dict, run_id):
        import mlflow
        from mlflow.entities import Metric, Param

        # A local file store unless told otherwise (MLflow 3 keeps it only on request).
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((log_dir / "mlruns").resolve().as_uri())
        experiment = mlflow.set_experiment(project)
        self.client = mlflow.tracking.MlflowClient()
        if run_id is None:
            run_id = self.client.create_run(experiment.experiment_id, run_name=run_name).info.run_id
            params = [Param(k, v) for k, v in flatten_config(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes 100 per batch
                self.client.log_batch(run_id, params=params[start : start + 100])
        self.run_id = run_id
        self._metric = Metric

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flatten_config(config: dict, prefix: str = "") -> dict[str, str]:
    """``{"data.seq_len": "128", ...}``: MLflow's parameters are flat strings."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = str(value)[:250]
    return out


_BACKENDS: dict[str, type[_TensorBoard | _Wandb | _MLflow]] = {
    "tensorboard": _TensorBoard,
    "wandb": _Wandb,
    "mlflow": _MLflow,
}
