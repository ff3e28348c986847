"""Start the ranks of a job: spawn them locally, or join a ``torchrun`` launch.

Locally, ``world_size`` processes are started on loopback with a free port. The
first rank that fails ends the job: its rank and traceback are printed, the
other ranks are terminated, and the exit status is non-zero. Under ``torchrun``
(its environment variables present) this process is one rank and torchrun does
the supervising.

Spawned ranks never outlive the launcher: each asks the kernel for SIGKILL when
its parent dies (Linux ``PR_SET_PDEATHSIG``), so even ``kill -9`` of the
launcher ends them. SIGTERM and Ctrl-C stop the ranks the same way: SIGTERM,
then after ``STOP_GRACE_S`` SIGKILL for what is still there (a stopped or hung
rank), and only then the launcher reports them stopped.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import socket
import sys
import traceback
from typing import Callable

import torch

from meshwise.cli.postmortem import JobFolder
from meshwise.comm import ops
from meshwise.comm.devices import rank_device

log = logging.getLogger("meshwise")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


STOP_GRACE_S = 5.0  # how long ranks asked to stop get to exit before SIGKILL
FAILURE_GRACE_S = 1.0  # after a rank fails, the others (stuck in collectives) get this long
_PR_SET_PDEATHSIG = 1


class RankFailed(RuntimeError):
    """A rank raised or died; the message holds its rank and traceback."""


class Stopped(Exception):
    """The launcher was asked to stop (SIGINT or SIGTERM); every rank is gone."""

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


def _threads_per_rank(num_local_ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // num_local_ranks)


def run_rank(fn: Callable, args: tuple, device: str, timeout_s: float,
             num_local_ranks: int) -> object:
    """Initialise this process's rank from the environment, run ``fn(*args)``, clean up."""
    if device == "cuda":
        torch.cuda.set_device(rank_device(device))
    else:
        torch.set_num_threads(_threads_per_rank(num_local_ranks))
    ops.init_process_group("nccl" if device == "cuda" else "gloo", timeout_s)
    try:
        result = fn(*args)
        # Tear down together: a rank that closes its connections while a peer's
        # transport still drains point-to-point traffic can abort that peer.
        ops.barrier(ops.world_group())
        return result
    finally:
        # Hooks make reference cycles that keep process groups alive; collect them
        # now so their teardown happens here, in order, not at interpreter exit.
        gc.collect()
        ops.destroy_process_group()


def die_with_parent(parent_pid: int) -> None:
    """Ask for SIGKILL when the launcher dies; exit now if it already has (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # died before the request took effect
        os._exit(1)


def _spawned_child(local_rank: int, world_size: int, port: int, fn: Callable, args: tuple,
                   device: str, timeout_s: float, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    # The tokenizers library disables its threads in a forked child, with a warning
    # on first use; say so up front instead.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _spawned_rank(local_rank, world_size, port, fn, args, device, timeout_s)


def _spawned_rank(local_rank: int, world_size: int, port: int, fn: Callable, args: tuple,
                  device: str, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    run_rank(fn, args, device, timeout_s, world_size)


def start_method(device: str) -> str:
    """How local ranks start: forked on the CPU, spawned for CUDA.

    A forked rank starts with the launcher's imports instead of importing torch
    again (2 ranks: 3.0 instead of 5.4 s to the end of a short run; 8 ranks: 8
    instead of 17 s on 2 cores). That is safe because the launcher has run no
    parallel torch op (no thread pool exists to be copied half-alive), holds no
    process group and has not used CUDA; a CUDA rank must be spawned, as CUDA
    cannot be used in a child forked after the parent touched it.
    """
    return "spawn" if device == "cuda" else "fork"


def launch(fn: Callable, args: tuple, world_size: int, device: str, timeout_s: float,
           ledger_out: str | os.PathLike | None = None) -> None:
    """Run ``fn(*args)`` on every rank; raise ``RankFailed`` if any rank fails.

    ``fn`` must be importable (a module-level function): CUDA ranks are spawned.
    ``ledger_out``: where the ranks' collective ledgers go when a local rank fails
    in a way its ledger explains (``meshwise.cli.postmortem``).
    """
    if under_torchrun():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        try:
            run_rank(fn, args, device, timeout_s, local)
        except Exception:
            raise RankFailed(failure_message(int(os.environ["RANK"]),
                                             traceback.format_exc())) from None
        return
    if world_size == 1:  # in this process: no spawn cost
        saved = {name: os.environ.get(name) for name in (*TORCHRUN_VARS, "LOCAL_WORLD_SIZE")}
        try:
            _spawned_rank(0, 1, free_port(), fn, args, device, timeout_s)
        except Exception:
            raise RankFailed(failure_message(0, traceback.format_exc())) from None
        finally:  # this process is not a torchrun rank afterwards
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return
    with JobFolder(ledger_out) as job:
        _spawn(fn, args, world_size, device, timeout_s, job)


def _spawn(fn: Callable, args: tuple, world_size: int, device: str, timeout_s: float,
           job: JobFolder) -> None:
    import torch.multiprocessing as mp

    saved = {name: os.environ.get(name) for name in job.env()}
    os.environ.update(job.env())  # the ranks inherit it
    try:
        context = mp.start_processes(
            _spawned_child, args=(world_size, free_port(), fn, args, device, timeout_s,
                                  os.getpid()),
            nprocs=world_size, join=False, start_method=start_method(device))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        # join() terminates the remaining ranks as soon as one fails.
        while not context.join(timeout=0.5, grace_period=FAILURE_GRACE_S):
            pass
    except mp.ProcessRaisedException as exc:
        raise RankFailed(job.explain(exc.error_index,
                                     failure_message(exc.error_index, str(exc)))) from None
    except mp.ProcessExitedException as exc:
        how = f" (signal {exc.signal_name})" if exc.signal_name else ""
        raise RankFailed(job.explain(exc.error_index, f"rank {exc.error_index} exited with "
                                                      f"code {exc.exit_code}{how}",
                                     silent=True)) from None
    except (KeyboardInterrupt, Stopped) as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        stop_ranks(context.processes)
        print(f"meshwise: {signal.Signals(signum).name}: all {world_size} ranks stopped",
              file=sys.stderr)
        raise Stopped(signum) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


# Errors that end a job for a reason the user can act on: reported in one line,
# without the traceback (which only matters for unexpected errors).
EXPECTED_ERRORS = ("CollectiveTimeout", "CollectiveDesync", "NcclRuleError", "NonFiniteError",
                   "ConfigMismatch", "MetricsWriteError")


def failure_message(rank: int, trace: str) -> str:
    """``rank N: <message>`` for an expected stop, else the rank's whole traceback."""
    last = trace.strip().splitlines()[-1] if trace.strip() else ""
    kind, _, message = last.partition(": ")
    if kind.rsplit(".", 1)[-1] in EXPECTED_ERRORS:
        return f"rank {rank}: {message}"
    return f"rank {rank} failed:\n{trace}"


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signum)


def stop_ranks(processes) -> None:
    """SIGTERM every live rank, SIGKILL what is left after ``STOP_GRACE_S``, reap all.

    Further Ctrl-C or SIGTERM are ignored meanwhile, so a second one cannot
    leave ranks behind.
    """
    handlers = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=STOP_GRACE_S)
        for process in processes:
            if process.is_alive():  # stopped (SIGSTOP) or ignoring SIGTERM
                process.kill()
        for process in processes:
            process.join()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
