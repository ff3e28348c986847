"""Tasks run by worker processes, their results taken in task order.

Workers are forked where allowed (a spawned one imports torch first); at most two
tasks per worker are in flight, so a stream of tasks holds only those in memory.
Ctrl-C, SIGTERM or a failed task ends the workers at once, not waited for.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _worker_init() -> None:
    # Ctrl-C reaches the whole process group: the parent stops the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def ordered_results(
    function: Callable[[T], R], tasks: Iterable[T], num_workers: int, in_process: bool = False
) -> Iterator[tuple[T, R]]:
    """``(task, function(task))`` for each task, in order: here when ``in_process`` (a
    small job), else in ``num_workers`` processes. ``function`` must be picklable (module level,
    or a ``functools.partial`` of one)."""
    if in_process:
        for task in tasks:
            yield task, function(task)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    pool = ProcessPoolExecutor(num_workers, mp_context=context, initializer=_worker_init)
    finished = False
    try:
        todo = iter(tasks)
        pending = deque(
            (task, pool.submit(function, task)) for _, task in zip(range(2 * num_workers), todo)
        )
        while pending:
            task, future = pending.popleft()
            result = future.result()
            following = next(todo, None)
            if following is not None:
                pending.append((following, pool.submit(function, following)))
            yield task, result
        finished = True
    finally:
        # Interrupted, or a task failed: their work is lost anyway, and a tokenizer busy in
        # native code could not be interrupted, so kill rather than wait.
        if not finished:
            _stop_workers(pool)
        pool.shutdown(wait=True, cancel_futures=True)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Kill the pool's worker processes (the executor has no public way before 3.14)."""
    kill = getattr(pool, "kill_workers", None)
    if kill is not None:
        kill()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
