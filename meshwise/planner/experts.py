"""Mixture-of-experts terms of the planner (pure): the expert parallel degrees a layout may
take, the parameters a rank holds and the state it keeps of them, and the all-to-all bytes
and seconds of the token exchange.

Expert parallelism splits each MoE layer's routed experts over ``ep`` ranks borrowed from
dp x cp; their gradients and ZeRO state are shared over the remaining ``dp x cp / ep``
ranks (expert data parallel). Each token goes to ``top_k`` experts: in the forward a
dispatch all-to-all sends every token copy to its expert's rank and a combine brings it
back; the backward moves their gradients the same way. A rank sends ``(ep - 1) / ep`` of
what it holds (its own share stays home), so per MoE layer and micro-batch

    all-to-all bytes = 4 x tokens x top_k x d_model x bytes x (ep - 1) / ep

(6 x with activation checkpointing: the recompute dispatches and combines again).
"""

from __future__ import annotations

from meshwise.planner.devices import DeviceProfile

PASSES = 4  # dispatch and combine, forward and backward
RECOMPUTE_PASSES = 2  # the recompute's dispatch and combine


def valid_ep(n_experts: int, dp_cp: int) -> list[int]:
    """The expert parallel degrees of a layout with ``dp_cp`` = dp x cp ranks: those that
    divide both the ranks and the experts (1 alone for a dense model)."""
    if n_experts <= 0:
        return [1]
    return [e for e in range(1, dp_cp + 1) if dp_cp % e == 0 and n_experts % e == 0]


def expert_dp(dp: int, cp: int, ep: int) -> int:
    """Ranks that hold the same experts and share their gradients and ZeRO state."""
    return dp * cp // ep


def all_to_all_bytes(
    tokens: float, top_k: int, d_model: int, dtype_bytes: int, ep: int, recompute: bool = False
) -> float:
    """Bytes one rank sends in the all-to-alls of one MoE layer for ``tokens`` tokens
    (forward and backward; the module docstring's formula)."""
    if ep <= 1:
        return 0.0
    passes = PASSES + (RECOMPUTE_PASSES if recompute else 0)
    return passes * tokens * top_k * d_model * dtype_bytes * (ep - 1) / ep


def all_to_all_s(device: DeviceProfile, nbytes: float, size: int, link: str) -> float:
    """Seconds of one all-to-all in which each rank holds ``nbytes`` and sends ``1 / size``
    of it to each peer: ``size - 1`` messages (pairwise exchange, Thakur et al. 2005)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    return (size - 1) * device.link(link).time(nbytes / size)


def active_fraction(n_experts: int, top_k: int) -> float:
    """The share of a layer's routed experts each token runs through."""
    return top_k / n_experts if n_experts else 1.0


def expert_state_bytes(
    expert_params: float, dp: int, cp: int, ep: int, zero: int, per_param
) -> float:
    """Bytes of parameters, gradients and optimizer state a rank keeps of its experts:
    ``expert_params / ep`` of them, ZeRO over the expert data parallel group
    (``per_param(zero, n)``: bytes per parameter at ZeRO ``zero`` over ``n`` ranks)."""
    held = expert_params / ep
    return held * per_param(zero, expert_dp(dp, cp, ep))
