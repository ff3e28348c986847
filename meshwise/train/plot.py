"""Curves of metrics files (``meshwise plot``), several runs overlaid: loss, gradient norm,
tokens/s, peak memory, exposed communication and MFU against step, tokens or time.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

X_AXES = {"step": "step", "tokens": "tokens seen", "time": "training time (s)"}
PANELS = [  # key, title, scale (plotted value = value * scale), log y
    ("loss", "loss (dots: validation)", 1.0, False),
    ("grad_norm", "gradient norm", 1.0, True),
    ("tokens_per_s", "tokens/s", 1.0, False),
    ("peak_mem_bytes", "peak memory (MiB)", 1 / 2**20, False),
    ("comm_exposed_s", "exposed communication (ms)", 1e3, False),
    ("mfu", "MFU (%)", 100.0, False),
]


def read_run(path: str | Path) -> list[dict]:
    """A metrics file's records; ValueError naming the file and line of anything else."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as a metrics file ({exc})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not (isinstance(record, dict) and "step" in record and "loss" in record):
            raise ValueError(
                f"{path} line {number} is not a meshwise metrics line (one JSON "
                "object with step and loss per line, as --metrics writes)"
            )
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no metrics (an empty file)")
    return records


def x_values(records: list[dict], x: str) -> list[float]:
    if x == "step":
        return [r["step"] for r in records]
    key = "tokens" if x == "tokens" else "step_time_s"
    return list(itertools.accumulate(float(r.get(key) or 0.0) for r in records))


def plot_runs(runs: dict[str, list[dict]], out: str | Path, x: str = "step") -> Path:
    """Write the curves of ``runs`` (name -> records) to the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    styles = list(
        zip(
            itertools.cycle(c["color"] for c in plt.rcParams["axes.prop_cycle"]),
            itertools.cycle(["-", "--", ":", "-."]),
            range(len(runs)),
        )
    )
    for ax, (key, title, scale, log_y) in zip(axes.flat, PANELS):
        for (color, dash, _), (name, records) in zip(styles, runs.items()):
            xs = x_values(records, x)
            ys = [_number(r.get(key)) * scale for r in records]
            # Dashes keep a run visible where it lies on another (the same loss curve).
            ax.plot(xs, ys, dash, label=name, color=color, linewidth=1.3)
            if key == "loss":
                vals = [
                    (xv, r["val_loss"])
                    for xv, r in zip(xs, records)
                    if _number(r.get("val_loss")) == _number(r.get("val_loss"))
                ]
                if vals:
                    ax.plot(*zip(*vals), "o", color=color, markersize=5)
        ax.set_title(title)
        ax.set_xlabel(X_AXES[x])
        ax.grid(True, alpha=0.3)
        if log_y and any(_number(r.get(key)) > 0 for rs in runs.values() for r in rs):
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=9)
    fig.suptitle(", ".join(runs), fontsize=11)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _number(value) -> float:
    """A metric as a float (``null``, written for a non-finite value, as NaN: a gap)."""
    return float(value) if isinstance(value, (int, float)) else math.nan
