"""Checks that a pipeline schedule runs: every dependency, every message, no deadlock (pure).

``validate`` names the first violation (``rank 1: B0 on chunk 0 runs before F0 (backward
needs its forward)``); the deadlock check replays the lists waiting for whole batches, a
message completing only once both ends posted it (the strictest transport).
"""

from __future__ import annotations

from typing import Optional

from meshwise.pipeline.replay import replay
from meshwise.pipeline.schedules import COMM_KINDS, COMPUTE_KINDS, Action, Schedule, ScheduleError


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` naming the first violation; return None if the schedule runs.

    In order: every action's fields; per rank, each (micro-batch, chunk) runs F and B once
    and W at most once, in order, each after its input or output gradient arrived, each
    send after its compute, every cross-rank output sent; sends and receives pair up in
    posting order; the lists run to the end with blocking batches (no deadlock).
    """
    S, M, V = schedule.num_stages, schedule.num_micro_batches, schedule.num_virtual_stages
    if min(S, M, V) < 1 or len(schedule.ranks) != S:
        raise ScheduleError(
            f"schedule has {len(schedule.ranks)} rank lists for S={S}, M={M}, "
            f"V={V}; needs S lists and S, M, V >= 1"
        )
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            problem = _field_problem(schedule, rank, action)
            if problem:
                raise ScheduleError(f"rank {rank}: {action}: {problem}")
    for rank in range(S):
        _check_rank_order(schedule, rank)
    replay(schedule, lambda rank, action: 1.0)


def neighbour_rank(schedule: Schedule, rank: int, action: Action) -> Optional[int]:
    """The rank a message of ``action.kind`` about ``action.chunk`` on ``rank`` goes to/comes
    from; None when there is no such message (first/last logical stage, or the same rank)."""
    stage = schedule.stage_of(rank, action.chunk)
    other = stage + 1 if action.kind in ("SEND_F", "RECV_B") else stage - 1
    if not 0 <= other < schedule.num_logical:
        return None
    other_rank = schedule.owner(other)[0]
    return None if other_rank == rank else other_rank


def _field_problem(schedule: Schedule, rank: int, action: Action) -> Optional[str]:
    M, V = schedule.num_micro_batches, schedule.num_virtual_stages
    if action.kind not in COMPUTE_KINDS + COMM_KINDS:
        return f"unknown kind {action.kind!r} (valid: {', '.join(COMPUTE_KINDS + COMM_KINDS)})"
    if not 0 <= action.micro_batch < M:
        return f"micro-batch {action.micro_batch} outside 0..{M - 1}"
    if not 0 <= action.chunk < V:
        return f"chunk {action.chunk} outside 0..{V - 1}"
    if action.is_compute:
        return None if action.peer is None else "a compute action has no peer"
    expected = neighbour_rank(schedule, rank, action)
    if expected is None:
        stage = schedule.stage_of(rank, action.chunk)
        return f"logical stage {stage} needs no {action.kind} (first/last stage or same rank)"
    return None if action.peer == expected else f"peer should be rank {expected}"


# What must come earlier than an action: ((kind, micro_batch, chunk), peer, why).
Need = tuple[tuple[str, int, int], Optional[int], str]


def _prerequisites(schedule: Schedule, rank: int, a: Action) -> list[Need]:
    """What must come earlier on ``rank`` than ``a``: ((kind, micro_batch, chunk), peer, why)."""
    mb, chunk = a.micro_batch, a.chunk
    if a.kind in ("SEND_F", "SEND_B"):
        return [((a.kind[-1], mb, chunk), None, "a send needs the compute that produces it")]
    if a.kind == "W":
        return [(("B", mb, chunk), None, "the weight gradient needs its backward")]
    if a.kind not in ("F", "B"):
        return []
    stage, forward = schedule.stage_of(rank, chunk), a.kind == "F"
    needs: list[Need] = [] if forward else [(("F", mb, chunk), None, "backward needs its forward")]
    if (stage > 0) if forward else (stage < schedule.num_logical - 1):
        other_rank, other_chunk = schedule.owner(stage + (-1 if forward else 1))
        if other_rank != rank:
            why = "its input has not arrived" if forward else "its output gradient has not arrived"
            needs.append((("RECV_" + a.kind, mb, chunk), other_rank, why))
        else:  # the neighbouring stage is another chunk on this rank: a local hand-off
            needs.append(((a.kind, mb, other_chunk), None, "hand-off from the neighbouring chunk"))
    return needs


def _check_rank_order(schedule: Schedule, rank: int) -> None:
    show = schedule.num_virtual_stages > 1
    seen: set[tuple[str, int, int]] = set()
    for action in schedule.ranks[rank]:
        key = (action.kind, action.micro_batch, action.chunk)
        if key in seen:
            raise ScheduleError(f"rank {rank}: {action} appears twice")
        for need, peer, why in _prerequisites(schedule, rank, action):
            if need not in seen:
                raise ScheduleError(
                    f"rank {rank}: {action} on chunk {action.chunk} runs before "
                    f"{Action(*need, peer, show)} ({why})"
                )
        seen.add(key)
    for kind in ("F", "B"):
        for chunk in range(schedule.num_virtual_stages):
            for mb in range(schedule.num_micro_batches):
                compute = Action(kind, mb, chunk, None, show)
                if (kind, mb, chunk) not in seen:
                    raise ScheduleError(
                        f"rank {rank}: {compute} is missing (every micro-batch "
                        "runs forward and backward once on every chunk)"
                    )
                send = Action("SEND_" + kind, mb, chunk)
                if ("SEND_" + kind, mb, chunk) not in seen and neighbour_rank(
                    schedule, rank, send
                ) is not None:
                    raise ScheduleError(
                        f"rank {rank}: the output of {compute} is never sent (no SEND_{kind})"
                    )
