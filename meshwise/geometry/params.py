"""Where a parameter sits across tensor-parallel ranks, and its piece of the logical tensor.

Tensor-parallel layers mark their parameters (``tp_sharded``, ``tp_dim``, and
``tp_unpadded_size`` on the padded embedding), expert-parallel experts theirs
(``ep_split``); gradient sync, the gradient norm and checkpoints read the marks. An
unmarked parameter (a LayerNorm's) is replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from .pieces import Piece


def mark_tp(param: nn.Parameter, sharded: bool, dim: int | None = None) -> nn.Parameter:
    """Mark ``param``: ``tp_sharded`` if tp ranks hold different slices of it (a property of
    its kind, so ``True`` even at tp 1), ``tp_dim`` the dim split in rank order (None if not).
    """
    # The marks are attributes of the parameter object, which torch's types do not declare.
    param.tp_sharded = sharded  # type: ignore[attr-defined]
    param.tp_dim = dim if sharded else None  # type: ignore[attr-defined]
    return param


def mark_tie(param: nn.Parameter, group) -> nn.Parameter:
    """Mark ``param`` as one copy of a tie whose other copies live on other pipeline
    stages: its gradient is summed over ``group`` (the stages holding a copy;
    ``None`` when the caller gave none: no engine can then train it)."""
    param.cross_stage_tie = True  # type: ignore[attr-defined]  # a mark, as above
    param.tie_group = group  # type: ignore[attr-defined]
    return param


def mark_ep(param: nn.Parameter, ep_rank: int, ep_size: int) -> nn.Parameter:
    """Mark ``param`` as expert-parallel rank ``ep_rank``'s slice along dim 0 of ``ep_size``
    equal ones (stacked experts); experts are never split over tp as well."""
    param.ep_split = (ep_rank, ep_size)  # type: ignore[attr-defined]  # a mark, as above
    return param


def ep_split(param: torch.Tensor) -> tuple[int, int] | None:
    """``(ep_rank, ep_size)`` of an expert-parallel slice, else None."""
    return getattr(param, "ep_split", None)


def cross_stage_tie(param: torch.Tensor) -> tuple[bool, object]:
    """Whether ``param`` is a cross-stage tie copy, and the group its gradient is summed over."""
    return bool(getattr(param, "cross_stage_tie", False)), getattr(param, "tie_group", None)


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether tp ranks hold different slices of ``param`` (unmarked = replicated)."""
    return bool(getattr(param, "tp_sharded", False))


def logical_piece(name: str, param: torch.Tensor, tp_rank: int, tp_size: int) -> Piece:
    """Where this rank's ``param`` sits in the single-process tensor ``name``.

    A tp-sharded parameter is a box along ``tp_dim``; vocabulary padding (rows
    past ``tp_unpadded_size``) belongs to no logical element and is dropped.
    """
    shape = list(param.shape)
    split = ep_split(param)
    if split is not None:  # dim 0 over ep, as a tp split along dim 0
        ep_rank, ep_size = split
        full, offsets = (
            [shape[0] * ep_size, *shape[1:]],
            [ep_rank * shape[0]] + [0] * (len(shape) - 1),
        )
        return Piece.box(name, full, offsets, shape)
    if not is_tp_sharded(param):
        return Piece.whole(name, shape)
    dim = param.tp_dim  # type: ignore[attr-defined]  # set by mark_tp
    local = shape[dim]
    real = getattr(param, "tp_unpadded_size", local * tp_size)
    if real != local * tp_size and dim != 0:
        raise ValueError(f"{name}: padding is only supported along dim 0")
    start = min(tp_rank * local, real)
    size = max(0, min(local, real - tp_rank * local))
    full_shape, offsets, sizes = list(shape), [0] * len(shape), list(shape)
    full_shape[dim], offsets[dim], sizes[dim] = real, start, size
    return Piece.box(name, full_shape, offsets, sizes)
