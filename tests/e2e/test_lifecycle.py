"""The process around training: stuck ranks, signals to the launcher, no orphans.

Each test starts a long run, acts on it from outside, and bounds how long the
job may take to end. ``_alive`` reads /proc, so the checks are the kernel's.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import SMALL, read_metrics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux signals")


def _start(tmp_path, corpus, *flags):
    env = dict(os.environ, MESHWISE_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshwise", "train", *map(str, SMALL), "--data", str(corpus),
         "--dp", "2", "--steps", "100000", "--metrics", str(metrics), *flags],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until both ranks train
        if metrics.exists() and len(read_metrics(metrics)) >= 2:
            ranks = _ranks(proc.pid)
            if len(ranks) == 2:
                return proc, ranks
        if proc.poll() is not None:
            pytest.fail(f"the run ended early:\n{proc.stderr.read()}")
        time.sleep(0.05)
    _kill_group(proc.pid)
    pytest.fail("the run did not start training within 60 s")


def _kill_group(pid: int) -> None:
    """Clean up whatever is left of the job's process group (often nothing)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _ranks(launcher: int) -> list[int]:
    """The launcher's child processes: its ranks (forked on the CPU)."""
    out = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout
    return sorted(int(pid) for pid in out.split())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, seconds: float) -> float:
    start = time.monotonic()
    while any(_alive(p) for p in pids):
        if time.monotonic() - start > seconds:
            for p in pids:
                if _alive(p):
                    os.kill(p, signal.SIGKILL)
            pytest.fail(f"ranks {pids} still alive after {seconds} s")
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_stopped_rank_ends_the_job_after_the_timeout(tmp_path, corpus):
    proc, ranks = _start(tmp_path, corpus, "--timeout-s", "5")
    os.kill(ranks[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        _kill_group(proc.pid)
    took = time.monotonic() - stopped_at
    assert proc.returncode == 1, err
    assert took < 20, took  # 5 s timeout + failure grace; gloo's default is 30 minutes
    assert "timed out" in err and "on group" in err and "step" in err, err
    assert "Traceback" not in err, err  # an expected stop: one line, not a traceback
    _wait_gone(ranks, 10)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_or_ctrl_c_stop_every_rank(tmp_path, corpus, signum, code):
    proc, ranks = _start(tmp_path, corpus)
    os.kill(ranks[1], signal.SIGSTOP)  # one rank cannot react: it must be killed
    os.kill(proc.pid, signum)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        _kill_group(proc.pid)
    assert proc.returncode == code, err
    assert "all 2 ranks stopped" in err, err
    assert not any(_alive(p) for p in ranks)  # gone before the launcher said so


def test_ranks_die_with_a_killed_launcher(tmp_path, corpus):
    proc, ranks = _start(tmp_path, corpus)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert _wait_gone(ranks, 10) < 10
