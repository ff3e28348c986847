"""Start the ranks of a job: spawn them locally, each a child process so the first failure
is named, or join a ``torchrun`` launch. Ranks never outlive their launcher
(``PR_SET_PDEATHSIG``), the out-of-memory killer picks them first (``oom_score_adj``), and
a stop is SIGTERM, then SIGKILL after ``STOP_GRACE_S``.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import signal
import socket
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from meshwise.cli.postmortem import JobFolder

# Re-exported: callers catch launch.RankFailed and reach the rank watch through here.
from meshwise.cli.ranks import (  # noqa: F401
    EXPECTED_ERRORS,
    STOP_GRACE_S,
    RankFailed,
    RankWatch,
    failure_message,
    stop_ranks,
    supervise,
)
from meshwise.comm import ops
from meshwise.device.choice import rank_device
from meshwise.geometry.errors import MeshwiseError

log = logging.getLogger("meshwise")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
PACKAGE_DIR = Path(__file__).resolve().parents[1]
_PR_SET_PDEATHSIG = 1
# Added to a local rank's oom_score_adj, so that out of memory the kernel kills a rank
# and not the launcher, which is what names the rank and its peak memory then.
RANK_OOM_SCORE_ADJ = 300


class RankInterrupted(Exception):
    """This rank alone received SIGINT (a Ctrl-C reaches the launcher too, which stops all)."""


# Signals that stop the launcher and every rank, as Ctrl-C does: SIGHUP is a closed
# terminal or ssh session.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """The launcher was asked to stop (SIGINT, SIGTERM or SIGHUP); every rank is gone."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def torchrun_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cores_available() -> int:
    """The cores this process may run on: its CPU affinity (what taskset, a cpuset or a
    container allows) where the system says, else every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def threads_per_rank(num_local_ranks: int) -> int:
    """A CPU rank's share of the cores, so that the ranks on one machine do not each
    claim every core."""
    return max(1, cores_available() // num_local_ranks)


def ranks_here(hosts: list[str], host: str) -> int:
    """How many ranks of ``hosts`` (every rank's host name) run on ``host``."""
    return sum(name == host for name in hosts)


def run_rank(
    fn: Callable,
    args: tuple,
    device: str,
    timeout_s: float,
    num_local_ranks: int,
    store_hosted: bool = False,
) -> object:
    """Initialise this process's rank from the environment, run ``fn(*args)``, clean up.
    ``store_hosted``: the launcher hosts the store (``ops.init_process_group``)."""
    if device == "cuda":
        torch.cuda.set_device(rank_device(device))
    ops.init_process_group("nccl" if device == "cuda" else "gloo", timeout_s, store_hosted)
    if device != "cuda":
        if under_torchrun():  # several torchrun agents may share this machine
            host = socket.gethostname()
            num_local_ranks = ranks_here(ops.all_gather_object(host, ops.world_group()), host)
        torch.set_num_threads(threads_per_rank(num_local_ranks))
    try:
        try:
            result = fn(*args)
        except ValueError as exc:
            if raised_by_meshwise(exc) and not isinstance(exc, MeshwiseError):
                raise MeshwiseError(str(exc)) from exc
            raise
        # Tear down together: a rank that closes its connections while a peer's
        # transport still drains point-to-point traffic can abort that peer.
        ops.barrier(ops.world_group())
        return result
    finally:
        # Hooks make reference cycles that keep process groups alive; collect them
        # now so their teardown happens here, in order, not at interpreter exit.
        gc.collect()
        ops.destroy_process_group()


def raised_by_meshwise(exc: BaseException) -> bool:
    """Whether a ``raise`` statement of meshwise's own code raised ``exc``: by the house
    rule a user's mistake (a ``ValueError`` naming the bad value), not a failure inside."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    inside = Path(last.filename).resolve().is_relative_to(PACKAGE_DIR)
    return inside and (last.line or "").lstrip().startswith("raise")


def die_with_parent(parent_pid: int) -> None:
    """Ask for SIGKILL when the launcher dies; exit now if it already has (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # died before the request took effect
        os._exit(1)


def prefer_for_oom_kill() -> None:
    """Raise this process's ``oom_score_adj`` by ``RANK_OOM_SCORE_ADJ`` (Linux; raising
    it needs no privilege; elsewhere nothing)."""
    try:
        with open("/proc/self/oom_score_adj") as f:
            current = int(f.read())
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(min(1000, current + RANK_OOM_SCORE_ADJ)))
    except (OSError, ValueError):
        pass


def die_with_torchrun() -> None:
    """Under torchrun, end this rank when its agent (its parent) dies, even by ``kill -9``;
    peers on other nodes then fail at their next collective, within ``--timeout-s``.
    """
    if under_torchrun():
        die_with_parent(os.getppid())


def _spawned_child(
    local_rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    device: str,
    timeout_s: float,
    parent_pid: int,
    results: str,
) -> None:
    die_with_parent(parent_pid)
    prefer_for_oom_kill()
    for signum in STOP_SIGNALS:  # the launcher's handlers are not the rank's
        signal.signal(signum, signal.SIG_DFL)
    # The tokenizers library disables its threads in a forked child, with a warning
    # on first use; say so up front instead.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        result = run_rank(fn, args, device, timeout_s, world_size, store_hosted=True)
        _save_result(result, results, local_rank)
    except KeyboardInterrupt:
        # Raised, not swallowed: torch.multiprocessing would report a clean exit.
        raise RankInterrupted(f"interrupted (SIGINT to rank {local_rank}'s process)") from None


def start_method(device: str) -> str:
    """How local ranks start: forked on the CPU, spawned for CUDA.

    Forked ranks skip importing torch again (2 ranks: 3.0 instead of 5.4 s to the end of a
    short run; 8 ranks: 8 instead of 17 s on 2 cores), safe as the launcher ran no parallel
    torch op, holds no group and never used CUDA; CUDA ranks must be spawned.
    """
    return "spawn" if device == "cuda" else "fork"


def launch(
    fn: Callable,
    args: tuple,
    world_size: int,
    device: str,
    timeout_s: float,
    ledger_out: str | os.PathLike | None = None,
) -> list:
    """Run ``fn(*args)`` (importable: CUDA ranks are spawned) on every rank and return what
    each returned, by rank (picklable values); raise ``RankFailed`` if any fails. Under
    torchrun a process knows only its own rank's value: the others are None.
    ``ledger_out``: where the ledgers go when they explain a local failure.
    """
    if under_torchrun():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        rank = int(os.environ["RANK"])
        try:
            result = run_rank(fn, args, device, timeout_s, local)
        except KeyboardInterrupt:
            raise RankFailed(f"rank {rank}: interrupted (SIGINT)") from None
        except Exception:
            raise RankFailed(failure_message(rank, traceback.format_exc())) from None
        return [result if r == rank else None for r in range(torchrun_world_size())]
    with JobFolder(ledger_out) as job, tempfile.TemporaryDirectory(prefix="meshwise-") as results:
        _spawn(fn, args, world_size, device, timeout_s, job, results)
        return [
            torch.load(_result_file(results, rank), map_location="cpu", weights_only=False)
            for rank in range(world_size)
        ]


def _result_file(results: str, rank: int) -> Path:
    return Path(results, f"rank-{rank}.pt")


def _save_result(result: object, results: str, rank: int) -> None:
    """``result`` for the launcher to return; None, said on stderr, when it does not
    pickle (the work is done: a return value nobody may need must not fail the job)."""
    try:
        torch.save(result, _result_file(results, rank))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        print(
            f"meshwise: rank {rank} returned a value that does not pickle ({exc}); "
            "launch returns None for it",
            file=sys.stderr,
        )
        torch.save(None, _result_file(results, rank))


def _spawn(
    fn: Callable,
    args: tuple,
    world_size: int,
    device: str,
    timeout_s: float,
    job: JobFolder,
    results: str,
) -> None:
    import torch.multiprocessing as mp

    # Even one rank runs as a child: a rank killed by the kernel (out of memory)
    # must leave a launcher behind to say so. Forking it costs about 10 ms.
    listener = listening_socket()  # ranks may connect before the store serves it
    saved = {name: os.environ.get(name) for name in job.env()}
    os.environ.update(job.env())  # the ranks inherit it
    try:
        context = mp.start_processes(
            _spawned_child,
            args=(
                world_size,
                listener.getsockname()[1],
                fn,
                args,
                device,
                timeout_s,
                os.getpid(),
                results,
            ),
            nprocs=world_size,
            join=False,
            start_method=start_method(device),
        )
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    previous = {signum: signal.signal(signum, raise_stopped) for signum in STOP_SIGNALS}
    # Served once the ranks are forked (no fork of a process running the store's
    # thread) and held until every rank has ended, then shut down whatever the ending:
    # a traceback that kept it alive would leave its thread running into the next fork.
    store = host_store(timeout_s, listener)
    try:
        supervise(
            context.processes,
            context.error_files,
            RankWatch(context.pids()),
            explain=job.explain,
            timeout_s=timeout_s,
        )
    except (KeyboardInterrupt, Stopped) as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        stop_ranks(context.processes)
        print(
            f"meshwise: {signal.Signals(signum).name}: all {world_size} ranks stopped",
            file=sys.stderr,
        )
        raise Stopped(signum) from None
    finally:
        del store  # every rank has ended
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def listening_socket() -> socket.socket:
    """A local socket on a free port, already listening: connections queue until the
    store serves it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def host_store(timeout_s: float, listener: socket.socket | None = None):
    """The ranks' key-value store, served from this process on ``listener`` (which it
    takes over; None: a new one): a rank stopped or gone cannot take it with it (as rank
    0, its host otherwise, would), and it outlives every rank's last read."""
    listener = listener or listening_socket()
    port = listener.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),  # the store closes it
    )


def raise_stopped(signum, frame) -> None:
    """A signal handler: SIGTERM or SIGHUP unwinds the launcher like Ctrl-C (``Stopped``)."""
    raise Stopped(signum)
