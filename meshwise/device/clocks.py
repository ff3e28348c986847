"""Waiting for a device, and timing its work with the device's own clock.

``Stopwatch`` and ``IntervalClock`` record CUDA events on a GPU (a host clock on the
CPU); ``synchronize`` waits for the device; ``host_to_device`` copies host numbers
without waiting for it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait until the work queued on ``device`` has finished (a no-op on CPU); read clocks after
    this, or they measure how fast the host queued the work.
    """
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    backend = getattr(torch, device.type, None)  # e.g. torch.xpu, torch.mps
    if backend is None or not hasattr(backend, "synchronize"):
        raise ValueError(
            f"cannot wait for device {device}: torch.{device.type}.synchronize does not exist"
        )
    backend.synchronize()


def host_to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host numbers (or a CPU tensor) on ``device`` without waiting for the device: on
    an accelerator through pinned memory, so the copy is queued like a kernel (a copy
    from pageable memory would wait for everything queued before it)."""
    tensor = values if torch.is_tensor(values) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class Stopwatch:
    """Seconds spent in marked intervals of a device's work.

    A host clock on the CPU; on a GPU a pair of CUDA events per interval on the current
    stream, and ``seconds()`` adds up those whose events have completed.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._seconds = 0.0
        self._events: list = []

    @contextmanager
    def measure(self):
        if not self.cuda:
            start = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._events.append((begin, end))

    def seconds(self) -> float:
        pending = []
        for begin, end in self._events:
            if end.query():
                self._seconds += begin.elapsed_time(end) / 1000.0
            else:
                pending.append((begin, end))
        self._events = pending
        return self._seconds

    def reset(self) -> None:
        self._seconds, self._events = 0.0, []


class IntervalClock:
    """Start and end of marked intervals of a device's work, in seconds from ``start()``.

    A host clock on the CPU; on a GPU a CUDA event per mark on the current stream, turned
    into seconds by ``intervals()`` once the device passed them. Recording never waits.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._origin = None
        self._marks: list = []

    def start(self) -> None:
        """Forget earlier intervals; times count from now."""
        self._marks = []
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        else:
            self._origin = time.perf_counter()

    def _now(self):
        if not self.cuda:
            return time.perf_counter() - self._origin
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def measure(self, label: str):
        begin = self._now()
        yield
        self._marks.append((label, begin, self._now()))

    def intervals(self) -> list[tuple[str, float, float]]:
        """``(label, start_s, end_s)`` of every interval since ``start()``, in order."""
        if not self.cuda:
            return list(self._marks)
        if self._marks:  # read after the step: the device is past them already
            self._marks[-1][2].synchronize()
        return [
            (label, self._origin.elapsed_time(b) / 1e3, self._origin.elapsed_time(e) / 1e3)
            for label, b, e in self._marks
        ]
