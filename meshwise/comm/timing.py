"""Timing collectives from outside: the device finished, every rank started together.

Each clock read waits for the device first (on an accelerator a returned call is only
queued), and a collective's runs start after a barrier of its group, so no time
includes a late peer. The adaptive all-reduce's probe and ``bench comm`` time here.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from meshwise.comm import ops
from meshwise.device.clocks import synchronize


def timed_runs(
    fn: Callable[[], object], repeats: int, device="cpu", group: "ops.Group | None" = None
) -> list[float]:
    """Seconds each of ``repeats`` calls of ``fn`` took on ``device``, after one
    untimed warm-up call (connections, allocations). With ``group``, every call
    starts after a barrier of it (every rank of the group must call this)."""
    fn()
    times = []
    for _ in range(repeats):
        if group is not None:
            ops.barrier(group)
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def slowest(times: list[float], group: "ops.Group", device="cpu") -> list[float]:
    """Each entry's maximum over the ranks of ``group`` (one all-reduce): a
    collective takes as long as its slowest rank."""
    agreed = torch.tensor(times, dtype=torch.float64, device=device)
    ops.all_reduce(agreed, group, op="max", category="timing")
    return agreed.tolist()
