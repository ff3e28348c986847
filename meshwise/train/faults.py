"""Faults injected on purpose, to test how a failing job ends.

``MESHWISE_FAIL_AT=RANK:STEP[:KIND]``: at step STEP rank RANK raises (``raise``, the
default), reports a non-finite loss (``nan``) or issues one extra dp all-reduce
(``desync``). ``install`` puts it in the trainer's step hooks, so the step knows nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import torch

from meshwise.comm import ops

ENV = "MESHWISE_FAIL_AT"
KINDS = ("raise", "nan", "desync")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str

    def install(self, trainer) -> None:
        """Hook this fault into ``trainer``'s step where it runs on the fault's rank."""
        if trainer.mesh.rank != self.rank:
            return
        if self.kind == "nan":
            trainer.after_loss.append(self.spoil_loss)
        else:
            trainer.before_step.append(partial(self.before_step, trainer.mesh, trainer.device))

    def before_step(self, mesh, device, step: int) -> None:
        if step != self.step:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")
        ops.all_reduce(torch.zeros(1, device=device), mesh.dp_group, category="fault")  # desync

    def spoil_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """This rank's loss of the step, not a number at the fault's step."""
        return loss + float("nan") if step == self.step else loss


def injected_fault() -> Fault | None:
    """The fault ``MESHWISE_FAIL_AT`` asks for, if any."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    rank, step, *rest = spec.split(":")
    kind = rest[0] if rest else "raise"
    if kind not in KINDS:
        raise ValueError(f"{ENV}={spec!r}: kind {kind!r}; valid: {', '.join(KINDS)}")
    return Fault(int(rank), int(step), kind)


def install(trainer) -> None:
    """Put the fault ``MESHWISE_FAIL_AT`` asks for, if any, into ``trainer``'s step hooks."""
    fault = injected_fault()
    if fault is not None:
        fault.install(trainer)
