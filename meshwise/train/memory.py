"""The process's memory as the operating system or the device allocator reports it, never
counted from meshwise's own tensors (that would match the ZeRO formula by construction).

``peak_mem_bytes``: the step's peak (CUDA's ``max_memory_allocated``; on the CPU ``VmHWM``,
reset through ``/proc/self/clear_refs``, else the run's); ``peak_rss_bytes``: the run's.
"""

from __future__ import annotations

import resource

import torch

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def status_kib(field: str, text: str | None = None) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``), or None where
    there is no such file or field; ``text``: status text already read."""
    if text is None:
        try:
            with open(_STATUS) as f:
                text = f.read()
        except OSError:
            return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            number, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"{field}: unexpected unit {unit!r} in {line!r}")
            return int(number)
    return None


def reset_rss_peak() -> bool:
    """Set the resident set's high-water mark to its current size (Linux >= 4.0);
    whether that worked."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")  # resets the resident set's high-water mark to the current size
        return True
    except OSError:
        return False


def _rusage_peak_bytes() -> int:
    """The resident set's peak since the process started (never reset; Linux: KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Per-step and whole-run peaks of this process's memory on ``device``."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        # Start-up, before any reset: what getrusage has seen so far.
        self._run_peak_rss = _rusage_peak_bytes()
        self.per_step = True

    def start_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._run_peak_rss = self.run_peak_rss_bytes()  # keep it past the reset
            self.per_step = reset_rss_peak()

    def step_peak_bytes(self) -> int:
        """The peak since ``start_step`` (see the module's docstring)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._rss_hwm()

    def run_peak_rss_bytes(self) -> int:
        """The resident set's peak over the whole run, start-up included."""
        return max(self._run_peak_rss, self._rss_hwm())

    @staticmethod
    def _rss_hwm() -> int:
        kib = status_kib("VmHWM")
        if kib is None:  # not Linux: getrusage's peak (never reset)
            return _rusage_peak_bytes()
        return kib * 1024
