"""The files of a user's data: regular files only, listed in a stable order.

A FIFO, socket or device would block or fail its reader, so a listing skips
them (named in a warning) and a path given directly is refused; a symbolic
link to nothing, a loop or an unreadable entry is an error naming it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from meshwise.data.token_files import SIDECAR_SUFFIX

logger = logging.getLogger("meshwise")

SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a file as binary


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def list_files(
    root: Path, suffix: str = "", skip_dirs: frozenset = frozenset(), strict: bool = True
) -> list[str]:
    """Sorted POSIX relative paths of the regular files under ``root``.

    Hidden entries and meshwise's sidecars are skipped (a token file written inside its
    source folder does not feed the next build), and FIFOs, sockets and devices with a
    warning. A dangling link, a loop or an unreadable entry raises when ``strict`` (the
    user's own folder), else is skipped.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if not name.endswith(suffix) or name.startswith(".") or name.endswith(SIDECAR_SUFFIX):
                continue
            problem = file_problem(Path(dirpath) / name)
            if problem is None:
                found.append((rel_dir / name).as_posix())
            elif strict and not problem.startswith("not a regular file"):
                raise ValueError(
                    f"{Path(dirpath) / name} is {problem}; remove it or make it a readable file"
                )
            elif strict:
                logger.warning("warning: skipping %s: %s", Path(dirpath) / name, problem)
    return sorted(found)


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a document, or None for a regular file (links
    followed)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(path) else "missing"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop"
        return f"unreadable ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None if os.access(path, os.R_OK) else "unreadable (permission denied)"
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISDIR, "a directory"),
    )
    return "not a regular file (" + next((k for test, k in kinds if test(mode)), "special") + ")"
