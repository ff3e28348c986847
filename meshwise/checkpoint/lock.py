"""One job at a time per ``--save`` directory: an exclusive lock on ``DIR/.meshwise-lock``.

The launcher holds it for the whole job (``meshwise.data.file_lock``); ranks forked from
it share the open file, so the directory stays locked while any runs. The file names its
holder; found without its lock, its holder died and its leftovers are safe to remove.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from meshwise.data import file_lock

log = logging.getLogger("meshwise")

LOCK_NAME = ".meshwise-lock"


class SaveDirBusy(ValueError):
    """Another live job holds the directory."""


class SaveDirLock:
    """``with SaveDirLock(dir, run_id) as lock:`` holds ``dir`` for this process.

    ``lock.stale`` is what a previous holder that died left in the file (or None).
    On a file system without locks the lock is skipped (``lock.held`` False)."""

    def __init__(self, save_dir: str | os.PathLike, run: str):
        self.path = Path(save_dir) / LOCK_NAME
        self.run = run
        self.stale: dict | None = None
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "SaveDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = file_lock.acquire(self.path, wait=False)
        except file_lock.LockBusy:
            raise SaveDirBusy(
                f"--save {self.path.parent} is in use by another meshwise job "
                f"({_describe(_holder(self.path))}); wait for it to end, or "
                "choose another --save"
            ) from None
        except OSError as exc:  # no locks on this file system (ENOLCK, EOPNOTSUPP)
            log.warning(
                "warning: --save %s cannot be locked (%s); nothing stops a second job "
                "from using it meanwhile",
                self.path.parent,
                exc.strerror or exc,
            )
            return
        self.stale = _holder(self.path) or None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "run": self.run,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)

    def release(self) -> None:
        """Remove the file (a clean exit leaves nothing stale) and unlock it."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            file_lock.release(self.path, fd)


def _holder(path: Path) -> dict:
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "it has not written its name yet"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, run {holder.get('run')}, "
        f"since {holder.get('since')}"
    )
