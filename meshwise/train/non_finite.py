"""Non-finite steps: the error that ends a run, the check that every weight is finite, and
what ``--on-nan`` does with a step whose loss or gradient norm is not finite.
"""

from __future__ import annotations

import logging

import torch

from meshwise.comm import ops

log = logging.getLogger("meshwise")


class NonFiniteError(RuntimeError):
    pass


def reduce_to_host(values, op: str, device: torch.device, group: ops.Group) -> list[float]:
    """All-reduce numbers and 0-dim device tensors as one tensor; back on the host."""
    if any(torch.is_tensor(v) for v in values):
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    else:  # plain numbers: one copy to the device, not one per number
        t = torch.tensor(values, dtype=torch.float64, device=device)
    ops.all_reduce(t, group, op=op, category="metrics")
    return t.tolist()


def weights_finite(engine, device: torch.device, group: ops.Group) -> bool:
    """Whether every parameter on every rank is finite (a collective)."""
    ok = all(
        bool(torch.isfinite(run.tensors["param"][0]).all()) for run in engine.checkpoint_runs()
    )
    return reduce_to_host([1.0 if ok else 0.0], "min", device, group)[0] == 1.0


def handle_non_finite(trainer, step: int, loss: float, grad_norm: float) -> None:
    """Stop, or skip the step; skipping stops too once it cannot help."""
    message = f"non-finite values at step {step}: loss {loss}, grad_norm {grad_norm}"
    o = trainer.cfg.optim
    if o.on_nan == "stop":
        raise NonFiniteError(message + " (stopping; --on-nan skip skips such steps)")
    trainer.skipped_in_a_row += 1
    if not trainer.params_finite():
        raise NonFiniteError(
            message + "; the weights themselves are non-finite (an "
            "earlier update diverged), so skipping cannot recover"
        )
    if trainer.skipped_in_a_row > o.max_skipped_steps:
        raise NonFiniteError(
            f"{message}; {trainer.skipped_in_a_row} steps in a row skipped "
            f"(--max-skipped-steps {o.max_skipped_steps})"
        )
    if trainer.is_logging_rank:
        log.warning("%s; step skipped (--on-nan skip)", message)
