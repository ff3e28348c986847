"""Faults injected on purpose, to test how a failing job ends.

``MESHWISE_FAIL_AT=RANK:STEP[:KIND]`` makes rank RANK, at step STEP:

- ``raise`` (the default): raise an error at the start of the step;
- ``nan``: report a non-finite loss for the step;
- ``desync``: issue one extra dp all-reduce at the start of the step, one that no
  other rank issues (the collective ledger must name it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from meshwise.comm import ops

ENV = "MESHWISE_FAIL_AT"
KINDS = ("raise", "nan", "desync")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str

    def at(self, rank: int, step: int) -> bool:
        return (self.rank, self.step) == (rank, step)

    def before_step(self, mesh, device) -> None:
        if self.kind == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")
        if self.kind == "desync":
            ops.all_reduce(torch.zeros(1, device=device), mesh.dp, category="fault")


def injected_fault() -> Fault | None:
    """The fault ``MESHWISE_FAIL_AT`` asks for, if any."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    rank, step, *kind = spec.split(":")
    kind = kind[0] if kind else "raise"
    if kind not in KINDS:
        raise ValueError(f"{ENV}={spec!r}: kind {kind!r}; valid: {', '.join(KINDS)}")
    return Fault(int(rank), int(step), kind)
