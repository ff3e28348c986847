"""The learning rate of each step, a pure function of the step and the recorded settings:
warmup, then ``cosine`` (Loshchilov & Hutter 2017), ``wsd`` (Hu et al. 2024; sqrt decay,
Hägele et al. 2024) or ``constant``; ``continues`` checks a resume keeps every past rate.
See docs/fine-tuning.md "Learning-rate schedules".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "sqrt", "cosine")
WSD_DECAY_FRACTION = 0.2  # decay steps when not given: the last 20% (Hägele et al. 2024)
# A warmup as long as the run or longer becomes this share of it: the rate then reaches
# --lr and decays, which a run never does under a warmup that outlasts it.
CLAMPED_WARMUP_FRACTION = 0.1


def warmup_of(warmup_steps: int, steps: int) -> int:
    """The warmup a schedule of ``steps`` steps runs: ``warmup_steps`` when shorter than
    the run, else ``CLAMPED_WARMUP_FRACTION`` of it (``warmup_warning`` says so)."""
    return warmup_steps if warmup_steps < steps else int(CLAMPED_WARMUP_FRACTION * steps)


def warmup_warning(optim) -> str | None:
    """The one line that says an ``OptimConfig``'s warmup was clamped, else None."""
    if optim.warmup_steps < optim.steps:
        return None
    return (
        f"--warmup-steps {optim.warmup_steps} is not shorter than --steps {optim.steps}: "
        f"warming up over {warmup_of(optim.warmup_steps, optim.steps)} steps instead, so "
        f"the rate reaches --lr {optim.lr:g} and decays; give --warmup-steps below "
        f"--steps to choose"
    )


def lr_at(
    step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> float:
    """Linear warmup to ``max_lr``, then cosine decay to ``min_lr_ratio * max_lr``.

    ``step`` is 1-based (the step about to be taken).
    """
    return LRSchedule("cosine", max_lr, warmup_steps, total_steps, min_lr_ratio=min_lr_ratio).lr(
        step
    )


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate schedule; ``lr(step)`` for the 1-based step about to be taken."""

    kind: str
    max_lr: float
    warmup_steps: int
    total_steps: int
    decay_steps: int | None = None  # wsd; None: WSD_DECAY_FRACTION of the steps
    decay_shape: str = "linear"
    min_lr_ratio: float = 0.1
    start: int = 0

    @classmethod
    def of(cls, optim, start: int = 0) -> "LRSchedule":
        """The schedule of an ``OptimConfig`` (this run's, or the one a checkpoint
        recorded), starting at step ``start``."""
        return cls(
            optim.lr_schedule,
            optim.lr,
            optim.warmup_steps,
            optim.steps,
            optim.decay_steps,
            optim.decay_shape,
            optim.min_lr_ratio,
            start,
        )

    @property
    def wsd_decay_steps(self) -> int:
        if self.decay_steps is not None:
            return self.decay_steps
        return max(1, round(WSD_DECAY_FRACTION * (self.total_steps - self.start)))

    def lr(self, step: int) -> float:
        return float(self.lrs(np.asarray([step]))[0])

    def lrs(self, steps: np.ndarray) -> np.ndarray:
        """The learning rate at each step of ``steps`` (1-based), as float64."""
        t = np.asarray(steps, dtype=np.float64) - self.start  # steps into this schedule
        total = self.total_steps - self.start
        floor = self.max_lr * self.min_lr_ratio
        warmup = warmup_of(self.warmup_steps, self.total_steps)
        if self.kind == "constant" or (self.kind == "cosine" and total <= warmup):
            after = np.full_like(t, self.max_lr)
        elif self.kind == "cosine":
            progress = np.clip((t - warmup) / (total - warmup), 0.0, 1.0)
            after = floor + 0.5 * (1 + np.cos(math.pi * progress)) * (self.max_lr - floor)
        else:
            decay = self.wsd_decay_steps
            progress = np.clip((t - (total - decay)) / decay, 0.0, 1.0)
            after = floor + _decayed(progress, self.decay_shape) * (self.max_lr - floor)
        if warmup <= 0:
            return after
        return np.where(t <= warmup, self.max_lr * t / warmup, after)

    def continues(self, before: "LRSchedule", steps_taken: int) -> bool:
        """Whether this schedule is ``before`` as far as it went: the same start, and the
        same learning rate at each step it took (to float round-off)."""
        if self.start != before.start:
            return False
        steps = np.arange(self.start + 1, steps_taken + 1)
        return bool(np.allclose(self.lrs(steps), before.lrs(steps), rtol=1e-12, atol=0.0))

    def describe(self) -> str:
        text = (
            f"--lr-schedule {self.kind} --lr {self.max_lr:g} --warmup-steps "
            f"{self.warmup_steps} --steps {self.total_steps}"
        )
        if self.kind == "wsd":
            text += f" --decay-steps {self.wsd_decay_steps} --decay-shape {self.decay_shape}"
        if self.kind != "constant" and self.min_lr_ratio != 0.1:
            text += f" --min-lr-ratio {self.min_lr_ratio:g}"
        return text + (f" (started at step {self.start})" if self.start else "")


def check_schedule(optim) -> None:
    """``--lr-schedule``, ``--decay-steps``, ``--decay-shape``, ``--min-lr-ratio`` of an
    ``OptimConfig``: ``ValueError`` naming the first bad value and the valid ones."""
    for flag, value, valid in (
        ("--lr-schedule", optim.lr_schedule, SCHEDULES),
        ("--decay-shape", optim.decay_shape, DECAY_SHAPES),
    ):
        if value not in valid:
            raise ValueError(f"{flag} {value!r} is not valid; valid: {', '.join(valid)}")
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        raise ValueError(
            f"--min-lr-ratio {optim.min_lr_ratio} is not valid; valid: 0 to 1 (a share of --lr)"
        )
    room = optim.steps - warmup_of(optim.warmup_steps, optim.steps)
    if optim.decay_steps is not None and not 1 <= optim.decay_steps <= max(room, 1):
        raise ValueError(
            f"--decay-steps {optim.decay_steps} is not valid with --steps "
            f"{optim.steps} --warmup-steps {optim.warmup_steps}; valid: 1 to "
            f"{max(room, 1)}"
        )


def resumed_start(optim, saved, step: int, saved_start: int = 0) -> int:
    """The step this run's schedule starts at when it resumes a checkpoint of ``step``
    whose ``OptimConfig`` was ``saved`` and whose schedule started at ``saved_start``:
    that start when this run's schedule continues it, ``step`` with ``lr_restart``;
    else ``ValueError`` saying how to go on."""
    before = LRSchedule.of(saved, saved_start)
    now = LRSchedule.of(optim, saved_start)
    if now.continues(before, step):
        return before.start
    if optim.lr_restart:
        return step
    return_to = before.describe().replace(f" (started at step {before.start})", "")
    raise ValueError(
        f"--resume: this run's {now.describe()} gives other learning rates "
        f"at steps {before.start + 1} to {step}, which the checkpoint took under "
        f"{before.describe()}: resuming would re-stretch its schedule; valid: "
        f"resume with {return_to}, or add --lr-restart to start this schedule "
        f"afresh at step {step}"
    )


def _decayed(progress: np.ndarray, shape: str) -> np.ndarray:
    """The share of the way from the floor to the peak left at ``progress`` in [0, 1]."""
    if shape == "sqrt":
        return 1 - np.sqrt(progress)
    if shape == "cosine":
        return 0.5 * (1 + np.cos(math.pi * progress))
    return 1 - progress
