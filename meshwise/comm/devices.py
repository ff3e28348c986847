"""Which device a rank computes on, and waiting for it.

Nothing here touches an accelerator's API unless the device is one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; others as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


BF16_CAPABILITY = (8, 0)  # CUDA's bfloat16 arithmetic starts with Ampere
BF16_NCCL = (2, 10)  # the first NCCL that carries bfloat16


def resolve_dtype(dtype: str, device: str, bf16_ready) -> str:
    """``auto`` -> ``bf16`` (bf16 compute, fp32 master weights) on CUDA when
    ``bf16_ready()`` (``takes_bf16`` of the job's GPUs), else ``fp32``; others as
    given. ``bf16_ready`` is asked only for ``auto`` on CUDA."""
    if dtype != "auto":
        return dtype
    return "bf16" if device == "cuda" and bf16_ready() else "fp32"


def takes_bf16(capabilities, nccl) -> bool:
    """Whether GPUs of these compute capabilities, with this NCCL version (None:
    no NCCL), compute in bfloat16 and carry it between ranks."""
    return (all(tuple(c) >= BF16_CAPABILITY for c in capabilities)
            and (nccl is None or tuple(nccl) >= BF16_NCCL))


_GPU_FACTS = """
import json, torch
gpus = [{"name": torch.cuda.get_device_name(i), "capability": torch.cuda.get_device_capability(i)}
        for i in range(torch.cuda.device_count())]
nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
print(json.dumps({"gpus": gpus, "nccl": nccl}))
"""


def gpu_facts() -> dict:
    """The visible GPUs (name, compute capability) and the NCCL version, asked of a
    short-lived child process: the launching process creates no CUDA context, so
    every rank gets its whole GPU (a context holds memory on the device it is on)."""
    out = subprocess.run([sys.executable, "-c", _GPU_FACTS], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise ValueError(f"cannot query the GPUs: {out.stderr.strip().splitlines()[-1:]}")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    facts["nccl"] = tuple(facts["nccl"]) if facts["nccl"] else None
    return facts


def rank_device(kind: str) -> torch.device:
    """The device this rank computes on: the CPU, or for ``cuda`` its local rank's GPU.

    ``LOCAL_RANK`` (set by ``meshwise train`` and by torchrun) indexes the GPUs
    this process sees, which ``CUDA_VISIBLE_DEVICES`` has already renumbered.
    Where a scheduler shows each process only its own GPU, that one GPU is the
    rank's whatever its ``LOCAL_RANK``.
    """
    if kind != "cuda":
        return torch.device(kind)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    visible = torch.cuda.device_count()
    if visible == 1:
        return torch.device("cuda", 0)
    if local_rank >= visible:
        raise RuntimeError(f"LOCAL_RANK {local_rank} but this process sees {visible} GPUs "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}); "
                           "start at most one rank per visible GPU on each node")
    return torch.device("cuda", local_rank)


def synchronize(device: torch.device | str) -> None:
    """Wait until the work queued on ``device`` has finished; a no-op on CPU.

    Accelerators run kernels asynchronously: a clock read right after a step
    measures how fast the host queued it, not how long it ran. Read clocks after
    this.
    """
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    backend = getattr(torch, device.type, None)  # e.g. torch.xpu, torch.mps
    if backend is None or not hasattr(backend, "synchronize"):
        raise ValueError(f"cannot wait for device {device}: torch.{device.type}.synchronize "
                         "does not exist")
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

    On the CPU a host clock. On a GPU each interval is a pair of CUDA events
    recorded on the current stream, so it measures when the work ran, not when
    the host queued it; ``seconds()`` adds up the intervals whose events have
    completed (all of them after a read that waited for the device)."""

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

    On the CPU a host clock. On a GPU each mark is a CUDA event recorded on the
    current stream (one at ``start()`` too), so it says when the work ran, not
    when the host queued it; ``intervals()`` turns them into seconds once the
    device has passed them (after the step's one host read), and recording
    never waits for the device."""

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
        return [(label, self._origin.elapsed_time(b) / 1e3, self._origin.elapsed_time(e) / 1e3)
                for label, b, e in self._marks]
