"""Where a schedule's sends and receives go (pure): each message meets on an ideal dataflow
timeline and both ends post it in their first gap after, so every rank meets its
messages in one global order and no batch can deadlock, whatever the costs.
"""

from __future__ import annotations

import bisect
import math

from meshwise.pipeline.actions import Action, Order, ScheduleError, stage_index, stage_owner

# Ticks of the dataflow timeline: a forward 1, a backward's input part 1, its weight part 1.
_TICKS = {"F": 1, "B": 1, "W": 1}


def _dependencies(kind: str, mb: int, stage: int, last: int) -> list[tuple[str, int, int]]:
    """Compute actions (kind, micro-batch, logical stage) that must finish before this one."""
    if kind == "W":
        return [("B", mb, stage)]
    deps = [("F", mb, stage - 1)] if kind == "F" else [("F", mb, stage), ("B", mb, stage + 1)]
    return [d for d in deps if 0 <= d[2] <= last]


def dataflow_times(
    orders: list[Order], S: int, V: int, stage_map: str
) -> list[list[tuple[int, int]]]:
    """(start, end) of each compute action when it starts as soon as its rank is free and its
    inputs are ready, in ticks (F = 1, B = 1 plus 1 when it has no W, W = 1)."""
    last = S * V - 1
    finished: dict[tuple[str, int, int], int] = {}  # (kind, mb, stage) -> its end tick
    split = {(r, mb, c) for r in range(S) for k, mb, c in orders[r] if k == "W"}
    times: list[list[tuple[int, int]]] = [[] for _ in range(S)]
    clock, progress = [0] * S, True
    while progress:
        progress = False
        for r in range(S):
            while len(times[r]) < len(orders[r]):
                kind, mb, chunk = orders[r][len(times[r])]
                stage = stage_index(r, chunk, S, stage_map)
                deps = _dependencies(kind, mb, stage, last)
                if any(d not in finished for d in deps):
                    break
                ticks = _TICKS[kind] + (kind == "B" and (r, mb, chunk) not in split)
                start = max([clock[r]] + [finished[d] for d in deps])
                clock[r] = finished[(kind, mb, stage)] = start + ticks
                times[r].append((start, clock[r]))
                progress = True
    for r in range(S):
        if len(times[r]) < len(orders[r]):
            kind, mb, chunk = orders[r][len(times[r])]
            raise ScheduleError(
                f"rank {r}: {kind}{mb} on chunk {chunk} can never run: the compute "
                "orders wait on each other"
            )
    return times


def _gaps(times: list[tuple[int, int]]) -> tuple[list[float], list[float]]:
    """Idle intervals of a rank as (starts, ends): gap g lies just before compute action g."""
    starts: list[float] = [0, *(end for _, end in times)]
    return starts, [start for start, _ in times] + [math.inf]


def _meeting_time(gaps_a: tuple[list, list], gaps_b: tuple[list, list], lo: int, hi: int) -> float:
    """Earliest instant in [lo, hi] at which both ranks are between compute actions; ``lo`` (the
    producer's finish) when there is none (then a blocking sender waits for the receiver)."""
    (starts_a, ends_a), (starts_b, ends_b) = gaps_a, gaps_b
    i, j = bisect.bisect_left(ends_a, lo), bisect.bisect_left(ends_b, lo)
    while i < len(ends_a) and j < len(ends_b):
        t = max(lo, starts_a[i], starts_b[j])
        if t > hi:
            break
        if t <= ends_a[i] and t <= ends_b[j]:
            return t
        i, j = (i + 1, j) if ends_a[i] < ends_b[j] else (i, j + 1)
    return lo


def place_messages(
    orders: list[Order], S: int, V: int, stage_map: str = "loop"
) -> list[list[Action]]:
    """Each rank's compute order with its sends and receives placed between the actions.

    A message's meeting time lies between its producer's end and its consumer's start; each
    end posts it in its first gap ending at or after it, sorted by (time, message), so both
    ends of a channel post in the same order. A runtime that waits only for receives
    replays the dataflow timeline, hence the formula's bubble.
    """
    times, show, last = dataflow_times(orders, S, V, stage_map), V > 1, S * V - 1
    gaps = [_gaps(t) for t in times]
    where = {
        (k, mb, stage_index(r, c, S, stage_map)): (r, i)
        for r in range(S)
        for i, (k, mb, c) in enumerate(orders[r])
        if k != "W"
    }
    posts: list[list[list]] = [[[] for _ in range(len(o) + 1)] for o in orders]
    for (kind, mb, stage), (a, i) in where.items():
        target = stage + 1 if kind == "F" else stage - 1
        if not 0 <= target <= last:
            continue  # the loss stage or stage 0
        b, target_chunk = stage_owner(target, S, stage_map)
        if a == b:
            continue  # a hand-off between chunks of one rank
        j = where[(kind, mb, target)][1]
        t = _meeting_time(gaps[a], gaps[b], times[a][i][1], times[b][j][0])
        key = (t, kind, mb, stage)
        send = Action("SEND_" + kind, mb, orders[a][i][2], b, show)
        recv = Action("RECV_" + kind, mb, target_chunk, a, show)
        posts[a][bisect.bisect_left(gaps[a][1], t)].append((key, send))
        posts[b][bisect.bisect_left(gaps[b][1], t)].append((key, recv))
    ranks = []
    for r in range(S):
        actions: list[Action] = []
        for g, batch in enumerate(posts[r]):
            actions += [action for _, action in sorted(batch, key=lambda item: item[0])]
            if g < len(orders[r]):
                actions.append(Action(*orders[r][g], None, show))
        ranks.append(actions)
    return ranks
