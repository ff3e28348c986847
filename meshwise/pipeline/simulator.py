"""Time a pipeline ``Schedule`` on a model of the machine (pure: validated, then replayed),
with a rank's F, B and W costs per micro-batch. Balanced stages and free communication
give ``(S - 1) / (V * M + S - 1)`` (Huang et al. 2019; Narayanan et al. 2021, section 2.2);
``reference_bubble`` gives the literature's figure per kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshwise.pipeline.replay import Interval, replay
from meshwise.pipeline.schedules import Action, Schedule
from meshwise.pipeline.validate import validate


@dataclass
class Timeline:
    """Simulated execution of a schedule: ``rows[r]`` the ``(start, end, action)`` of rank r's
    compute; ``step_time``; ``bubble_fraction`` = idle time of all ranks / (S * step_time);
    ``peak_in_flight[r]``: the most (micro-batch, chunk) activations rank r holds at once.
    """

    schedule: Schedule
    rows: list[list[Interval]]
    step_time: float
    bubble_fraction: float
    peak_in_flight: list[int]
    forward_cost: float
    backward_cost: float
    weight_cost: float = 1.0

    @property
    def costs(self) -> str:
        """``F 1, B 1, W 1``: the per-rank costs timed."""
        return f"F {self.forward_cost:g}, B {self.backward_cost:g}, W {self.weight_cost:g}"


def ideal_bubble_fraction(
    num_stages: int, num_micro_batches: int, num_virtual_stages: int = 1
) -> float:
    """Analytic bubble of GPipe/1F1B/interleaved 1F1B for balanced stages: (S-1)/(V*M + S-1)."""
    return (num_stages - 1) / (num_virtual_stages * num_micro_batches + num_stages - 1)


def reference_bubble(
    kind: str,
    num_stages: int,
    num_micro_batches: int,
    num_virtual_stages: int = 1,
    costs=(1.0, 1.0, 1.0),
) -> tuple[float, str]:
    """The bubble fraction the literature gives for ``kind`` (``costs``: a rank's F, B, W), and
    its source.

    GPipe and 1F1B variants: (S-1)/(V*M + S-1). With F = B = W only (NaN otherwise): ZB-H1
    idles (S-1)(F + B - W) per rank (Qi et al. 2024, section 2.1), ZB-V (S-1)F/2 (ibid.,
    section 6), DualPipeV DeepSeek's (PP/2 - 1)(F&B + B - 3W) at PP = 2S with per-chunk
    costs, F&B run back to back (F + B + W).
    """
    S, M, V = num_stages, num_micro_batches, num_virtual_stages
    f, b, w = costs
    if kind in ("gpipe", "1f1b", "interleaved-1f1b"):
        return (S - 1) / (V * M + S - 1), "(S-1)/(V*M+S-1)"
    if not f == b == w:
        return math.nan, "none: the paper's figure assumes F = B = W"
    idle, source = {
        "zb-h1": ((S - 1) * (f + b - w), "(S-1)(F+B-W) idle per rank, Qi et al. 2024"),
        "zbv": ((S - 1) * f / 2, "(S-1)F/2 start-up only, Qi et al. 2024 section 6"),
        "dualpipev": (
            (S - 1) * ((f + b + w) + b - 3 * w) / 2,
            "(PP/2-1)(F&B+B-3W) at PP = 2S, DeepSeek-V3's DualPipe",
        ),
    }[kind]
    return idle / (idle + M * (f + b + w)), source


def simulate(
    schedule: Schedule,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
    weight_cost: float = 1.0,
    p2p_latency: float = 0.0,
    blocking_sends: bool = False,
    check: bool = True,
) -> Timeline:
    """Validate and time a schedule; a chunk costs ``forward_cost / V``, ``backward_cost / V`` and
    ``weight_cost / V`` (a whole backward both parts).

    A rank waits for a batch's receives only; ``blocking_sends=True`` times a runtime that
    waits for whole batches. ``check=False`` skips the validation (a schedule timed often).
    """
    # Balanced and free of communication, GPipe and 1F1B meet the formula at every M >= 1,
    # interleaved 1F1B at every M that is a multiple of S. With blocking sends GPipe and
    # 1F1B still meet it; interleaved 1F1B can lose time where a producer and its consumer
    # are never idle at the same instant (measured: S = 2, 5, 8 with M > S).
    if check:
        validate(schedule)
    V = schedule.num_virtual_stages

    def cost(rank: int, action: Action) -> float:
        if action.kind == "F":
            return forward_cost / V
        if action.kind == "W":
            return weight_cost / V
        split = schedule.splits_backward(rank, action.micro_batch, action.chunk)
        return (backward_cost + (0.0 if split else weight_cost)) / V

    rows, finish = replay(schedule, cost, p2p_latency, blocking_sends)
    step_time = max(finish)
    busy = sum(end - start for row in rows for start, end, _ in row)
    total = schedule.num_stages * step_time
    bubble = (total - busy) / total if total > 0 else 0.0
    peaks = []
    for rank, row in enumerate(rows):
        live = peak = 0
        for _, _, a in row:
            ends = a.kind == "W" or (
                a.kind == "B" and not schedule.splits_backward(rank, a.micro_batch, a.chunk)
            )
            # +1 at F, -1 at the action that ends the micro-batch: its W, else its B
            live += 1 if a.kind == "F" else (-1 if ends else 0)
            peak = max(peak, live)
        peaks.append(peak)
    return Timeline(
        schedule, rows, step_time, bubble, peaks, forward_cost, backward_cost, weight_cost
    )


def render_text(timeline: Timeline, width: int | None = None) -> str:
    """A text Gantt chart, one row per rank: a forward shows its micro-batch (``3``, ``3.1`` with
    the chunk), a backward ``[3]``, a weight pass ``{3}``, idle time ``.``; ``width``: characters
    of the time axis (default: every label fits).
    """

    def label(a: Action) -> str:
        text = str(a)[1:]
        return {"F": text, "B": f"[{text}]", "W": f"{{{text}}}"}[a.kind]

    if width is None:
        scale = max(
            (
                (len(label(a)) + 1) / (end - start)
                for row in timeline.rows
                for start, end, a in row
                if end > start
            ),
            default=1.0,
        )
        width = math.ceil(timeline.step_time * scale - 1e-9)
    width = max(width, 1)
    scale = width / timeline.step_time if timeline.step_time > 0 else 0.0
    s = timeline.schedule
    weights = ", {n} = weight pass" if s.has_weight_actions else ""
    lines = [
        f"{s.kind}: S={s.num_stages} M={s.num_micro_batches} V={s.num_virtual_stages}, "
        f"{timeline.costs} per rank, bubble {timeline.bubble_fraction:.4f}   "
        f"(n = forward, [n] = backward{weights}, . = idle)"
    ]
    for rank, row in enumerate(timeline.rows):
        cells = ["."] * width
        for start, end, action in row:
            lo, hi = round(start * scale), min(round(end * scale), width)
            box = label(action)[: max(hi - lo - 1, 1)].ljust(hi - lo)
            cells[lo:hi] = box[: hi - lo]
        lines.append(f"rank {rank} |{''.join(cells)}|")
    return "\n".join(lines)


def plot_timeline(timeline: Timeline, path: str) -> None:
    """Save a Gantt chart (PNG, Agg): one row per rank, forwards blue, backwards orange and
    weight passes green (a darker shade per chunk), micro-batch numbers in the boxes, bubbles
    left blank."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: optional dependency
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    s, step = timeline.schedule, max(timeline.step_time, 1e-9)
    V = s.num_virtual_stages
    # Wide enough that the narrowest box holds its label at 7 pt (0.6 em per character).
    points_per_unit = max(
        (
            (0.6 * 7 * len(str(a)[1:]) + 4) / (end - start)
            for row in timeline.rows
            for start, end, a in row
            if end > start
        ),
        default=72.0,
    )
    fig_width = min(max(8.0, step * points_per_unit / 72 / 0.85), 40.0)
    fig = Figure(figsize=(fig_width, 1.8 + 0.55 * s.num_stages))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    points_per_unit = fig_width * 72 * 0.85 / step
    blues = ("#9ecae1", "#4292c6", "#2171b5", "#08519c")
    oranges = ("#fdd0a2", "#fd8d3c", "#e6550d", "#a63603")
    greens = ("#c7e9c0", "#74c476", "#31a354", "#006d2c")
    colours = {"F": blues, "B": oranges, "W": greens}
    for rank, row in enumerate(timeline.rows):
        for start, end, a in row:
            shade = a.chunk % 4 if V > 1 else 1
            ax.barh(
                rank,
                end - start,
                left=start,
                height=0.8,
                edgecolor="black",
                linewidth=0.5,
                color=colours[a.kind][shade],
            )
            text = str(a)[1:]
            size = min(9.0, ((end - start) * points_per_unit - 2) / (0.6 * len(text)))
            ax.text(
                (start + end) / 2,
                rank,
                text,
                ha="center",
                va="center",
                fontsize=size,
                color="white" if shade >= 2 else "black",
            )
    ax.set_yticks(range(s.num_stages), [f"rank {r}" for r in range(s.num_stages)])
    ax.set_ylim(s.num_stages - 0.5, -0.5)
    ax.set_xlim(0, step)
    chunks = f", split over {V} chunks; labels: micro-batch.chunk" if V > 1 else ""
    ax.set_xlabel(f"time ({timeline.costs} per rank{chunks})")
    ideal, _ = reference_bubble(
        s.kind,
        s.num_stages,
        s.num_micro_batches,
        V,
        (timeline.forward_cost, timeline.backward_cost, timeline.weight_cost),
    )
    ax.set_title(
        f"{s.kind}: S={s.num_stages}, M={s.num_micro_batches}, V={V}, "
        f"bubble {timeline.bubble_fraction:.3f}"
        + ("" if math.isnan(ideal) else f" (reference {ideal:.3f})")
    )
    suffix = (lambda c: f" chunk {c}") if V > 1 else (lambda c: "")
    shades = range(min(V, 4)) if V > 1 else [1]
    kinds = (("F", "forward"), ("B", "backward")) + (
        (("W", "weight"),) if s.has_weight_actions else ()
    )
    handles = [
        Patch(color=colours[k][c], label=name + suffix(c)) for k, name in kinds for c in shades
    ]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.3),
        ncol=min(len(handles), 4),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
