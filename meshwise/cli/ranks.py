"""Local rank processes watched from the launcher: how each one ended, and why the job did.

A traceback, an interruption, or a signal (an out-of-memory SIGKILL, with the peak
resident memory sampled from ``/proc``). The blame goes to the first rank, in the order
they ended, whose failure is not a consequence of a peer's (a closed connection).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class RankFailed(RuntimeError):
    """A rank raised or died; the message holds its rank and traceback."""


POLL_S = 0.1  # how often the launcher samples the ranks' memory while they run
FAILURE_GRACE_S = 1.0  # after a rank fails, the others (stuck in collectives) get this long
STOP_GRACE_S = 5.0  # how long ranks asked to stop get to exit before SIGKILL

# What a rank reports when a peer vanished under it: a consequence, not a cause.
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"ECONNRESET|EPIPE|connectFullMesh|Socket closed"
)
# What a rank reports when a peer did not answer in time.
TIMED_OUT = re.compile(r"CollectiveTimeout|timed out|DistStoreError")
# What a rank reports when other ranks never joined it (under torchrun: a node that
# stopped before starting its ranks, e.g. on an invalid flag).
NEVER_JOINED = re.compile(r"Timed out after \d+ seconds waiting for clients[^.]*\.[^.]*\.")


@dataclass
class Outcome:
    """How one rank ended: ``exitcode`` as multiprocessing reports it (negative: a signal)."""

    rank: int
    exitcode: int
    trace: str = ""  # the traceback of what it raised, if it raised
    peak_rss_bytes: int = 0

    @property
    def failed(self) -> bool:
        return self.exitcode != 0

    @property
    def consequence(self) -> bool:
        """Whether this rank only noticed that another one was gone."""
        return bool(self.trace) and bool(PEER_LOST.search(self.trace))


@dataclass
class RankWatch:
    """The peak resident memory seen so far of each rank process, and since when each is
    stopped (SIGSTOP, a debugger), from ``/proc`` (Linux)."""

    pids: list[int]
    peaks: dict[int, int] = field(default_factory=dict)
    stopped_since: dict[int, float] = field(default_factory=dict)

    def sample(self) -> None:
        now = time.monotonic()
        for rank, pid in enumerate(self.pids):
            status = _status(pid)
            peak = _kib_field(status, "VmHWM:") * 1024
            if peak:
                self.peaks[rank] = max(self.peaks.get(rank, 0), peak)
            if _stopped(status):
                self.stopped_since.setdefault(rank, now)
            else:
                self.stopped_since.pop(rank, None)

    def stopped_for(self, seconds: float) -> list[int]:
        """The ranks stopped for at least ``seconds``, as of the last sample."""
        now = time.monotonic()
        return sorted(r for r, since in self.stopped_since.items() if now - since >= seconds)


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


def _kib_field(status: str, name: str) -> int:
    for line in status.splitlines():
        if line.startswith(name):
            try:
                return int(line.split()[1])
            except (ValueError, IndexError):
                return 0
    return 0


def _stopped(status: str) -> bool:
    """``State: T (stopped)`` or ``t (tracing stop)``: it runs no code, its threads included."""
    return any(
        line.startswith("State:") and line.split()[1:2] in (["T"], ["t"])
        for line in status.splitlines()
    )


def stopped_message(rank: int, timeout_s: float) -> str:
    """One line for a rank whose process was stopped for ``timeout_s`` while its peers
    waited for it (the form of a collective's timeout)."""
    return (
        f"rank {rank}: timed out: its process was stopped (SIGSTOP or a debugger) for "
        f"--timeout-s {timeout_s:g} while its peers waited on it"
    )


def peak_rss_bytes(pid: int) -> int:
    """``VmHWM`` of a live process in bytes; 0 where it cannot be read."""
    return _kib_field(_status(pid), "VmHWM:") * 1024


def supervise(
    processes,
    error_files: list[str],
    watch: RankWatch,
    explain: Callable[..., str] | None = None,
    timeout_s: float | None = None,
) -> None:
    """Wait for every rank; on the first failure stop the rest and raise ``RankFailed``.

    ``error_files[i]``: rank i's pickled traceback (``torch.multiprocessing``'s convention).
    ``explain(rank, message, silent=...)`` may add what the ledgers say (``postmortem``).
    ``timeout_s``: a rank stopped this long ends the job, named, as its peers' waits would.
    """
    pending = {p.sentinel: rank for rank, p in enumerate(processes)}
    ended: list[int] = []
    watch.sample()  # at once: a forked rank can train and die within one poll
    while pending:
        _wait_some(pending, processes, ended, POLL_S)
        watch.sample()
        stopped = watch.stopped_for(timeout_s) if timeout_s else []
        if stopped:  # its peers wait on it; the launcher, never the stopped one, ends it
            stop_ranks(processes)
            raise RankFailed(stopped_message(stopped[0], timeout_s or 0.0))
        if any(processes[rank].exitcode != 0 for rank in ended):
            deadline = time.monotonic() + FAILURE_GRACE_S
            while pending and time.monotonic() < deadline:  # peers fail in their turn
                _wait_some(pending, processes, ended, deadline - time.monotonic())
            stop_ranks(processes)
            outcomes = [
                Outcome(
                    rank,
                    processes[rank].exitcode,
                    _trace(error_files[rank]),
                    watch.peaks.get(rank, 0),
                )
                for rank in ended
            ]
            culprit = blame(outcomes)
            if watch.stopped_since and timeout_s and TIMED_OUT.search(culprit.trace):
                # A peer's timeout is the stop's effect: name the stopped rank.
                raise RankFailed(stopped_message(min(watch.stopped_since), timeout_s))
            message = describe(culprit)
            if explain is not None:
                message = explain(culprit.rank, message, silent=not culprit.trace)
            raise RankFailed(message)


def _wait_some(pending: dict, processes, ended: list[int], timeout: float) -> None:
    for sentinel in multiprocessing.connection.wait(list(pending), timeout=max(timeout, 0)):
        rank = pending.pop(sentinel)
        processes[rank].join()
        ended.append(rank)


def _trace(error_file: str) -> str:
    try:
        with open(error_file, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return ""


def blame(outcomes: list[Outcome]) -> Outcome:
    """The failure that ended the job: the first (in the order ranks ended) that is not
    only a peer's loss noticed, else the first failure."""
    failed = [o for o in outcomes if o.failed]
    causes = [o for o in failed if not o.consequence]
    return (causes or failed)[0]


def describe(outcome: Outcome) -> str:
    """One line for a rank that died of a signal or exited; its traceback if it raised."""
    if outcome.trace:
        return failure_message(outcome.rank, outcome.trace)
    if outcome.exitcode >= 0:
        return f"rank {outcome.rank} exited with code {outcome.exitcode}"
    name = _signal_name(-outcome.exitcode)
    line = f"rank {outcome.rank} was killed by signal {name}"
    if -outcome.exitcode == signal.SIGKILL:
        facts = [
            f"peak resident memory so far {_gib(outcome.peak_rss_bytes)}"
            if outcome.peak_rss_bytes
            else "",
            f"memory limit here {_gib(memory_limit_bytes())}" if memory_limit_bytes() else "",
        ]
        line += " (out of memory?)" + "".join(
            f"{', ' if i else ': '}{fact}" for i, fact in enumerate(f for f in facts if f)
        )
    return line


# Errors that end a job for a reason the user can act on: reported in one line,
# without the traceback (which only matters for unexpected errors).
EXPECTED_ERRORS = (
    "CollectiveTimeout",
    "CollectiveDesync",
    "NcclRuleError",
    "NonFiniteError",
    "ConfigMismatch",
    "MetricsWriteError",
    "RankInterrupted",
    "MeshwiseError",
    "CheckpointWriteError",
    "LoggerError",
)
DEBUG_ENV = "MESHWISE_DEBUG"  # 1: every failed rank's whole traceback, expected or not


def failure_message(rank: int, trace: str) -> str:
    """``rank N: <message>`` for an expected stop or a lost peer, else (or with
    ``MESHWISE_DEBUG=1``) the rank's whole traceback."""
    last = trace.strip().splitlines()[-1] if trace.strip() else ""
    kind, _, message = last.partition(": ")
    debug = os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    if kind.rsplit(".", 1)[-1] in EXPECTED_ERRORS and not debug:
        return f"rank {rank}: {message}"
    never = NEVER_JOINED.search(last)
    if never:
        return (
            f"rank {rank}: the other ranks did not all start within --timeout-s "
            f"({never.group(0)}); the nodes that did not join say why"
        )
    lost = PEER_LOST.search(last)
    if lost:  # under torchrun the peer may be on another node: its output says why
        return (
            f"rank {rank}: lost its connection to another rank ({lost.group(0)}): that "
            "rank ended first, and its own output says why"
        )
    return f"rank {rank} failed:\n{trace}"


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def memory_limit_bytes() -> int:
    """The smaller of this machine's memory and this process's cgroup limit (0: unknown)."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for path in _cgroup_limit_files():
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits) if limits else 0


def _cgroup_limit_files() -> list[str]:
    """This process's memory limit files, cgroup v2 and v1."""
    found: list[str] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found.append(f"/sys/fs/cgroup{path}/memory.max")
        elif "memory" in controllers.split(","):
            found.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
    return found


def stop_ranks(processes) -> None:
    """SIGTERM every live rank, SIGKILL what is left after ``STOP_GRACE_S``, reap all.

    Further Ctrl-C, SIGTERM or SIGHUP are ignored meanwhile, so a second one cannot
    leave ranks behind.
    """
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    handlers = {s: signal.signal(s, signal.SIG_IGN) for s in stops}
    try:
        for process in processes:
            if process.is_alive():
                process.terminate()
                _resume(process.pid)  # a stopped rank takes its SIGTERM only once resumed
        deadline = time.monotonic() + STOP_GRACE_S
        for process in processes:
            process.join(timeout=max(deadline - time.monotonic(), 0))
        for process in processes:
            if process.is_alive():  # stopped (SIGSTOP) or ignoring SIGTERM
                process.kill()
        for process in processes:
            process.join()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
