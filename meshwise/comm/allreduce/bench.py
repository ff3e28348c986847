"""Bandwidth and latency of each all-reduce algorithm per size (``meshwise bench comm``).

A call's time is the slowest rank's after a barrier, reported as the median of the
repeats; bus bandwidth follows nccl-tests (``size / time * 2 (p-1) / p``); latency is
the time of the smallest size.
"""

from __future__ import annotations

import statistics
from functools import partial

import torch

from meshwise.comm import ops
from meshwise.comm.allreduce.algorithms import Topology
from meshwise.comm.allreduce.allreducer import AllReducer
from meshwise.comm.timing import slowest, timed_runs


def measure(group: ops.Group, settings: dict) -> dict:
    """Every rank calls this; returns the results (the same on every rank).

    ``settings``: ``algorithms``, ``sizes`` (bytes), ``repeats``, ``per_node``
    (ranks per node), ``device``."""
    topology = Topology.of(group.ranks, settings["per_node"])
    device = settings.get("device", "cpu")
    p = group.size
    rows, cost = [], None
    for algorithm in settings["algorithms"]:
        reducer = AllReducer(group, algorithm, topology, category="bench")
        if algorithm == "adaptive":
            cost = reducer.cost
        for nbytes in settings["sizes"]:
            buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            runs = timed_runs(partial(reducer.all_reduce, buf), settings["repeats"], device, group)
            t = statistics.median(slowest(runs, group, device))
            row = {
                "algorithm": algorithm,
                "bytes": nbytes,
                "time_s": t,
                "busbw_gbps": nbytes / t * 2 * (p - 1) / p / 1e9,
            }
            if algorithm == "adaptive":
                row["picked"] = reducer.pick(nbytes)
            rows.append(row)
    native = {r["bytes"]: r["time_s"] for r in rows if r["algorithm"] == "native"}
    for r in rows:
        if r["bytes"] in native:
            r["speedup_vs_native"] = native[r["bytes"]] / r["time_s"]
    out = {
        "world_size": p,
        "ranks_per_node": settings["per_node"],
        "nodes": topology.num_nodes,
        "backend": ops.backend(group),
        "results": rows,
    }
    if cost is not None:
        out["cost_model"] = cost.describe()
    return out
