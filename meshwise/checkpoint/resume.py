"""Checks made in the launching process before any rank starts: where to save, what to
resume from, and ``--branch`` setting newer checkpoints aside (docs/checkpoints.md).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from meshwise.checkpoint.store import (
    MANIFEST,
    Checkpoint,
    CheckpointError,
    complete_checkpoints,
    resolve,
    step_entries,
    step_of,
)

SET_ASIDE_PREFIX = "set-aside-"


def check_save_dir(save_dir: str) -> None:
    """Create ``save_dir`` if needed and prove it writable (``ValueError`` if not)."""
    path = Path(save_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"--save {save_dir}: cannot write there ({reason})") from None


def check_not_overwriting(save_dir: str, resume: str | None) -> None:
    """A fresh run must not write over another run's checkpoints."""
    found = complete_checkpoints(save_dir)
    if found and resume is None:
        raise ValueError(
            f"--save {save_dir} already holds checkpoints (newest: {found[-1].name});"
            f" pass --resume auto to continue that run, or choose another directory"
        )


def find_resume(resume: str | None, save_dir: str | None) -> Path | None:
    """The checkpoint to start from: ``--resume`` resolved, or ``None`` to start fresh."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(save_dir) if save_dir else []
        return found[-1] if found else None
    if not os.path.exists(resume):
        raise CheckpointError(f"--resume {resume}: no such file or directory")
    return resolve(resume)


def newest_or(save_dir: str | None, fallback: Path | None) -> Path | None:
    """After a failure: the newest checkpoint of ``--save``, else what the run started from."""
    found = complete_checkpoints(save_dir) if save_dir else []
    return found[-1] if found else fallback


def open_verified(path: Path, model: dict) -> Checkpoint:
    """Open ``path``, check every file's size and checksum and that it holds ``model``."""
    ckpt = Checkpoint(path)
    ckpt.verify()
    stored = ckpt.meta.get("model", {})
    for key, value in model.items():
        if stored.get(key) != value:
            raise CheckpointError(
                f"{path}: holds a model with {key} {stored.get(key)}, this run has {key} {value}"
            )
    return ckpt


def in_the_way(save_dir: str, start_step: int) -> list[Path]:
    """``step-`` entries of ``save_dir`` a run starting after ``start_step`` could collide
    with: newer ones, complete or not."""
    return [
        p for p in step_entries(save_dir) if (step := step_of(p)) is not None and step > start_step
    ]


def branch_problem(save_dir: str, start: Path | None, start_step: int, entries: list[Path]) -> str:
    """The one line refusing to train into ``entries`` (see ``in_the_way``)."""
    names = ", ".join(
        p.name + ("" if (p / MANIFEST).is_file() else " (no manifest.json: damaged or incomplete)")
        for p in entries
    )
    where = f"--resume {start} is at step {start_step}" if start else "a fresh run starts at 0"
    return (
        f"{where}, but --save {save_dir} also holds the newer {names}, which this run "
        f"would collide with; pass --branch to move them into {save_dir}/"
        f"{SET_ASIDE_PREFIX}<run id>/ and train on from there, or choose another --save"
    )


def set_aside(save_dir: str, entries: list[Path], run: str) -> Path:
    """Move ``entries`` (untouched) into ``save_dir/set-aside-<run>/``; return that folder."""
    folder = Path(save_dir) / f"{SET_ASIDE_PREFIX}{run}"
    folder.mkdir(exist_ok=True)
    for entry in entries:
        os.rename(entry, folder / entry.name)
    return folder
