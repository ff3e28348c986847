"""Run a pipeline :class:`~meshwise.pipeline.schedules.Schedule` on a model of the machine.

Pure: no torch.  Each rank runs its list top to bottom (see the schedules module docstring): a run
of consecutive sends/receives is one batch, posted at once; a message completes ``p2p_latency``
after both its ends are posted.  By default a rank then waits for the batch's receives only (its
sends finish in the background); with ``blocking_sends`` it waits for the whole batch, which is
the validator's deadlock check (:func:`replay` is the engine of both).

With balanced stages and free communication the simulated bubble equals the analytic
``(S - 1) / (V * M + S - 1)`` (Huang et al. 2019 for GPipe; Narayanan et al. 2021, sections 2.2.1
and 2.2.2 for 1F1B and interleaved 1F1B): for GPipe and 1F1B for every M >= 1 (M < S included),
for interleaved 1F1B for every M that is a multiple of S.  With blocking sends GPipe and 1F1B
still meet it; interleaved 1F1B can lose time where a producer and its consumer are never idle
at the same instant (measured: S = 2, 5, 8 with M > S).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from meshwise.pipeline.schedules import COMPUTE_KINDS, Action, Schedule, ScheduleError
from meshwise.pipeline.validate import validate

Interval = tuple[float, float, Action]


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


def match_messages(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair each send with its receive as a tag-less transport would: between rank a and rank b,
    the k-th send a->b is the k-th receive on b from a.  Keys and values are (rank, index in list).

    Raises ScheduleError when a message has no partner or a pair disagrees (kind, micro-batch or
    logical stage), which means the two ranks post them in different orders.
    """
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if action.kind in ("SEND_F", "SEND_B"):
                sends[(rank, action.peer)].append(index)
            elif action.kind in ("RECV_F", "RECV_B"):
                recvs[(action.peer, rank)].append(index)
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        send_list, recv_list = sends[(src, dst)], recvs[(src, dst)]
        for n, (si, ri) in enumerate(zip(send_list, recv_list)):
            send, recv = schedule.ranks[src][si], schedule.ranks[dst][ri]
            step = 1 if send.kind == "SEND_F" else -1
            next_stage = schedule.stage_of(src, send.chunk) + step
            if recv.kind != "RECV_" + send.kind[-1] or recv.micro_batch != send.micro_batch \
                    or schedule.stage_of(dst, recv.chunk) != next_stage:
                raise ScheduleError(
                    f"message {n + 1} from rank {src} to rank {dst} pairs rank {src}: {send} with "
                    f"rank {dst}: {recv}; two ranks must post their sends and receives in the "
                    "same order")
            partner[(src, si)], partner[(dst, ri)] = (dst, ri), (src, si)
        if len(send_list) > len(recv_list):
            extra = schedule.ranks[src][send_list[len(recv_list)]]
            raise ScheduleError(f"rank {src}: {extra} has no matching receive on rank {dst}")
        if len(recv_list) > len(send_list):
            extra = schedule.ranks[dst][recv_list[len(send_list)]]
            raise ScheduleError(f"rank {dst}: {extra} has no matching send on rank {src}")
    return partner


def _index_steps(schedule: Schedule) -> tuple[list[list[tuple]], dict[tuple[int, int], int]]:
    """Per rank, steps as (compute action, None) or (None, indices of one batch's messages)."""
    steps: list[list[tuple]] = []
    step_of: dict[tuple[int, int], int] = {}  # (rank, message index) -> its step
    for rank, actions in enumerate(schedule.ranks):
        rank_steps: list[tuple] = []
        batch: list[int] | None = None
        for index, action in enumerate(actions):
            if action.kind in COMPUTE_KINDS:
                rank_steps.append((action, None))
                batch = None
                continue
            if batch is None:
                batch = []
                rank_steps.append((None, batch))
            batch.append(index)
            step_of[(rank, index)] = len(rank_steps) - 1
        steps.append(rank_steps)
    return steps, step_of


def replay(schedule: Schedule, cost: Callable[[Action], float], p2p_latency: float = 0.0,
           blocking_sends: bool = True) -> tuple[list[list[Interval]], list[float]]:
    """Execute the lists batch by batch; return compute intervals and finish time per rank.

    A message completes ``p2p_latency`` after both its ends are posted.  With ``blocking_sends``
    a rank waits for its whole batch (the strictest runtime: the validator's deadlock check);
    without, it waits only for the batch's receives and its sends finish in the background.
    Raises ScheduleError when messages do not pair up, or when execution gets stuck (deadlock),
    naming each blocked rank, the batch it waits in and the ranks it waits for.
    """
    partner = match_messages(schedule)
    steps, step_of = _index_steps(schedule)
    S = schedule.num_stages
    waits = [[_waited_batches(schedule, r, indices, partner, step_of, blocking_sends)
              for _, indices in rank_steps] for r, rank_steps in enumerate(steps)]
    pointer, clock = [0] * S, [0.0] * S
    posted: dict[tuple[int, int], float] = {}  # (rank, step) -> time the batch was posted
    blocked_on: dict[tuple[int, int], list[int]] = defaultdict(list)  # batch -> ranks waiting
    rows: list[list[Interval]] = [[] for _ in range(S)]
    runnable = list(range(S))
    while runnable:
        rank = runnable.pop()
        while pointer[rank] < len(steps[rank]):
            step = pointer[rank]
            action = steps[rank][step][0]
            if action is not None:
                rows[rank].append((clock[rank], clock[rank] + cost(action), action))
                clock[rank] = rows[rank][-1][1]
            else:
                if (rank, step) not in posted:
                    posted[(rank, step)] = clock[rank]
                    runnable += blocked_on.pop((rank, step), [])
                missing = next((peer for peer in waits[rank][step] if peer not in posted), None)
                if missing is not None:
                    blocked_on[missing].append(rank)
                    break
                if waits[rank][step]:
                    last_post = max(posted[peer] for peer in waits[rank][step])
                    clock[rank] = max(clock[rank], last_post) + p2p_latency
            pointer[rank] += 1
    stuck = [r for r in range(S) if pointer[r] < len(steps[r])]
    if stuck:
        raise ScheduleError("deadlock with blocking point-to-point: " + "; ".join(
            _blocked(schedule, r, steps[r][pointer[r]][1], waits[r][pointer[r]], posted)
            for r in stuck))
    return rows, clock


def _waited_batches(schedule: Schedule, rank: int, indices, partner, step_of,
                    blocking_sends: bool) -> list[tuple[int, int]]:
    """The (rank, step) batches holding the partners of the messages a batch waits for."""
    if indices is None:  # a compute step
        return []
    waited = [j for j in indices
              if blocking_sends or schedule.ranks[rank][j].kind.startswith("RECV")]
    return [(p, step_of[(p, i)]) for p, i in (partner[(rank, j)] for j in waited)]


def _blocked(schedule: Schedule, rank: int, indices: list[int], peers: list, posted: dict) -> str:
    ranks = sorted({p for p, step in peers if (p, step) not in posted})
    batch = " ".join(str(schedule.ranks[rank][j]) for j in indices)
    return f"rank {rank} waits in [{batch}] for rank {', '.join(map(str, ranks))}"


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
