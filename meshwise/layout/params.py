"""Where a parameter sits across tensor-parallel ranks, and its piece of the logical tensor.

Every parameter that a tensor-parallel layer creates carries marks that
gradient synchronisation, the gradient norm and checkpoints read:

* ``param.tp_sharded: bool``: ``True`` if the parameter is a slice of a full
  tensor split across tp ranks (each rank holds a different slice), ``False``
  if it is replicated (identical on every tp rank). It describes the kind of
  parameter, so it is the same for every layout, ``True`` even at tp=1;
* ``param.tp_dim: int | None``: the dim along which the full tensor is split,
  in rank order (``None`` when replicated);
* ``param.tp_unpadded_size: int``, only on padded parameters (the embedding):
  the real size of the full tensor along ``tp_dim``; rows beyond it are padding
  (a checkpoint stores only the real rows; a rank of another tp size loading it
  keeps its own zero padding).

A parameter without the marks (LayerNorm, ...) counts as replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from .pieces import Piece


def mark_tp(param: nn.Parameter, sharded: bool, dim: int | None = None) -> nn.Parameter:
    """Set the ``tp_sharded`` / ``tp_dim`` marks described in the module docstring."""
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
