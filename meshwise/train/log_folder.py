"""The loggers' folder checked before any rank starts: it can be written, has room, and
holds no other run (a second run would go on in the first one's W&B, MLflow and
TensorBoard runs)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from meshwise.train.loggers import RUN_FILE

MIN_FREE_BYTES = 64 << 20  # what a log folder must have free before a run starts


def check_log_dir(log_dir: str | os.PathLike, resuming: bool) -> None:
    """Before any rank starts: ``log_dir`` can be written, has room, and holds no other
    run unless this one resumes (ValueError naming what to do)."""
    folder = Path(log_dir)
    held = folder / RUN_FILE
    if held.is_file() and not resuming:
        try:
            name = json.loads(held.read_text()).get("run_name") or "another run"
        except (OSError, ValueError, AttributeError):
            name = "another run"
        raise ValueError(
            f"--log-dir {folder} already holds the run {name!r} ({RUN_FILE}); continue it "
            "with --resume, or log this run in a folder of its own: another --log-dir, "
            "or none (each --run-name then logs in runs/NAME)"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".meshwise-probe-{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        raise ValueError(
            f"--log-dir {folder}: cannot write there ({exc.strerror or exc})"
        ) from None
    if free < MIN_FREE_BYTES:
        raise ValueError(
            f"--log-dir {folder}: {free / 2**20:.0f} MiB free; the loggers need at least "
            f"{MIN_FREE_BYTES >> 20} MiB: free some space or choose another --log-dir"
        )
