"""``--compress`` / ``--allreduce`` for the trainer: compressor, dp reducer, their metrics."""

from __future__ import annotations

import logging

from meshwise.comm.allreduce.algorithms import Topology
from meshwise.comm.allreduce.reducer import GradReducer
from meshwise.comm.compression.compressor import Compressor
from meshwise.comm.compression.compressors import build_compressor
from meshwise.mesh import Mesh
from meshwise.train.config import TrainConfig

log = logging.getLogger("meshwise")

# Algorithms as the metrics name them (adaptive reports the one it picked; "p2p" is
# int8's all-to-all), in a fixed order so every rank reduces the same vector.
REPORTED = ("native", "ring", "tree", "hierarchical", "p2p")


def grad_compressor(mesh: Mesh, cfg: TrainConfig) -> Compressor | None:
    """The gradient compressor of ``--compress`` over dp (and cp, whose ranks sum the
    same gradients; ``None``: none, or no such axis)."""
    c = cfg.comm
    if c.compress == "none" or mesh.dp_cp_group.size == 1:
        return None
    return build_compressor(
        c.compress,
        error_feedback=c.error_feedback == "on",
        warmup_steps=c.compress_warmup_steps,
        topk_ramp_steps=c.topk_ramp_steps,
    )


def grad_reducer(mesh: Mesh, cfg: TrainConfig, compressor: Compressor | None) -> GradReducer | None:
    """The dp (x cp) reducer when compression or an algorithm asks for one (``None``:
    the engines use the group's native collectives). Under ``--dp-shard`` it sums
    across the replicas (the slow links); within a replica the reduction is native."""
    c = cfg.comm
    group = mesh.replicate_group if mesh.replicate_group is not None else mesh.dp_cp_group
    if (compressor is None and c.allreduce == "native") or group.size == 1:
        return None
    per_node = c.ranks_per_node or mesh.dims.world_size
    reducer = GradReducer(group, compressor, c.allreduce, Topology.of(group.ranks, per_node))
    if mesh.rank == 0:
        log.info(
            "%s gradient sync: --compress %s (error feedback %s), --allreduce %s, "
            "%d ranks per node",
            "cross-replica" if mesh.replicate_group is not None else "dp",
            c.compress,
            c.error_feedback,
            c.allreduce,
            per_node,
        )
    return reducer


class GradCommStats:
    """Per-step communication metrics: exposed wait, compression ratio, per-algorithm use."""

    def __init__(self, counters, reducer: GradReducer | None):
        self.counters, self.reducer = counters, reducer
        self._last = self._now()
        self._exposed = counters.exposed_s("grad")

    def _now(self) -> list[float]:
        if self.reducer is None:
            return []
        calls, nbytes = self.reducer.algorithm_stats()
        return (
            [self.reducer.raw_bytes, self.reducer.sent_bytes]
            + [calls.get(a, 0) for a in REPORTED]
            + [nbytes.get(a, 0.0) for a in REPORTED]
        )

    def add_to(self, values) -> None:
        """This step's counts, into ``values`` (a ``RankValues``) to be combined."""
        now = self._now()
        delta = [a - b for a, b in zip(now, self._last)]
        self._last = now
        if self.reducer is not None:
            names = (
                ["raw_bytes", "sent_bytes"]
                + [f"calls.{a}" for a in REPORTED]
                + [f"bytes.{a}" for a in REPORTED]
            )
            for name, value in zip(names, delta):
                values.add(name, value, "sum")

    def record(self, combined: dict[str, float]) -> dict:
        """The metrics keys, from the combined numbers. ``comm_exposed_s`` is this
        rank's own, read after the step's host read (on a GPU its CUDA events are
        complete only then), as the time breakdown is."""
        exposed = self.counters.exposed_s("grad")
        record = {"comm_exposed_s": exposed - self._exposed}
        self._exposed = exposed
        if self.reducer is None:
            return record
        sent = combined["sent_bytes"]
        record["compress_ratio"] = combined["raw_bytes"] / sent if sent else 1.0
        for kind in ("calls", "bytes"):
            counts = {a: int(combined[f"{kind}.{a}"]) for a in REPORTED}
            record[f"allreduce_{kind}"] = {a: n for a, n in counts.items() if n}
        return record

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.close()
