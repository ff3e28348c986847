"""A flat buffer of parameters as checkpoints and the 3D gradient sync see it (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FlatRun:
    """One flat buffer of an engine, as a checkpoint sees it.

    ``names``: ``(parameter name, offset in the buffer, elements)``; ``save_range``: the
    ``[start, end)`` of the buffer this rank writes (its dp shard);
    ``tensors``: kind (``param``, ``exp_avg``, ``exp_avg_sq``) -> ``(tensor,
    base)``, the tensor holding buffer elements ``[base, base + numel)``.
    """

    names: list[tuple[str, int, int]]
    save_range: tuple[int, int]
    tensors: dict[str, tuple[torch.Tensor, int]]


def owned_values(runs: list[FlatRun]) -> dict[str, torch.Tensor]:
    """Each parameter's elements in this rank's dp shard, flat: over the dp ranks,
    every element once (also where every rank holds all of them)."""
    out = {}
    for run in runs:
        tensor, base = run.tensors["param"]
        start, end = run.save_range
        for name, offset, numel in run.names:
            lo, hi = max(offset, start), min(offset + numel, end)
            if lo < hi:
                out[name] = tensor[lo - base : hi - base]
    return out
