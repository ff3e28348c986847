"""Per-step metrics: gathered from every rank, JSON lines, a progress line, the summary.

Only the logging rank (global rank 0) writes; every value it writes was
combined over the ranks first, in one collective (``RankValues``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from meshwise.comm import ops
from meshwise.device.clocks import host_to_device

log = logging.getLogger("meshwise")
COMBINE: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "max": max,
    "first": lambda column: column[0],
}


class RankValues:
    """One step's numbers from every rank, gathered in one collective and read once.

    Each value is a host number or a 0-dim device tensor, combined by ``sum``, ``max`` or
    ``first``; every rank adds the same names in the same order. ``gather`` all-gathers them as
    one float64 tensor and reads it on the host: the step's one wait for the device.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self._names: list[tuple[str, str]] = []
        self._values: list = []

    def add(self, name: str, value, op: str) -> None:
        self._names.append((name, op))
        self._values.append(value)

    def gather(self, group: ops.Group) -> dict[str, float]:
        numbers = [float(v) for v in self._values if not torch.is_tensor(v)]
        host = iter(host_to_device(numbers, torch.float64, self.device).split(1))
        mine = torch.cat(
            [
                v.to(torch.float64).reshape(1) if torch.is_tensor(v) else next(host)
                for v in self._values
            ]
        )  # (K,), in the order added
        every = torch.empty(group.size * mine.numel(), dtype=torch.float64, device=self.device)
        ops.all_gather(every, mine, group, category="metrics")
        rows = every.view(group.size, -1).tolist()  # (ranks, K): the step's one host read
        return {
            name: COMBINE[op]([row[k] for row in rows]) for k, (name, op) in enumerate(self._names)
        }


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class MetricsWriteError(RuntimeError):
    """The metrics file could not be written (a full disk, a vanished folder)."""


def loss_text(loss: float | None) -> str:
    """A loss as the progress line shows it; None: the batch had no labelled token."""
    return "- (no labelled token)" if loss is None else f"{loss:.4f}"


def strict_json(record: dict) -> dict:
    """``record`` with non-finite floats as ``null``, listed under ``non_finite``,
    so strict JSON parsers read every line (plain ``json.dumps`` writes ``NaN``)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: (None if k in bad else v) for k, v in record.items()}, "non_finite": bad}


def _lines_up_to(path: Path, step: int) -> str:
    """A resumed run keeps the metrics of the steps it does not redo."""
    if not path.is_file():
        return ""
    kept = [
        line
        for line in path.read_text().splitlines(keepends=True)
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    return "".join(kept)


class MetricsLog:
    """Writes one JSON object per optimizer step and shows progress.

    On a terminal the progress is one line rewritten in place; otherwise a plain
    line every ``log_every`` steps (and on the last step).
    """

    def __init__(
        self,
        path: str | None,
        total_steps: int,
        log_every: int,
        stream=None,
        resume_step: int = 0,
        quiet: bool = False,
    ):
        self.path = Path(path) if path else None
        self.quiet = quiet  # no progress lines, only the summary
        self.total_steps = total_steps
        self.log_every = log_every
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty()
        self.history: list[dict] = []
        self.start = time.perf_counter()
        self._file = None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = _lines_up_to(self.path, resume_step) if resume_step else ""
            self._file = open(self.path, "wb", buffering=0)  # each line reaches the OS whole
            if kept:
                self._file.write(kept.encode())

    def write(self, record: dict) -> None:
        self.history.append(record)
        if self._file:
            line = memoryview((json.dumps(strict_json(record), allow_nan=False) + "\n").encode())
            end = self._file.tell()
            try:
                while line:  # a full disk may take part of a line, then refuse the rest
                    line = line[self._file.write(line) :]
            except OSError as exc:
                with contextlib.suppress(OSError):  # not a regular file (/dev/full)
                    self._file.truncate(end)  # no half line: every line stays valid JSON
                raise MetricsWriteError(
                    f"cannot write --metrics {self.path}: {exc.strerror or exc}"
                ) from None
        self._show(record)

    def _show(self, record: dict) -> None:
        step = record["step"]
        elapsed = time.perf_counter() - self.start
        done = len(self.history)
        eta = elapsed / done * (self.total_steps - step) if done else float("nan")
        line = (
            f"step {step:>5}/{self.total_steps}  loss {loss_text(record['loss'])}  "
            f"grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
            f"{record['tokens_per_s']:,.0f} tok/s  ETA {_format_duration(eta)}"
        )
        if "val_loss" in record:
            line += f"  val_loss {loss_text(record['val_loss'])}"
        if "epoch" in record:  # --data-order epochs
            line += (
                f"  epoch {record['epoch']} "
                f"({record['epoch_windows'] / record['windows_per_epoch']:.0%})"
            )
        if self.quiet:
            return
        if self.interactive:
            # An evaluation's line stays; plain progress is rewritten in place.
            end = "\n" if step == self.total_steps or "val_loss" in record else ""
            self.stream.write("\r\033[K" + line + end)
            self.stream.flush()
        elif step % self.log_every == 0 or step == self.total_steps or step == 1:
            self.stream.write(line + "\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A message between progress lines (evaluations, samples)."""
        if self.interactive:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def summary(self, val_loss: float | None) -> str:
        if not self.history:
            return "no steps run"
        rates = [r["tokens_per_s"] for r in self.history[1:]] or [self.history[0]["tokens_per_s"]]
        first, last = self.history[0], self.history[-1]
        elapsed = _format_duration(time.perf_counter() - self.start)
        lines = [
            f"trained {len(self.history)} steps in {elapsed}",
            f"  loss {loss_text(first['loss'])} (step {first['step']}) -> "
            f"{loss_text(last['loss'])} "
            f"(step {last['step']})",
            f"  median throughput {statistics.median(rates):,.0f} tokens/s",
        ]
        lines += comm_summary(self.history)
        if val_loss is not None:
            lines.append(f"  validation loss {val_loss:.4f}")
        if self.path:
            lines.append(f"  metrics: {self.path}")
        return "\n".join(lines)

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def comm_summary(history: list[dict]) -> list[str]:
    """Gradient-sync lines of the summary: bytes, compression, exposed wait, algorithms."""
    n = len(history)
    sent = sum(r.get("grad_sync_bytes", 0) for r in history) / n
    line = f"  grad sync {sent / 2**20:,.2f} MiB/step (all ranks, on the wire)"
    if "compress_ratio" in history[-1]:
        line += f", compress ratio {statistics.median(r['compress_ratio'] for r in history):.1f}"
    exposed = [r["comm_exposed_s"] for r in history if "comm_exposed_s" in r]
    if exposed:
        line += f", exposed comm {statistics.median(exposed) * 1e3:.1f} ms/step"
    lines = [line]
    calls: dict = {}
    nbytes: dict = {}
    for r in history:
        for a, c in r.get("allreduce_calls", {}).items():
            calls[a] = calls.get(a, 0) + c
        for a, b in r.get("allreduce_bytes", {}).items():
            nbytes[a] = nbytes.get(a, 0) + b
    if calls:
        lines.append(
            "  dp reductions by algorithm: "
            + ", ".join(f"{a} {calls[a]} calls {nbytes.get(a, 0) / 2**20:,.2f} MiB" for a in calls)
        )
    return lines
