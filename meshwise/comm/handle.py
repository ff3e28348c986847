"""An operation in flight, the counters it feeds, and the one-line timeout error.

Apart from ``meshwise.comm.ops`` (which creates them) so that ops holds only calls.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from meshwise.device import ranges
from meshwise.device.clocks import Stopwatch


class CommCounters:
    """Bytes sent, calls made and seconds spent waiting, per category.

    A wait is exposed communication: the time the waiting side could not go on.
    On the CPU that is host time; on a GPU, where waiting makes the current
    stream wait, it is the stream's stall, timed with CUDA events as they
    complete (``exposed_s``)."""

    def __init__(self):
        self.bytes_sent = defaultdict(float)
        self.calls = defaultdict(int)
        self.wait_s = defaultdict(float)
        self._stream_waits: dict[str, Stopwatch] = {}

    def record(self, category: str, nbytes: float) -> None:
        self.bytes_sent[category] += nbytes
        self.calls[category] += 1

    @contextmanager
    def waiting(self, category: str, device: torch.device | None = None):
        """Count the time inside as a wait of ``category`` on ``device``."""
        if device is not None and device.type == "cuda":
            watch = self._stream_waits.setdefault(category, Stopwatch(device))
            with watch.measure():
                yield
            return
        start = time.perf_counter()
        yield
        self.wait_s[category] += time.perf_counter() - start

    def exposed_s(self, category: str) -> float:
        """Seconds of ``category``'s waits so far (on a GPU: those already completed)."""
        watch = self._stream_waits.get(category)
        return self.wait_s[category] + (watch.seconds() if watch else 0.0)

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()
        self.wait_s.clear()
        self._stream_waits.clear()


class CollectiveTimeout(RuntimeError):
    """A collective or transfer waited past its group's timeout; names the group and
    operation, and what the ranks' ledgers say about it."""


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def timeout_error(exc: BaseException, what: str, context=None) -> CollectiveTimeout:
    """One line naming the operation and group (and the ledgers' diagnosis)."""
    detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    message = f"{what} timed out: a rank of it did not arrive ({detail})"
    found = context.explain_stall() if context is not None else None
    return CollectiveTimeout(f"{message}; {found}" if found else message)


class Handle:
    """An in-flight async operation. ``wait()`` exactly once.

    ``entries``: its ledger entries, marked complete once waited for;
    ``context``: the rank's ``CommContext``, asked for a diagnosis on a timeout."""

    def __init__(
        self,
        works,
        counters: CommCounters | None,
        category: str,
        on_done=None,
        keep=None,
        what: str = "a collective",
        entries=(),
        context=None,
        device: torch.device | None = None,
    ):
        self._works = works if isinstance(works, list) else [works]
        self._keep = keep  # tensors that must outlive the transfer
        self._counters = counters
        self._category = category
        self._on_done = on_done
        self._what = what  # operation and group, named when it times out
        self._entries = [e for e in entries if e is not None]
        self._context = context
        self._device = device
        for entry in self._entries:
            entry.works = [w for w in self._works if w is not None]
        self.done = False

    def wait(self) -> None:
        assert not self.done, "Handle.wait() called twice"
        waiting = (
            self._counters.waiting(self._category, self._device)
            if self._counters is not None
            else contextlib.nullcontext()
        )
        with ranges.named(f"wait/{self._category}"), waiting:
            for work in self._works:
                if work is not None:
                    try:
                        work.wait()
                    except RuntimeError as exc:
                        for entry in self._entries:  # failed, not done: what peers wait for
                            entry.works = []
                        if is_timeout(exc):
                            raise timeout_error(exc, self._what, self._context) from None
                        raise
        self.done = True
        if self._context is not None and self._context.ledger is not None:
            for entry in self._entries:
                self._context.ledger.complete(entry)
        # Drop the works too: a finished work may still reference its tensors, and a
        # sent activation's memory is only returned once nothing references it.
        self._works, self._keep, self._entries = [], None, []
        if self._on_done is not None:
            self._on_done()
