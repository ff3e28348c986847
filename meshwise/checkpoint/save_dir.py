"""One job's view of its ``--save`` directory: its temporary directories (named by run id),
what it may prune (its lineage, never the checkpoint resumed, links as links), and
room for the next checkpoint (docs/checkpoints.md "Disk space").
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from meshwise.checkpoint import manifest
from meshwise.checkpoint.lineage import Lineage
from meshwise.checkpoint.store import (
    TEMP_PREFIX,
    TRASH_PREFIX,
    CheckpointError,
    complete_checkpoints,
    step_dir_name,
    temp_dir,
)


def with_headroom(num_bytes: int) -> int:
    """Room for tensors of ``num_bytes`` with their safetensors headers and the manifest."""
    return num_bytes + num_bytes // 20 + (64 << 10)


@dataclass(frozen=True)
class SaveDir:
    """``path`` as job ``run`` uses it; ``lineage`` None counts every checkpoint as its own."""

    path: Path
    run: str = ""
    keep_last: int | None = None
    lineage: Lineage | None = None
    protect: frozenset = frozenset()  # never pruned: the checkpoint this run resumed from

    def temp_dir(self, step: int) -> Path:
        return temp_dir(self.path, step, self.run)

    def final_dir(self, step: int) -> Path:
        return self.path / step_dir_name(step)

    def belongs(self, meta: dict) -> bool:
        return self.lineage is None or self.lineage.holds(meta)

    def prepare(self, step: int, needed_bytes: int) -> str:
        """Make room and the temporary directory for ``step``; '' or the reason it cannot be."""
        final = self.final_dir(step)
        if final.exists() or final.is_symlink():
            return f"{final} already exists; a checkpoint is never overwritten"
        needed = with_headroom(needed_bytes)
        try:
            free = shutil.disk_usage(self.path).free
            pruned = []
            if free < needed and self.keep_last:  # what the save would prune anyway, first
                pruned = self.prune(self.keep_last - 1)
                free = shutil.disk_usage(self.path).free
            if free < needed:
                after = f" after pruning {len(pruned)} older (--keep-last)" if pruned else ""
                return (
                    f"cannot save step {step} in {self.path}: the checkpoint needs about "
                    f"{human_bytes(needed)}, {human_bytes(free)} is free{after}; free some "
                    "space, pass --keep-last, or choose another --save"
                )
            tmp = self.temp_dir(step)
            if tmp.exists():  # this job's own save of this step died (then it restarted)
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        except OSError as exc:
            return f"cannot save step {step} in {self.path}: {exc.strerror or exc}"
        return ""

    def ours(self) -> list[Path]:
        """This lineage's complete checkpoints that it may prune, oldest first."""
        protected = {Path(p).absolute() for p in self.protect}
        return [
            p
            for p in complete_checkpoints(self.path)
            if (meta := manifest.read_meta(p)) is not None
            and self.belongs(meta)
            and p.absolute() not in protected
        ]

    def prune(self, keep: int) -> list[Path]:
        """Remove all but the newest ``keep`` of this lineage's checkpoints (never a
        protected one); return what was removed."""
        ours = self.ours()
        doomed = ours[: len(ours) - keep] if keep else ours
        for path in doomed:
            remove(path)
        return doomed

    def discard_temporaries(self) -> list[Path]:
        """This job's own unfinished saves (a save that failed)."""
        mine = [p for p in stale_temporaries(self.path) if self.run and p.name.endswith(self.run)]
        for path in mine:
            shutil.rmtree(path, ignore_errors=True)
        return mine


def prune(save_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; return what was deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    return SaveDir(Path(save_dir)).prune(keep_last)


def remove(path: Path) -> None:
    """Remove a checkpoint: a link as a link, a directory by renaming it out of sight first
    (a crash half way leaves hidden trash, never a ``step-`` directory without its files)."""
    if path.is_symlink():
        path.unlink()
        return
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash)


def stale_temporaries(save_dir: str | os.PathLike) -> list[Path]:
    """Hidden leftovers of saves and removals (stale unless their job still runs: delete
    them only while holding the directory's lock)."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith((TEMP_PREFIX, TRASH_PREFIX)))


def checkpoint_bytes(path: Path) -> int:
    """What a checkpoint's files take, from its manifest (0 if it cannot be read)."""
    try:
        return sum(info["bytes"] for info in manifest.read(Path(path))["files"].values())
    except CheckpointError:
        return 0


def human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} B" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"
