"""``meshwise ARGS`` in a process forked from one that has imported torch and the CLI
once, for the end-to-end tests: the process a shell would start (its own pid and
session, working directory, environment, stdout, stderr and exit status) without an
interpreter's and torch's start-up per run, which cost the suite seconds of CPU each.

The server imports the CLI but runs no torch op, as ``meshwise`` does before forking its
own CPU ranks. Runs whose environment must be in place when a process starts (glibc's
``MALLOC_*``) start a real interpreter instead (``tests.e2e.conftest.run_cli``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests import forkserver

_context = None


def _server():
    global _context
    if _context is None:
        _context = forkserver.context()
    return _context


def _child(args: list[str], cwd: str, env: dict, out_path: str, err_path: str) -> None:
    os.setsid()  # a session of its own, as the tests' timeouts kill the whole group
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # as PYTHONUNBUFFERED would have it
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's
    sys.argv = [str(Path(sys.modules["meshwise"].__file__).parent / "__main__.py"), *args]
    from meshwise.cli.main import main

    sys.exit(main(args))


def run(args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python -m meshwise ARGS`` in ``cwd`` with exactly ``env``, as ``subprocess.run``
    with ``capture_output=True, text=True, timeout=timeout`` would return it."""
    command = [sys.executable, "-m", "meshwise", *args]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        process = _server().Process(target=_child, args=(args, str(cwd or "."), env, out, err))
        process.start()
        process.join(timeout)
        timed_out = process.exitcode is None
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever it left running
        except ProcessLookupError:
            pass
        process.join()
        stdout, stderr = Path(out).read_text(), Path(err).read_text()
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, process.exitcode, stdout, stderr)
