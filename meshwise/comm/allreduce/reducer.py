"""The dp gradient reduction of a bucket with ``--compress`` or a non-native ``--allreduce``.

The engines call ``start(key, flat, shard)`` where a bucket's last gradient arrives
and ``wait()`` on the handle before the optimizer step; the wait is exposed
communication (``counters.wait_s["grad"]``). See docs/compression.md.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from meshwise.comm import ops, policy
from meshwise.comm.allreduce.algorithms import Topology
from meshwise.comm.allreduce.allreducer import AllReducer
from meshwise.comm.compression.compressor import Compressor, NoCompression

log = logging.getLogger("meshwise")


class _Pending:
    """One bucket's reduction in flight; ``wait()`` exactly once."""

    def __init__(self, reducer: "GradReducer", future, stream=None):
        self._reducer, self._future, self._stream = reducer, future, stream
        self.done = False

    def wait(self) -> None:
        assert not self.done, "wait() called twice"
        device = self._stream.device if self._stream is not None else None
        with self._reducer.shared.waiting("grad", device):
            if self._future is not None:
                self._future.result()  # re-raises what the reduction raised
            if self._stream is not None:  # the caller's kernels wait for the reduction's
                torch.cuda.current_stream(device).wait_stream(self._stream)
        self.done = True
        self._reducer._landed()


class GradReducer:
    """Reduces gradient buckets over ``group``: compressor + all-reduce algorithm."""

    def __init__(
        self,
        group,
        compressor: Compressor | None = None,
        algorithm: str = "native",
        topology: Topology | None = None,
        overlap: bool = True,
        cost=None,
    ):
        self.shared = group.counters
        self._own = ops.CommCounters()
        self._group = ops.with_counters(group, self._own)
        self.comm = AllReducer(self._group, algorithm, topology, cost=cost, category="grad")
        self.compressor = compressor or NoCompression()
        # gloo: one background thread, in launch order (every rank launches buckets in the
        # same order), so the reduction overlaps the rest of backward. NCCL allows one
        # issuing thread per communicator: the chain is issued from the training thread on
        # a CUDA stream of its own, which the caller's stream waits for in ``wait``.
        threaded = overlap and policy.reduce_in_background(group)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshwise-grad") if threaded else None
        self._overlap = overlap
        self._streams: dict = {}  # CUDA device -> the reductions' own stream
        self._merged = 0.0
        self.raw_bytes = 0.0  # what uncompressed native collectives would have sent
        self.sent_bytes = 0.0

    def set_layouts(self, layouts: dict) -> None:
        """``{key: [(offset, shape), ...]}`` of each bucket's parameters (PowerSGD needs them)."""
        if hasattr(self.compressor, "set_layout"):
            for key, params in layouts.items():
                self.compressor.set_layout(key, params)

    def start(self, key, flat: torch.Tensor, shard: tuple[int, int] | None = None) -> _Pending:
        """Launch the sum of ``flat`` over the group (into ``flat``, or its ``shard``)."""
        self.raw_bytes += self.comm.uncompressed_bytes(
            flat.numel() * flat.element_size(), scatter=shard is not None
        )
        if self._pool is not None:
            return _Pending(self, self._pool.submit(self._reduce, key, flat, shard))
        if not (self._overlap and flat.device.type == "cuda"):
            self._reduce(key, flat, shard)
            return _Pending(self, None)
        stream = self._streams.get(flat.device)
        if stream is None:
            stream = self._streams[flat.device] = torch.cuda.Stream(flat.device)
        stream.wait_stream(torch.cuda.current_stream(flat.device))  # the gradient is ready
        with torch.cuda.stream(stream):
            self._reduce(key, flat, shard)
        return _Pending(self, None, stream)

    def _reduce(self, key, flat: torch.Tensor, shard) -> None:
        with torch.no_grad():
            self.compressor.reduce(key, flat, self.comm, scatter=shard is not None)
        if shard is not None:
            size = flat.numel() // self.comm.size
            assert shard == (self.comm.rank * size, (self.comm.rank + 1) * size), (
                f"shard {shard} is not this rank's equal chunk of the bucket"
            )

    def _landed(self) -> None:
        # What went on the wire joins the shared "grad" bytes at each wait; compress_ratio
        # sets it against raw_bytes (AllReducer.uncompressed_bytes, the same algorithm).
        sent = self._own.bytes_sent["grad"]
        self.shared.bytes_sent["grad"] += sent - self._merged
        self.sent_bytes += sent - self._merged
        self._merged = sent

    def algorithm_stats(self) -> tuple[dict, dict]:
        """Calls and bytes per algorithm actually used, since the start."""
        return dict(self.comm.calls), dict(self.comm.bytes)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
