"""An exclusive lock on a file (``flock``) that is removed when released.

The kernel drops a ``flock`` however its holder dies, so a crash leaves only the file;
removing it on release is safe, as a taker checks that the file it locked is still
the one at that path. Used beside token files being built and on ``--save`` folders.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class LockBusy(Exception):
    """Another process holds the lock (only when not waiting for it)."""


def acquire(path: Path, wait: bool) -> int:
    """An open descriptor of ``path`` holding its lock; ``LockBusy`` if taken and not
    ``wait``. ``OSError`` when the file system has no locks."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise LockBusy(str(path)) from None
        except OSError:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # its holder removed it between our open and our lock: start over


def release(path: Path, fd: int) -> None:
    """Remove ``path`` and unlock (in that order: a taker then finds a new file)."""
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)
