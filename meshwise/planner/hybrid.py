"""Hybrid sharding in the planner: which ``--dp-shard`` values to try, and why one wins.

ZeRO over N ranks of a replica instead of all of dp keeps 16/N bytes per parameter at
ZeRO-3 (more than 16/dp) but sends only a shard, 1/N of the gradient, over the link
between replicas (the ZeRO-3 gathers and reduce-scatters stay inside the node): worth it
where dp crosses a slower link (Zhang et al. 2022, "MiCS"; FSDP's hybrid shard).
"""

from __future__ import annotations

from meshwise.planner.layout import Layout


def shard_options(layout: Layout, ranks_per_node: int) -> list[int]:
    """``dp_shard`` values to try besides all of dp (0): those whose replica (N consecutive
    dp ranks of ``tp x cp x pp`` each) fills part of one node, when dp crosses nodes. None
    under ep or compression (not composed yet) or without ZeRO (nothing sharded)."""
    if layout.zero == 0 or layout.ep > 1 or layout.compress != "none" or ranks_per_node <= 0:
        return []
    others = layout.tp * layout.cp * layout.pp
    if layout.dp * others <= ranks_per_node:
        return []  # dp in one node: nothing to keep off a slower link
    return [
        n for n in range(1, layout.dp) if layout.dp % n == 0 and ranks_per_node % (n * others) == 0
    ]


def cross_replica_bytes(layout: Layout, grad_bytes: float) -> float:
    """Gradient bytes a rank all-reduces across replicas per reduction: its shard (ZeRO 2-3,
    1/N of the gradient, N = dp-shard x cp) or the whole gradient (ZeRO 0-1)."""
    if layout.replicas == 1:
        return 0.0
    return grad_bytes / (layout.shard_size * layout.cp) if layout.zero >= 2 else grad_bytes


def why(layout: Layout) -> str:
    """One line: what ``--dp-shard`` trades in this layout."""
    n, dp = layout.shard_size * layout.cp, layout.dp * layout.cp
    state = {1: "8+8/N", 2: "4+12/N", 3: "16/N"}.get(layout.zero, "16")
    traffic = "1/N of the gradient" if layout.zero >= 2 else "the whole gradient (ZeRO 0-1)"
    return (
        f"--dp-shard {layout.shard_size}: ZeRO over N = {n} ranks in a node, {layout.replicas} "
        f"replicas; model state {state} B/param at ZeRO-{layout.zero} (N = {n}, not {dp}), "
        f"across nodes only {traffic} per reduction, parameters gathered inside the node"
    )
