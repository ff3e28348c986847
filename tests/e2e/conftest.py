import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.e2e import forked_cli

# A small model and corpus so a whole run takes seconds.
# --peak-tflops spares each run the CPU's start-up measurement for MFU (half a second);
# the tests of MFU measure it.
SMALL = [
    "--n-layer",
    "2",
    "--d-model",
    "64",
    "--n-head",
    "4",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--warmup-steps",
    "2",
    "--lr",
    "3e-3",
    "-q",
    "--peak-tflops",
    "1",
]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """About 200 KB of Python source from the standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / name).read_bytes() for name in ("inspect.py", "argparse.py"))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(text)
    return path


def run_cli(*args, cwd=None, env_extra=None, timeout=240):
    """``meshwise ARGS`` as its own process: forked from a server that has imported the
    CLI (``tests.e2e.forked_cli``), or a fresh interpreter where ``env_extra`` changes
    what a process reads as it starts."""
    env = dict(os.environ, MESHWISE_CACHE=str(Path(cwd or ".") / "cache"), PYTHONUNBUFFERED="1")
    if not env_extra and sys.platform.startswith("linux"):
        return forked_cli.run([str(a) for a in args], cwd, env, timeout)
    for name, value in (env_extra or {}).items():  # None: leave the variable unset
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run(
        [sys.executable, "-m", "meshwise", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics_written(path: Path) -> int:
    """Whole metrics lines in ``path`` so far, while a run may be writing its next one."""
    return path.read_text().count("\n") if path.exists() else 0


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not), as the kernel's /proc says."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def run_main(*args, cwd, env_extra=None) -> subprocess.CompletedProcess:
    """``meshwise ARGS`` in this process: for what ends before any rank starts (exit 2).

    The CLI's own code path (``meshwise.cli.main.main``) without an interpreter and
    torch start-up per case; ``run_cli`` keeps the real process for the rest.
    """
    import contextlib
    import io

    from meshwise.cli.main import main

    env = {"MESHWISE_CACHE": str(Path(cwd) / "cache"), **(env_extra or {})}
    saved_env = {name: os.environ.get(name) for name in env}
    saved_cwd = os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.update(env)
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:  # argparse's own errors
                code = exc.code
    finally:
        os.chdir(saved_cwd)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def in_small_filesystem(size: str, mount_point: Path, command: list, timeout: float):
    """``command`` with ``mount_point`` a fresh tmpfs of ``size`` (a private mount
    namespace, so it vanishes with the command): a full disk on demand. What it held
    at the end is copied to ``mount_point`` + ``-after``. Skips where it cannot mount."""
    if not shutil.which("unshare") or not sys.platform.startswith("linux"):
        pytest.skip("needs unshare (Linux) to mount a small file system")
    mount_point.mkdir()
    namespace = ["unshare", "--mount"] + (["--map-root-user"] if os.getuid() else [])
    mount = f"mount -t tmpfs -o size={size} meshwise-test {mount_point}"
    probe = subprocess.run([*namespace, "sh", "-c", mount], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    after = mount_point.with_name(mount_point.name + "-after")
    script = f'{mount} && {{ "$@"; rc=$?; cp -a {mount_point} {after}; exit $rc; }}'
    return subprocess.run(
        [*namespace, "sh", "-c", script, "sh", *map(str, command)],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
