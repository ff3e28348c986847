"""``--profile-steps A-B``: a ``torch.profiler`` Chrome trace of those steps on every rank, with
meshwise's named ranges; outside them nothing is recorded or marked (docs/watching.md).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from meshwise.device import ranges

log = logging.getLogger("meshwise")
_RANGE = re.compile(r"^(\d+)-(\d+)$")


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``A-B`` (1-based, inclusive) -> (A, B); ValueError naming a bad value."""
    if not text:
        return None
    m = _RANGE.match(text.strip())
    if m is None or not 1 <= int(m[1]) <= int(m[2]):
        raise ValueError(
            f"--profile-steps {text!r} is not a range of steps; valid: A-B with "
            "1 <= A <= B, e.g. 5-7"
        )
    return int(m[1]), int(m[2])


class StepProfiler:
    """Records steps ``first..last`` of this rank into ``folder`` (call ``step(s)``
    before each step and ``finish()`` at the end)."""

    def __init__(
        self, steps: tuple[int, int] | None, folder: str | Path, rank: int, device: torch.device
    ):
        self.steps, self.folder, self.rank = steps, Path(folder), rank
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._activities = activities
        self._profiler: torch.profiler.profile | None = None
        self.written: Path | None = None

    def step(self, step: int) -> None:
        if self.steps is None:
            return
        first, last = self.steps
        if step == first and self._profiler is None:
            self._profiler = torch.profiler.profile(
                activities=self._activities, record_shapes=True, with_stack=False
            )
            self._profiler.__enter__()
            ranges.recording(True)
        elif step == last + 1:
            self.finish()

    def finish(self) -> None:
        if self._profiler is None or self.steps is None:  # started only with steps to profile
            return
        ranges.recording(False)
        self._profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        first, last = self.steps
        self.written = self.folder / f"rank{self.rank}.steps{first}-{last}.pt.trace.json"
        self._profiler.export_chrome_trace(str(self.written))
        self._profiler = None
        if self.rank == 0:
            log.info(
                "profile of steps %d-%d written to %s (one trace per rank)",
                first,
                last,
                self.folder,
            )
