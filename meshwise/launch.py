"""Start the ranks of a job: spawn them locally, or join a ``torchrun`` launch.

Locally, ``world_size`` processes are spawned on loopback with a free port. The
first rank that fails ends the job: its rank and traceback are printed, the
other ranks are terminated, and the exit status is non-zero. Under ``torchrun``
(its environment variables present) this process is one rank and torchrun does
the supervising.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import traceback
from typing import Callable

import torch

from meshwise.comm import ops

log = logging.getLogger("meshwise")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RankFailed(RuntimeError):
    """A rank raised or died; the message holds its rank and traceback."""


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def torchrun_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


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
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
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


def _spawned_rank(local_rank: int, world_size: int, port: int, fn: Callable, args: tuple,
                  device: str, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    run_rank(fn, args, device, timeout_s, world_size)


def launch(fn: Callable, args: tuple, world_size: int, device: str, timeout_s: float) -> None:
    """Run ``fn(*args)`` on every rank; raise ``RankFailed`` if any rank fails.

    ``fn`` must be importable (a module-level function): ranks are spawned.
    """
    if under_torchrun():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        run_rank(fn, args, device, timeout_s, local)
        return
    if world_size == 1:  # in this process: no spawn cost
        try:
            _spawned_rank(0, 1, free_port(), fn, args, device, timeout_s)
        except Exception:
            raise RankFailed(f"rank 0 failed:\n{traceback.format_exc()}") from None
        return
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _spawned_rank, args=(world_size, free_port(), fn, args, device, timeout_s),
        nprocs=world_size, join=False, start_method="spawn")
    try:
        # join() terminates the remaining ranks as soon as one fails.
        while not context.join(timeout=0.5):
            pass
    except mp.ProcessRaisedException as exc:
        raise RankFailed(f"rank {exc.error_index} failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise RankFailed(f"rank {exc.error_index} exited with code {exc.exit_code} "
                         f"(signal {exc.signal_name})" if exc.signal_name else
                         f"rank {exc.error_index} exited with code {exc.exit_code}") from None
    except KeyboardInterrupt:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(timeout=10)
        print("meshwise: interrupted; all ranks stopped", file=sys.stderr)
        raise
