"""Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B (checked by ``validate.py``).

Pure: no torch here. A :class:`Schedule` holds, for each pipeline rank, the ordered list of
:class:`Action` s that rank executes top to bottom, communication included.

Stages. Rank ``r`` holds ``V`` model chunks (``V = num_virtual_stages``); chunk ``v`` is the
logical stage ``v * S + r`` (Narayanan et al. 2021, section 2.2.2), so when ``S > 1`` two
consecutive logical stages always sit on neighbouring ranks. When ``S == 1`` every stage is on
rank 0 and chunks hand over locally: such a schedule has no communication at all.

Communication, and what a runtime must implement:

* ``chunk`` of a send/recv is the chunk on THIS rank the message belongs to: SEND_F carries the
  output of that chunk's ``F``, RECV_F delivers the input of that chunk's ``F``, SEND_B carries
  the gradient w.r.t. that chunk's input (made by its ``B``), RECV_B delivers the gradient w.r.t.
  its output.  ``peer`` is the other rank.
* A maximal run of consecutive communication actions is ONE batch (:func:`group_steps`): post all
  of them with one ``torch.distributed.batch_isend_irecv`` call, one ``P2POp`` each in list
  order, and wait for the batch's receives before the next action.  Its sends may be waited for
  at once (always deadlock-free: :func:`~meshwise.pipeline.validate.validate` proves it for this strictest runtime; with NCCL
  the batch comes back as one coalesced work anyway) or later, e.g. at the end of the step while
  keeping their tensors alive; that lets the sender compute on, which is what the simulator times
  by default and what reaches the bubble of the formula.
* Why batches: with one blocking operation at a time, 1F1B deadlocks in its steady state (rank r
  sends F_i to r+1 then waits for B_j, while r+1 sends B_j then waits for F_i).  Megatron posts
  such pairs together (``send_forward_recv_backward``, a batched isend/irecv); here the placement
  does it: each message is given a meeting time on an ideal timeline (when possible an instant at
  which both ranks are idle) and both ends post it at the first gap between their compute actions
  at or after that time, in order of meeting time.  Every rank meets its messages in one global
  order, so the batches can always complete in that order: no deadlock, whatever the real costs.
* Messages between two ranks in one direction match in posting order (as with NCCL, which ignores
  tags): the k-th send from a to b is the k-th receive on b from a.  :func:`~meshwise.pipeline.validate.validate` checks that
  each such pair agrees (kind, micro-batch, logical stage).
* Completion model (validator and simulator): a batch is posted when its rank reaches it; a
  message completes once both its ends are posted (rendezvous, the strictest model of a
  transport); the validator waits for whole batches.  Eager or buffered sends only finish sooner.

Strings (``str(action)``): ``F3``/``B3`` run micro-batch 3; with ``V > 1`` the chunk follows a
dot, ``F3.1``.  Sends/receives: ``SF3>1`` send the activation of micro-batch 3 to rank 1,
``RF3<0`` receive it from rank 0, ``SB3>0`` / ``RB3<2`` the same for gradients (``SF3.1>0`` with
the chunk).  :func:`parse_action` reads these back.
"""
from __future__ import annotations

import bisect
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Optional, Union

SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved-1f1b")
COMPUTE_KINDS = ("F", "B")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_SHORT = {"SEND_F": ("SF", ">"), "RECV_F": ("RF", "<"),
          "SEND_B": ("SB", ">"), "RECV_B": ("RB", "<")}
_ACTION_RE = re.compile(r"^(F|B|SF|RF|SB|RB)(\d+)(?:\.(\d+))?(?:([<>])(\d+))?$")


class ScheduleError(ValueError):
    """A schedule breaks a dependency, misses or duplicates an action, or can deadlock."""


@dataclass(frozen=True)
class Action:
    """One step of a rank: compute (``F``/``B``) or one message (``SEND_*``/``RECV_*``).

    ``chunk`` is the virtual chunk on this rank (0..V-1); ``peer`` the other rank of a message
    (None for compute). ``show_chunk`` only decides whether ``str()`` prints the chunk (schedules
    with V > 1 set it); it is not part of equality.
    """

    kind: str
    micro_batch: int
    chunk: int = 0
    peer: Optional[int] = None
    show_chunk: bool = field(default=False, compare=False)

    @property
    def is_compute(self) -> bool:
        """True for F and B."""
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        chunk = f".{self.chunk}" if self.show_chunk else ""
        if self.is_compute:
            return f"{self.kind}{self.micro_batch}{chunk}"
        short, arrow = _SHORT[self.kind]
        return f"{short}{self.micro_batch}{chunk}{arrow}{self.peer}"


def parse_action(text: str, show_chunk: bool = False) -> Action:
    """Read an action back from its string (``"F3"``, ``"B3.1"``, ``"SF3>1"``, ``"RB0.1<0"``)."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"not an action string: {text!r} (examples: F3, B3.1, SF3>1, RB2<0)")
    short, mb, chunk, arrow, peer = match.groups()
    kind = {"SF": "SEND_F", "RF": "RECV_F", "SB": "SEND_B", "RB": "RECV_B"}.get(short, short)
    if (kind in COMM_KINDS) != (peer is not None) or (peer and arrow != _SHORT[kind][1]):
        raise ValueError(f"bad peer in action string {text!r}: sends use '>rank', receives '<rank'")
    return Action(kind, int(mb), int(chunk or 0), None if peer is None else int(peer),
                  show_chunk=show_chunk or chunk is not None)


@dataclass
class Schedule:
    """Per-rank action lists of one optimizer step: S ranks x V chunks, M micro-batches."""

    kind: str
    num_stages: int
    num_micro_batches: int
    num_virtual_stages: int
    ranks: list[list[Action]]

    def stage_of(self, rank: int, chunk: int) -> int:
        """Logical stage of ``chunk`` on ``rank``: ``chunk * S + rank`` (Narayanan 2.2.2)."""
        return chunk * self.num_stages + rank

    def compute_actions(self, rank: int) -> list[Action]:
        """The F and B actions of ``rank``, in order."""
        return [a for a in self.ranks[rank] if a.is_compute]


Step = Union[Action, tuple[Action, ...]]
Order = list[tuple[str, int, int]]  # one rank's compute actions as (kind, micro_batch, chunk)


def group_steps(actions: list[Action]) -> list[Step]:
    """Split a rank's list into steps: a compute Action, or a tuple of messages (one batch)."""
    steps: list[Step] = []
    for is_compute, run in itertools.groupby(actions, key=lambda action: action.is_compute):
        steps += list(run) if is_compute else [tuple(run)]
    return steps


def validate_schedule_config(kind: str, num_stages: int, num_micro_batches: int,
                             num_virtual_stages: int = 1) -> None:
    """Raise ValueError with a one-line message if no schedule exists for these values.

    gpipe and 1f1b work for any M >= 1 (with M < S ranks just idle more; the bubble is still
    (S-1)/(M+S-1)).  interleaved-1f1b needs V >= 2 and, as in Megatron, M a multiple of S: the
    micro-batches go through the chunks in groups of S.
    """
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"schedule {kind!r} is not one of: {', '.join(SCHEDULE_KINDS)}")
    for name, value in (("pp (pipeline stages)", num_stages), ("micro-batches", num_micro_batches),
                        ("virtual stages", num_virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if kind != "interleaved-1f1b" and num_virtual_stages != 1:
        raise ValueError(f"virtual stages = {num_virtual_stages} needs schedule interleaved-1f1b; "
                         f"{kind} runs one chunk per rank (virtual stages 1)")
    if kind == "interleaved-1f1b":
        if num_virtual_stages < 2:
            raise ValueError(f"interleaved-1f1b needs virtual stages >= 2, got {num_virtual_stages}"
                             " (with 1 chunk per rank use 1f1b)")
        if num_micro_batches % num_stages:
            raise ValueError(f"interleaved-1f1b needs micro-batches to be a multiple of pp: got "
                             f"micro-batches={num_micro_batches}, pp={num_stages}; valid: "
                             f"{num_stages}, {2 * num_stages}, {3 * num_stages}, ...")


def build_schedule(kind: str, num_stages: int, num_micro_batches: int,
                   num_virtual_stages: int = 1) -> Schedule:
    """Build the per-rank action lists (compute and communication) of a schedule kind."""
    validate_schedule_config(kind, num_stages, num_micro_batches, num_virtual_stages)
    S, M, V = num_stages, num_micro_batches, num_virtual_stages
    order = {"gpipe": _gpipe_order, "1f1b": _one_f_one_b_order,
             "interleaved-1f1b": _interleaved_order}[kind]
    return from_compute_orders(kind, S, M, V, [order(S, M, V, r) for r in range(S)])


def from_compute_orders(kind: str, num_stages: int, num_micro_batches: int,
                        num_virtual_stages: int, orders: list[Order]) -> Schedule:
    """A schedule from each rank's compute order, given as ``(kind, micro_batch, chunk)`` tuples
    (e.g. ``("F", 3, 0)``), with the sends and receives placed for it.  Raises ScheduleError when
    an order misses or repeats an action or the orders wait on each other forever."""
    M, V = num_micro_batches, num_virtual_stages
    expected = {(k, m, c) for k in COMPUTE_KINDS for m in range(M) for c in range(V)}
    for rank, order in enumerate(orders):
        if len(order) != len(expected) or set(order) != expected:
            raise ScheduleError(f"rank {rank}: the compute order must hold F and B once for every "
                                f"micro-batch in 0..{M - 1} and chunk in 0..{V - 1}")
    return Schedule(kind, num_stages, M, V, _add_comms(orders, num_stages, V))


def _gpipe_order(S: int, M: int, V: int, rank: int) -> Order:
    # GPipe (Huang et al. 2019): every forward, then every backward; all M activations live.
    return [("F", m, 0) for m in range(M)] + [("B", m, 0) for m in range(M)]


def _one_f_one_b_order(S: int, M: int, V: int, rank: int) -> Order:
    # PipeDream-Flush 1F1B (Narayanan et al. 2021, section 2.2.1): at most S - rank live
    # activations instead of GPipe's M, for the same bubble.
    num_warmup = min(S - rank - 1, M)
    num_steady = M - num_warmup
    order = [("F", m, 0) for m in range(num_warmup)]            # warmup: forwards only
    for i in range(num_steady):                                 # steady state: one F, one B
        order += [("F", num_warmup + i, 0), ("B", i, 0)]
    order += [("B", m, 0) for m in range(num_steady, M)]        # cooldown: backwards only
    return order


def _interleaved_slot(k: int, S: int, V: int, forward: bool) -> tuple[int, int]:
    # Megatron's order (Narayanan et al. 2021, section 2.2.2): micro-batches in groups of S go
    # through chunk 0, then chunk 1, ...; backwards visit the chunks in reverse.
    group, position = divmod(k, S * V)
    chunk, index = divmod(position, S)
    return group * S + index, (chunk if forward else V - 1 - chunk)


def _interleaved_order(S: int, M: int, V: int, rank: int) -> Order:
    total = M * V
    # Megatron's warmup count: the (V - 1) groups of the earlier chunks, plus 2 per hop to the
    # last rank (a forward going down and a backward coming back), capped at every forward.
    num_warmup = min((S - rank - 1) * 2 + (V - 1) * S, total)
    num_steady = total - num_warmup
    slot = _interleaved_slot
    order = [("F", *slot(k, S, V, True)) for k in range(num_warmup)]           # warmup
    for i in range(num_steady):                                                 # steady state
        order += [("F", *slot(num_warmup + i, S, V, True)), ("B", *slot(i, S, V, False))]
    order += [("B", *slot(k, S, V, False)) for k in range(num_steady, total)]   # cooldown
    return order


def _dataflow_times(orders: list[Order], S: int, V: int) -> list[list[tuple[int, int]]]:
    """(start, end) of each compute action when it starts as soon as its rank is free and its
    inputs are ready, in ticks (F = 1, B = 2): the timeline the message placement follows."""
    last, finished = S * V - 1, {}
    times: list[list[tuple[int, int]]] = [[] for _ in range(S)]
    clock, progress = [0] * S, True
    while progress:
        progress = False
        for r in range(S):
            while len(times[r]) < len(orders[r]):
                kind, mb, chunk = orders[r][len(times[r])]
                stage = chunk * S + r
                deps = [("F", mb, stage - 1)] if kind == "F" else [("F", mb, stage),
                                                                    ("B", mb, stage + 1)]
                deps = [d for d in deps if 0 <= d[2] <= last]
                if any(d not in finished for d in deps):
                    break
                start = max([clock[r]] + [finished[d] for d in deps])
                clock[r] = finished[(kind, mb, stage)] = start + (1 if kind == "F" else 2)
                times[r].append((start, clock[r]))
                progress = True
    for r in range(S):
        if len(times[r]) < len(orders[r]):
            kind, mb, chunk = orders[r][len(times[r])]
            raise ScheduleError(f"rank {r}: {kind}{mb} on chunk {chunk} can never run: the compute "
                                "orders wait on each other")
    return times


def _gaps(times: list[tuple[int, int]]) -> tuple[list[float], list[float]]:
    """Idle intervals of a rank as (starts, ends): gap g lies just before compute action g."""
    return [0] + [end for _, end in times], [start for start, _ in times] + [math.inf]


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


def _add_comms(orders: list[Order], S: int, V: int) -> list[list[Action]]:
    """Place every message between compute actions so that batches cannot deadlock.

    Each message gets a meeting time t on the dataflow timeline, between its producer's end and
    its consumer's start; each end posts it in its first gap ending at or after t, sorted by
    (t, message).  Every rank so meets its messages in increasing t, and the batches complete in
    that order (no deadlock, even waiting for whole batches, whatever the real costs); both ends
    of a channel post in the same order.  A runtime that waits only for receives replays the
    dataflow timeline, hence the formula's bubble.
    """
    times, show, last = _dataflow_times(orders, S, V), V > 1, S * V - 1
    gaps = [_gaps(t) for t in times]
    where = {(k, mb, c * S + r): (r, i) for r in range(S) for i, (k, mb, c) in enumerate(orders[r])}
    posts: list[list[list]] = [[[] for _ in range(len(o) + 1)] for o in orders]
    for (kind, mb, stage), (a, i) in where.items():
        target = stage + 1 if kind == "F" else stage - 1
        if S == 1 or not 0 <= target <= last:
            continue  # the loss stage, stage 0, or a hand-off between chunks of one rank
        b, j = where[(kind, mb, target)]
        t = _meeting_time(gaps[a], gaps[b], times[a][i][1], times[b][j][0])
        key = (t, kind, mb, stage)
        send = Action("SEND_" + kind, mb, stage // S, b, show)
        recv = Action("RECV_" + kind, mb, target // S, a, show)
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
