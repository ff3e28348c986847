"""Progress of a long single-process job (tokenizing a corpus) on stderr.

On a terminal: one bar redrawn in place, at most ten times a second. Otherwise
(a log file, CI): a plain line every ``every_s`` seconds, so logs stay short
and still show that the job is alive.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_BAR_WIDTH = 24
_REDRAW_S = 0.1


class Progress:
    """``update(done, total)`` as work finishes (bytes); ``close()`` at the end."""

    def __init__(self, label: str, stream: TextIO | None = None, every_s: float = 10.0):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty()
        self.every_s = _REDRAW_S if self.interactive else every_s
        self.start = self.last = time.perf_counter()
        self.drawn = False

    def update(self, done: int, total: int, note: str = "") -> None:
        """Show ``done`` of ``total`` with ``note`` (e.g. tokens so far) if it is time to."""
        now = time.perf_counter()
        if now - self.last < self.every_s:
            return
        self.last = now
        fraction = min(done / max(total, 1), 1.0)
        elapsed = now - self.start
        text = (
            f"{self.label}: {fraction:4.0%} {done / 1e6:,.1f}/{total / 1e6:,.1f} MB"
            f"{', ' + note if note else ''}, {done / 1e6 / max(elapsed, 1e-9):.1f} MB/s, "
            f"{elapsed:.0f} s"
        )
        if self.interactive:
            filled = int(fraction * _BAR_WIDTH)
            bar = "#" * filled + "." * (_BAR_WIDTH - filled)
            self.stream.write(f"\r\033[K[{bar}] {text}")
            self.drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Clear the bar, so the summary that follows starts on a clean line."""
        if self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
