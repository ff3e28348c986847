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

from tests.e2e.conftest import SMALL, metrics_written
from tests.e2e.conftest import process_alive as _alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux signals")


def _start(tmp_path, corpus, *flags):
    return _start_ranks(tmp_path, corpus, 2, *flags)


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


def _signal_and_wait(proc, pid: int, signum: int, timeout: float = 60) -> tuple[str, float]:
    """Send ``signum`` to ``pid``; the job's stderr and how long it took to end."""
    os.kill(pid, signum)
    sent_at = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        _kill_group(proc.pid)
    return err, time.monotonic() - sent_at


@pytest.mark.parametrize("stopped", [0, 1])  # rank 0's process used to host the store
def test_a_stopped_rank_ends_the_job_after_the_timeout(tmp_path, corpus, stopped):
    timeout_s = 3
    proc, ranks = _start(tmp_path, corpus, "--timeout-s", str(timeout_s))
    err, took = _signal_and_wait(proc, ranks[stopped], signal.SIGSTOP)
    assert proc.returncode == 1, err
    assert took < timeout_s + 5, took  # the promise (DESIGN 4); it hung with rank 0 stopped
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"meshwise train: rank {stopped}: timed out: its process was stopped")
    assert f"--timeout-s {timeout_s} " in line, err
    assert "Traceback" not in err and "DistStoreError" not in err, err  # one line
    _wait_gone(ranks, 10)


@pytest.mark.parametrize(
    "signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)]
)
def test_sigterm_ctrl_c_or_a_closed_terminal_stop_every_rank(tmp_path, corpus, signum, code):
    proc, ranks = _start(tmp_path, corpus)
    os.kill(ranks[1], signal.SIGSTOP)  # one rank cannot react: it must be killed
    os.kill(proc.pid, signum)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        _kill_group(proc.pid)
    assert proc.returncode == code, err
    assert f"meshwise: {signum.name}: all 2 ranks stopped" in err, err
    assert not any(_alive(p) for p in ranks)  # gone before the launcher said so


def test_ranks_die_with_a_killed_launcher(tmp_path, corpus):
    proc, ranks = _start(tmp_path, corpus)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert _wait_gone(ranks, 10) < 10


def _start_ranks(tmp_path, corpus, num_ranks, *flags, steps_done: int = 2):
    """A long run on ``num_ranks`` ranks, once they have trained ``steps_done`` steps:
    (launcher, rank pids)."""
    env = dict(os.environ, MESHWISE_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshwise",
            "train",
            *map(str, SMALL),
            "--data",
            str(corpus),
            "--dp",
            str(num_ranks),
            "--steps",
            "100000",
            "--metrics",
            str(metrics),
            *flags,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        return proc, _wait_for_steps(proc, metrics, num_ranks, steps_done)
    except BaseException:
        _kill_group(proc.pid)  # a run of 100,000 steps must not outlive its test
        raise


def _wait_for_steps(proc, metrics, num_ranks: int, steps_done: int) -> list[int]:
    """The rank pids once every rank trains and ``steps_done`` steps are logged."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if metrics_written(metrics) >= steps_done:
            ranks = _ranks(proc.pid)
            if len(ranks) == num_ranks:
                return ranks
        if proc.poll() is not None:
            pytest.fail(f"the run ended early:\n{proc.stderr.read()}")
        time.sleep(0.05)
    pytest.fail("the run did not start training within 60 s")


def _peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_single_rank_killed_like_by_the_oom_killer_is_named_with_its_peak(tmp_path, corpus):
    # One rank: still a child of the launcher. The launcher samples the rank's VmHWM every
    # 0.1 s and the rank resets it each step, so give it some steps' samples first.
    proc, ranks = _start_ranks(tmp_path, corpus, 1, steps_done=20)
    peak_gib = _peak_kib(ranks[0]) / 2**20
    err, took = _signal_and_wait(proc, ranks[0], signal.SIGKILL, timeout=30)
    assert proc.returncode == 1, err
    assert took < 15  # under 1 s on an idle machine
    assert "rank 0 was killed by signal SIGKILL (out of memory?)" in err, err
    assert "peak resident memory so far" in err, err
    reported = float(err.split("peak resident memory so far ")[1].split(" GiB")[0])
    assert abs(reported - peak_gib) < 0.05, (reported, peak_gib)


def _memory_cgroup(limit_bytes: int):
    """A fresh memory cgroup limited to ``limit_bytes`` (v1 or v2); its procs file, or skip."""
    for root, limit_file in (
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
        ("/sys/fs/cgroup", "memory.max"),
    ):
        group = os.path.join(root, f"meshwise-test-{os.getpid()}")
        try:
            os.makedirs(group, exist_ok=True)
            with open(os.path.join(group, limit_file), "w") as f:
                f.write(str(limit_bytes))
            return group
        except OSError:
            try:
                os.rmdir(group)
            except OSError:
                pass
    pytest.skip("no memory cgroup can be created here")


def test_out_of_memory_in_a_cgroup_names_the_rank_and_its_peak(tmp_path, corpus):
    group = _memory_cgroup(400 << 20)
    env = dict(os.environ, MESHWISE_CACHE=str(tmp_path / "cache"))
    # 19M parameters: 0.3 GB of weights, gradients and AdamW state (under the limit, so
    # not refused up front), plus the runtime and activations: more than the limit.
    big = ["--d-model", "512", "--n-head", "8", "--n-layer", "6"]

    def enter():
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "meshwise",
                "train",
                *map(str, SMALL),
                *big,
                "--data",
                str(corpus),
                "--dp",
                "1",
                "--steps",
                "3",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=enter,
        )
    finally:
        os.rmdir(group)
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "rank 0 was killed by signal SIGKILL (out of memory?)" in line, result.stderr
    assert "peak resident memory so far" in line and "memory limit here 0.39 GiB" in line


def test_sigint_to_one_rank_names_that_rank(tmp_path, corpus):
    proc, ranks = _start_ranks(tmp_path, corpus, 2)
    err, took = _signal_and_wait(proc, ranks[1], signal.SIGINT, timeout=30)
    assert proc.returncode == 1, err
    assert took < 15  # under 1 s on an idle machine
    assert "rank 1: interrupted (SIGINT to rank 1's process)" in err, err
    assert "rank 0" not in err and "Traceback" not in err, err
    _wait_gone(ranks, 10)
