"""The learning rate of each step (a pure function of the step)."""

from __future__ import annotations

import math


def lr_at(step: int, max_lr: float, warmup_steps: int, total_steps: int,
          min_lr_ratio: float = 0.1) -> float:
    """Linear warmup to ``max_lr``, then cosine decay to ``min_lr_ratio * max_lr``.

    ``step`` is 1-based (the step about to be taken).
    """
    min_lr = max_lr * min_lr_ratio
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if total_steps <= warmup_steps:
        return max_lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (max_lr - min_lr)
