"""Time a pipeline :class:`~meshwise.pipeline.schedules.Schedule` on a model of the machine.

Pure: no torch.  ``simulate`` validates the schedule, then replays it
(``meshwise.pipeline.replay``) with a cost per action: a run of consecutive
sends/receives is one batch, posted at once; a message completes ``p2p_latency``
after both its ends are posted, and a rank waits for the batch's receives only
(its sends finish in the background) unless ``blocking_sends``.

With balanced stages and free communication the simulated bubble equals the analytic
``(S - 1) / (V * M + S - 1)`` (Huang et al. 2019 for GPipe; Narayanan et al. 2021, sections 2.2.1
and 2.2.2 for 1F1B and interleaved 1F1B): for GPipe and 1F1B for every M >= 1 (M < S included),
for interleaved 1F1B for every M that is a multiple of S.  With blocking sends GPipe and 1F1B
still meet it; interleaved 1F1B can lose time where a producer and its consumer are never idle
at the same instant (measured: S = 2, 5, 8 with M > S).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from meshwise.pipeline.replay import Interval, replay
from meshwise.pipeline.schedules import Action, Schedule
from meshwise.pipeline.validate import validate


@dataclass
class Timeline:
    """Simulated execution of a schedule.

    ``rows[r]`` lists ``(start, end, action)`` for the compute actions of rank r; ``step_time`` is
    when the last rank finishes; ``bubble_fraction`` = idle time of all ranks / (S * step_time);
    ``peak_in_flight[r]`` = most (micro-batch, chunk) activations rank r holds at once (+1 at F,
    -1 at B).
    """

    schedule: Schedule
    rows: list[list[Interval]]
    step_time: float
    bubble_fraction: float
    peak_in_flight: list[int]
    forward_cost: float
    backward_cost: float


def ideal_bubble_fraction(num_stages: int, num_micro_batches: int,
                          num_virtual_stages: int = 1) -> float:
    """Analytic bubble of GPipe/1F1B/interleaved 1F1B for balanced stages: (S-1)/(V*M + S-1)."""
    return (num_stages - 1) / (num_virtual_stages * num_micro_batches + num_stages - 1)


def simulate(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0,
             p2p_latency: float = 0.0, blocking_sends: bool = False) -> Timeline:
    """Validate and time a schedule.  A chunk's forward costs ``forward_cost / V`` and its
    backward ``backward_cost / V``: a rank's share of the model is split over its V chunks.

    By default a rank waits only for the receives of a batch (a runtime that waits for its sends
    at the end of the step); ``blocking_sends=True`` times a runtime that waits for whole batches.
    """
    validate(schedule)
    V = schedule.num_virtual_stages

    def cost(action: Action) -> float:
        return (forward_cost if action.kind == "F" else backward_cost) / V

    rows, finish = replay(schedule, cost, p2p_latency, blocking_sends)
    step_time = max(finish)
    busy = sum(end - start for row in rows for start, end, _ in row)
    total = schedule.num_stages * step_time
    bubble = (total - busy) / total if total > 0 else 0.0
    peaks = []
    for row in rows:
        live = peak = 0
        for _, _, action in row:
            live += 1 if action.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return Timeline(schedule, rows, step_time, bubble, peaks, forward_cost, backward_cost)


def render_text(timeline: Timeline, width: int | None = None) -> str:
    """A text Gantt chart: one row per rank; a forward shows its micro-batch (``3``, or ``3.1``
    with the chunk), a backward the same in brackets (``[3]``); ``.`` is idle time.

    ``width`` is the number of characters for the time axis; by default it is wide enough that
    every label fits (labels are cut when a narrower width is asked for).
    """
    def label(a: Action) -> str:
        text = str(a)[1:]
        return text if a.kind == "F" else f"[{text}]"

    if width is None:
        scale = max(((len(label(a)) + 1) / (end - start) for row in timeline.rows
                     for start, end, a in row if end > start), default=1.0)
        width = math.ceil(timeline.step_time * scale - 1e-9)
    width = max(width, 1)
    scale = width / timeline.step_time if timeline.step_time > 0 else 0.0
    s = timeline.schedule
    lines = [f"{s.kind}: S={s.num_stages} M={s.num_micro_batches} V={s.num_virtual_stages}, "
             f"forward {timeline.forward_cost:g} / backward {timeline.backward_cost:g} per rank, "
             f"bubble {timeline.bubble_fraction:.4f}   (n = forward, [n] = backward, . = idle)"]
    for rank, row in enumerate(timeline.rows):
        cells = ["."] * width
        for start, end, action in row:
            lo, hi = round(start * scale), min(round(end * scale), width)
            box = label(action)[: max(hi - lo - 1, 1)].ljust(hi - lo)
            cells[lo:hi] = box[: hi - lo]
        lines.append(f"rank {rank} |{''.join(cells)}|")
    return "\n".join(lines)


def plot_timeline(timeline: Timeline, path: str) -> None:
    """Save a Gantt chart (PNG, Agg): one row per rank, forwards blue and backwards orange (a
    darker shade per chunk), micro-batch numbers in the boxes, bubbles left blank."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: optional dependency
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    s, step = timeline.schedule, max(timeline.step_time, 1e-9)
    V = s.num_virtual_stages
    # Wide enough that the narrowest box holds its label at 7 pt (0.6 em per character).
    points_per_unit = max(((0.6 * 7 * len(str(a)[1:]) + 4) / (end - start)
                           for row in timeline.rows for start, end, a in row if end > start),
                          default=72.0)
    fig_width = min(max(8.0, step * points_per_unit / 72 / 0.85), 40.0)
    fig = Figure(figsize=(fig_width, 1.4 + 0.55 * s.num_stages))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    points_per_unit = fig_width * 72 * 0.85 / step
    blues = ("#9ecae1", "#4292c6", "#2171b5", "#08519c")
    oranges = ("#fdd0a2", "#fd8d3c", "#e6550d", "#a63603")
    for rank, row in enumerate(timeline.rows):
        for start, end, a in row:
            shade = a.chunk % 4 if V > 1 else 1
            ax.barh(rank, end - start, left=start, height=0.8, edgecolor="black", linewidth=0.5,
                    color=(blues if a.kind == "F" else oranges)[shade])
            text = str(a)[1:]
            size = min(9.0, ((end - start) * points_per_unit - 2) / (0.6 * len(text)))
            ax.text((start + end) / 2, rank, text, ha="center", va="center", fontsize=size,
                    color="white" if shade >= 2 else "black")
    ax.set_yticks(range(s.num_stages), [f"rank {r}" for r in range(s.num_stages)])
    ax.set_ylim(s.num_stages - 0.5, -0.5)
    ax.set_xlim(0, step)
    costs = f"forward {timeline.forward_cost:g}, backward {timeline.backward_cost:g} per rank"
    chunks = f", split over {V} chunks; labels: micro-batch.chunk" if V > 1 else ""
    ax.set_xlabel(f"time ({costs}{chunks})")
    ideal = ideal_bubble_fraction(s.num_stages, s.num_micro_batches, V)
    ax.set_title(f"{s.kind}: S={s.num_stages}, M={s.num_micro_batches}, V={V}, "
                 f"bubble {timeline.bubble_fraction:.3f} (formula {ideal:.3f})")
    suffix = (lambda c: f" chunk {c}") if V > 1 else (lambda c: "")
    shades = range(min(V, 4)) if V > 1 else [1]
    handles = [Patch(color=blues[c], label="forward" + suffix(c)) for c in shades]
    handles += [Patch(color=oranges[c], label="backward" + suffix(c)) for c in shades]
    ax.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, -0.14), ncol=len(handles),
              fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
