"""The launcher hosts the ranks' store: a rank that ends first (rank 0 included) or is
stopped takes nothing its peers still read, so a successful job ends without a store error.
"""

import multiprocessing
import os
import signal

from meshwise.cli import launch
from meshwise.cli.ranks import RankWatch, stopped_message


def _rank(rank: int, port: int, rank0_gone, failures) -> None:

    from meshwise.comm import ops

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    try:
        ops.init_process_group("gloo", 10.0, store_hosted=True)
        store = ops.open_store(10.0)
        if rank == 0:
            store.set("last-words", "rank 0")
        ops.barrier(ops.world_group())
        ops.destroy_process_group()
        if rank == 1:  # a peer's last read after the first rank's process has ended
            rank0_gone.wait(30)
            assert store.get("last-words") == b"rank 0"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)


def test_the_store_outlives_rank_0_for_a_peers_last_read():
    store = launch.host_store(10.0)
    ctx = multiprocessing.get_context("fork")
    rank0_gone, failures = ctx.Event(), ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, store.port, rank0_gone, failures)) for r in (0, 1)]
    for process in ranks:
        process.start()
    ranks[0].join(30)
    rank0_gone.set()
    ranks[1].join(30)
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert [p.exitcode for p in ranks] == [0, 0], errors


def test_a_stopped_rank_is_seen_stopped_and_named_in_one_line():
    child = multiprocessing.get_context("fork").Process(target=signal.pause)
    child.start()
    try:
        watch = RankWatch([os.getpid(), child.pid])
        watch.sample()
        assert watch.stopped_for(0) == []
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(100):  # the kernel marks it stopped shortly after the signal
            watch.sample()
            if watch.stopped_for(0):
                break
        assert watch.stopped_for(0) == [1]
        assert watch.stopped_for(3600) == []  # stopped, but not yet for that long
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    line = stopped_message(1, 3)
    assert line.startswith("rank 1: timed out: its process was stopped") and "\n" not in line
    assert "--timeout-s 3 " in line
