"""The data a pipeline schedule is made of (pure): ``F``, ``B`` and ``W`` actions (Qi et al.
2024, section 2) and messages, per-rank lists, and the ``loop`` (Narayanan et al. 2021)
and ``v`` stage maps. See docs/pipelines.md "The schedule's contract".
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Union

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
STAGE_MAPS = ("loop", "v")
_SHORT = {
    "SEND_F": ("SF", ">"),
    "RECV_F": ("RF", "<"),
    "SEND_B": ("SB", ">"),
    "RECV_B": ("RB", "<"),
}
_ACTION_RE = re.compile(r"^(F|B|W|SF|RF|SB|RB)(\d+)(?:\.(\d+))?(?:([<>])(\d+))?$")


class ScheduleError(ValueError):
    """A schedule breaks a dependency, misses or duplicates an action, or can deadlock."""


@dataclass(frozen=True)
class Action:
    """One step of a rank: compute (``F``/``B``/``W``) or one message (``SEND_*``/``RECV_*``).

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
        """True for F, B and W."""
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        chunk = f".{self.chunk}" if self.show_chunk else ""
        if self.is_compute:
            return f"{self.kind}{self.micro_batch}{chunk}"
        short, arrow = _SHORT[self.kind]
        return f"{short}{self.micro_batch}{chunk}{arrow}{self.peer}"


def parse_action(text: str, show_chunk: bool = False) -> Action:
    """Read an action back from its string (``"F3"``, ``"W3.1"``, ``"SF3>1"``, ``"RB0.1<0"``)."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"not an action string: {text!r} (examples: F3, B3.1, W2, SF3>1, RB2<0)")
    short, mb, chunk, arrow, peer = match.groups()
    kind = {"SF": "SEND_F", "RF": "RECV_F", "SB": "SEND_B", "RB": "RECV_B"}.get(short, short)
    if (kind in COMM_KINDS) != (peer is not None) or (peer and arrow != _SHORT[kind][1]):
        raise ValueError(f"bad peer in action string {text!r}: sends use '>rank', receives '<rank'")
    return Action(
        kind,
        int(mb),
        int(chunk or 0),
        None if peer is None else int(peer),
        show_chunk=show_chunk or chunk is not None,
    )


def stage_index(rank: int, chunk: int, num_stages: int, stage_map: str = "loop") -> int:
    """Logical stage of ``chunk`` on ``rank`` among ``num_stages`` ranks (see module doc)."""
    if stage_map == "loop" or chunk % 2 == 0:
        return chunk * num_stages + rank
    return (chunk + 1) * num_stages - 1 - rank


def stage_owner(stage: int, num_stages: int, stage_map: str = "loop") -> tuple[int, int]:
    """``(rank, chunk)`` holding logical ``stage``: the inverse of :func:`stage_index`."""
    chunk, offset = divmod(stage, num_stages)
    if stage_map == "loop" or chunk % 2 == 0:
        return offset, chunk
    return num_stages - 1 - offset, chunk


@dataclass
class Schedule:
    """Per-rank action lists of one optimizer step: S ranks x V chunks, M micro-batches."""

    kind: str
    num_stages: int
    num_micro_batches: int
    num_virtual_stages: int
    ranks: list[list[Action]]
    stage_map: str = "loop"

    @property
    def num_logical(self) -> int:
        return self.num_stages * self.num_virtual_stages

    def stage_of(self, rank: int, chunk: int) -> int:
        """Logical stage of ``chunk`` on ``rank`` under this schedule's stage map."""
        return stage_index(rank, chunk, self.num_stages, self.stage_map)

    def owner(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that runs logical ``stage``."""
        return stage_owner(stage, self.num_stages, self.stage_map)

    def compute_actions(self, rank: int) -> list[Action]:
        """The F, B and W actions of ``rank``, in order."""
        return [a for a in self.ranks[rank] if a.is_compute]

    @cached_property
    def _split(self) -> frozenset:
        return frozenset(
            (r, a.micro_batch, a.chunk)
            for r, actions in enumerate(self.ranks)
            for a in actions
            if a.kind == "W"
        )

    def splits_backward(self, rank: int, micro_batch: int, chunk: int) -> bool:
        """Whether that B computes only the input gradient (a W does the weights)."""
        return (rank, micro_batch, chunk) in self._split

    @property
    def has_weight_actions(self) -> bool:
        return bool(self._split)


Step = Union[Action, tuple[Action, ...]]
Order = list[tuple[str, int, int]]  # one rank's compute actions as (kind, micro_batch, chunk)


def group_steps(actions: list[Action]) -> list[Step]:
    """Split a rank's list into steps: a compute Action, or a tuple of messages (one batch)."""
    steps: list[Step] = []
    for is_compute, group in itertools.groupby(actions, key=lambda action: action.is_compute):
        run = list(group)
        steps += run if is_compute else [tuple(run)]
    return steps
