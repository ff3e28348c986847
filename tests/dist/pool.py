"""A pool of gloo ranks kept alive across distributed tests.

Spawning fresh ranks costs several seconds per test on a small machine; a pool
costs that once per world size. ``run(fn, *args)`` executes the module-level
function ``fn`` on every rank and returns the per-rank results. A rank that
raises fails the call with that rank's traceback, and the pool is torn down (its
other ranks may be stuck in a collective) and started again on next use.
"""

from __future__ import annotations

import os
import queue
import time
import traceback


from meshwise.cli.launch import free_port
from tests import forkserver

COLLECTIVE_TIMEOUT_S = 60


class RankError(RuntimeError):
    pass


def _worker(rank: int, world_size: int, port: int, tasks, results, env: dict, cwd: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.chdir(cwd)  # the test process's directory and environment, not the fork server's
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    from meshwise.comm import ops

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    ops.start_ledger(COLLECTIVE_TIMEOUT_S)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs, agree = task
        try:
            value = fn(*args, **kwargs)
            if agree:  # every rank issued the same operations
                ops.check_ledger(COLLECTIVE_TIMEOUT_S)
            results.put((rank, True, value))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    ops.destroy_process_group()


def end_subgroups() -> None:
    """End every group but the world: each gloo group keeps threads polling its sockets,
    and hundreds of them left from earlier tests take a share of the CPU from every
    later one."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    for group in list(_world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = forkserver.context()  # ranks forked from a process that imported torch once
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port, env = free_port(), dict(os.environ)
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r],
                                                        self.results, env, os.getcwd()),
                                  daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 90, agree: bool = True, **kwargs) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs, agree))
        out = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead:
                raise RankError(f"rank(s) {dead} of the test pool died")
            try:
                rank, ok, value = self.results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RankError(f"ranks {sorted(pending)} did not finish in {timeout}s")
                continue
            if not ok:
                raise RankError(f"rank {rank} raised:\n{value}")
            out[rank] = value
            pending.discard(rank)
        return out

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class Pools:
    """One pool per world size, created on first use, restarted after a failure."""

    def __init__(self):
        self._pools: dict[int, WorkerPool] = {}

    def run(self, world_size: int, fn, *args, timeout: float = 90, agree: bool = True,
            **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; then, unless a test breaks agreement on
        purpose (``agree=False``: the pool is replaced afterwards), the ranks' ledgers
        must show the same operations (``ops.check_ledger``)."""
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = WorkerPool(world_size)
        try:
            result = pool.run(fn, *args, timeout=timeout, agree=agree, **kwargs)
        except BaseException:
            self._pools.pop(world_size).close(graceful=False)
            raise
        if not agree:
            self._pools.pop(world_size).close()
        return result

    def end_subgroups(self) -> None:
        """End the subgroups on every live pool (tests may keep theirs within a file)."""
        for world_size in list(self._pools):
            self.run(world_size, end_subgroups)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
