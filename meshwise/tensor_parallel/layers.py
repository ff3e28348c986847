"""Tensor-parallel linear layers (Shoeybi et al. 2019, Megatron-LM, section 3): a column
layer then a row layer cost one all-reduce forward and one backward. A layer draws only
its slice of the single-process tensor of ``init_seed`` (give each layer its own), carries
``meshwise.geometry.params``' marks, and at tp 1 equals ``nn.Linear``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from meshwise.geometry.init import Init, init_values, normal
from meshwise.geometry.params import mark_tp
from meshwise.geometry.pieces import Piece
from meshwise.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_sequence,
    scatter_to_tp,
    tp_rank_of,
    tp_size_of,
)
from meshwise.tensor_parallel.weight_grads import WeightGradStore, linear


# ---------------------------------------------------------------- helpers
def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``tp_size``."""
    return -(-vocab_size // tp_size) * tp_size


def _check_divisible(name: str, value: int, tp_size: int) -> None:
    if value % tp_size != 0:
        raise ValueError(f"{name}={value} is not divisible by tp size {tp_size}")


def sharded_param(
    full_shape,
    dim: int,
    group,
    dtype,
    device,
    init: Init | None = None,
    seed: int = 0,
    real_rows: int | None = None,
    source=None,
) -> nn.Parameter:
    """This rank's slice along ``dim`` of a tensor of ``full_shape``, as a parameter: empty on
    the meta device, else the slice of ``source`` (a full tensor) or of the single-process
    ``init`` from ``seed``. Along dim 0, rows at or past ``real_rows`` are padding, zero.
    """
    size, rank = tp_size_of(group), tp_rank_of(group)
    local = list(full_shape)
    local[dim] //= size
    start = rank * local[dim]
    param = mark_tp(nn.Parameter(torch.zeros(local, dtype=dtype, device=device)), True, dim)
    real = full_shape[dim] if real_rows is None else real_rows
    if real_rows is not None:  # a mark (meshwise.geometry.params) torch's types do not declare
        param.tp_unpadded_size = real_rows  # type: ignore[attr-defined]
    count = max(0, min(local[dim], real - start))  # real (unpadded) entries we hold
    if param.device.type == "meta" or count == 0 or (source is None and init is None):
        return param
    with torch.no_grad():
        target = param.narrow(dim, 0, count)
        if source is not None:
            target.copy_(source.detach().narrow(dim, start, count))
        elif init is not None:
            real_shape = list(full_shape)
            real_shape[dim] = real
            offsets = [0] * len(full_shape)
            offsets[dim] = start
            piece = Piece.box("weight", real_shape, offsets, target.shape)
            target.copy_(init_values(init, seed, piece).view(target.shape))
    return param


def replicated_param(shape, dtype, device, source=None) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
    if source is not None and param.device.type != "meta":
        with torch.no_grad():
            param.copy_(source.detach())
    return mark_tp(param, False)


# ---------------------------------------------------------------- linear layers
class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s output rows (``Y``'s columns) split across tp.

    The input is replicated (:func:`copy_to_tp`, Megatron's ``f``, sums its gradient); the
    output is this rank's ``out_features / tp``, or whole with ``gather_output``. ``sequence``
    (a ``SequenceGather``): the input is this rank's sequence slice, gathered first.
    ``weight_grads``: a split backward's store (``meshwise.tensor_parallel.weight_grads``).
    """

    weight_grads: WeightGradStore | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group,
        bias: bool = True,
        gather_output: bool = False,
        init_std: float = 0.02,
        init_seed: int = 0,
        dtype: torch.dtype | None = None,
        device=None,
        _source=None,
        sequence=None,
    ):
        super().__init__()
        _check_divisible("out_features", out_features, tp_size_of(tp_group))
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.gather_output, self.sequence = tp_group, gather_output, sequence
        dtype = dtype or torch.get_default_dtype()
        weight, b = (None, None) if _source is None else _source
        self.weight = sharded_param(
            (out_features, in_features),
            0,
            tp_group,
            dtype,
            device,
            normal(init_std),
            init_seed,
            source=weight,
        )  # (out / tp, in)
        if bias:
            self.bias = sharded_param((out_features,), 0, tp_group, dtype, device, source=b)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_group, gather_output: bool = False, sequence=None):
        """The column-parallel form of ``linear`` (its slice of the values, or shapes on meta)."""
        return cls(
            linear.in_features,
            linear.out_features,
            tp_group,
            linear.bias is not None,
            gather_output,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            _source=(linear.weight, linear.bias),
            sequence=sequence,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence is not None:
            # Its own autograd function regathers the input in backward: the weight
            # gradient comes in B, also under a split backward.
            y = self.sequence.linear(x, self.weight, self.bias)  # (B, T, out / tp)
        else:
            y = linear(
                copy_to_tp(x, self.tp_group), self.weight, self.bias, self.weight_grads
            )  # (..., out / tp)
        return gather_from_tp(y, self.tp_group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp_size={tp_size_of(self.tp_group)}, gather_output={self.gather_output}"
            + (", sequence parallel" if self.sequence is not None else "")
        )


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s input columns split across tp.

    Partial products are summed by :func:`reduce_from_tp` (Megatron's ``g``), or
    reduce-scattered along the sequence (dim 1) with ``sequence_parallel``; the replicated
    bias is added once, after the sum. ``weight_grads``: as for ``ColumnParallelLinear``.
    """

    weight_grads: WeightGradStore | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_std: float = 0.02,
        init_seed: int = 0,
        dtype: torch.dtype | None = None,
        device=None,
        _source=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        _check_divisible("in_features", in_features, tp_size_of(tp_group))
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        dtype = dtype or torch.get_default_dtype()
        weight, b = (None, None) if _source is None else _source
        self.weight = sharded_param(
            (out_features, in_features),
            1,
            tp_group,
            dtype,
            device,
            normal(init_std),
            init_seed,
            source=weight,
        )  # (out, in / tp)
        if bias:
            self.bias = replicated_param((out_features,), dtype, device, source=b)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, tp_group, input_is_parallel: bool = True, sequence=None
    ):
        """The row-parallel form of ``linear`` (its slice of the values, or shapes on meta);
        ``sequence``: the chunk's ``SequenceGather`` under sequence parallelism."""
        return cls(
            linear.in_features,
            linear.out_features,
            tp_group,
            linear.bias is not None,
            input_is_parallel,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            _source=(linear.weight, linear.bias),
            sequence_parallel=sequence is not None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size_of(self.tp_group) == 1:
            return linear(x, self.weight, self.bias, self.weight_grads)  # exactly nn.Linear
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group, dim=-1)  # (..., in / tp)
        partial = linear(x, self.weight, None, self.weight_grads)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.tp_group)  # (B, T/tp, out)
        else:
            y = reduce_from_tp(partial, self.tp_group)  # (..., out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp_size={tp_size_of(self.tp_group)}, input_is_parallel={self.input_is_parallel}"
            + (", sequence parallel" if self.sequence_parallel else "")
        )


# ---------------------------------------------------------------- norms on a shard
class RMSNormLike(Protocol):
    """What ``ShardRMSNorm.from_norm`` reads of a norm (``nn.RMSNorm`` or a model's own)."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def eps(self) -> float | None: ...


class ShardRMSNorm(nn.Module):
    """An RMSNorm over the last dim of a tensor-parallel shard (Qwen3's per-head q/k norms).

    The weight is replicated but each rank's gradient covers its heads: ``copy_to_tp`` sums
    it over tp, except under sequence parallelism, where the gradient sync already does.
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        tp_group,
        dtype=None,
        device=None,
        source=None,
        sum_grad: bool = True,
    ):
        super().__init__()
        self.eps, self.tp_group, self.sum_grad = eps, tp_group, sum_grad
        self.weight = replicated_param((dim,), dtype, device, source)

    @classmethod
    def from_norm(cls, norm: RMSNormLike, tp_group, sequence=None) -> ShardRMSNorm:
        """From an RMSNorm (``weight`` of one dim and ``eps``; ``nn.RMSNorm`` included);
        ``sequence``: the chunk's ``SequenceGather`` under sequence parallelism."""
        eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
        return cls(
            norm.weight.shape[0],
            eps,
            tp_group,
            dtype=norm.weight.dtype,
            device=norm.weight.device,
            source=norm.weight,
            sum_grad=sequence is None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = copy_to_tp(self.weight, self.tp_group) if self.sum_grad else self.weight
        return weight * x32.to(x.dtype)
