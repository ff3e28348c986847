"""Execute a pipeline schedule's per-rank lists on a model of the transport (pure: no torch).

A run of consecutive messages is one batch, posted at once; a message completes
``p2p_latency`` after both ends are posted. Waiting for whole batches (``blocking_sends``)
is the validator's deadlock check; waiting for receives only is what the simulator times.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from meshwise.pipeline.schedules import COMM_KINDS, COMPUTE_KINDS, Action, Schedule, ScheduleError

Interval = tuple[float, float, Action]


def match_messages(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair each send with its receive as a tag-less transport does: the k-th send a->b is the
    k-th receive on b from a. Keys and values are (rank, index in list). Raises ScheduleError
    when a message has no partner or a pair disagrees (kind, micro-batch, logical stage).
    """
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if action.kind not in COMM_KINDS:
                continue
            if action.peer is None:
                raise ScheduleError(f"rank {rank}: {action} is a message without a peer")
            if action.kind in ("SEND_F", "SEND_B"):
                sends[(rank, action.peer)].append(index)
            else:
                recvs[(action.peer, rank)].append(index)
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        send_list, recv_list = sends[(src, dst)], recvs[(src, dst)]
        for n, (si, ri) in enumerate(zip(send_list, recv_list)):
            send, recv = schedule.ranks[src][si], schedule.ranks[dst][ri]
            step = 1 if send.kind == "SEND_F" else -1
            next_stage = schedule.stage_of(src, send.chunk) + step
            if (
                recv.kind != "RECV_" + send.kind[-1]
                or recv.micro_batch != send.micro_batch
                or schedule.stage_of(dst, recv.chunk) != next_stage
            ):
                raise ScheduleError(
                    f"message {n + 1} from rank {src} to rank {dst} pairs rank {src}: {send} with "
                    f"rank {dst}: {recv}; two ranks must post their sends and receives in the "
                    "same order"
                )
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


def replay(
    schedule: Schedule,
    cost: Callable[[int, Action], float],
    p2p_latency: float = 0.0,
    blocking_sends: bool = True,
) -> tuple[list[list[Interval]], list[float]]:
    """Execute the lists batch by batch; return compute intervals and finish time per rank.

    ``cost(rank, action)``: a compute action's duration; ``blocking_sends``: as the module
    says. Raises ScheduleError when messages do not pair up, or on a deadlock, naming each
    blocked rank, its batch and the ranks it waits for.
    """
    partner = match_messages(schedule)
    steps, step_of = _index_steps(schedule)
    S = schedule.num_stages
    waits = [
        [
            _waited_batches(schedule, r, indices, partner, step_of, blocking_sends)
            for _, indices in rank_steps
        ]
        for r, rank_steps in enumerate(steps)
    ]
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
                rows[rank].append((clock[rank], clock[rank] + cost(rank, action), action))
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
        raise ScheduleError(
            "deadlock with blocking point-to-point: "
            + "; ".join(
                _blocked(schedule, r, steps[r][pointer[r]][1], waits[r][pointer[r]], posted)
                for r in stuck
            )
        )
    return rows, clock


def _waited_batches(
    schedule: Schedule, rank: int, indices, partner, step_of, blocking_sends: bool
) -> list[tuple[int, int]]:
    """The (rank, step) batches holding the partners of the messages a batch waits for."""
    if indices is None:  # a compute step
        return []
    waited = [
        j for j in indices if blocking_sends or schedule.ranks[rank][j].kind.startswith("RECV")
    ]
    return [(p, step_of[(p, i)]) for p, i in (partner[(rank, j)] for j in waited)]


def _blocked(schedule: Schedule, rank: int, indices: list[int], peers: list, posted: dict) -> str:
    ranks = sorted({p for p, step in peers if (p, step) not in posted})
    batch = " ".join(str(schedule.ranks[rank][j]) for j in indices)
    return f"rank {rank} waits in [{batch}] for rank {', '.join(map(str, ranks))}"
