"""Communication at the edges of tensor-parallel regions, as paired autograd functions:
Megatron-LM's ``f`` and ``g`` (Shoeybi et al. 2019, section 3), scatter and gather along a
dim, and sequence parallelism's pair (Korthikanti et al. 2022, section 4.2.2). A tp group
of None or size 1 returns the input with no autograd node.
"""

from __future__ import annotations

import torch

from meshwise.comm import ops, policy

CATEGORY = "tp"


def tp_size_of(group: ops.Group | None) -> int:
    """Number of ranks in the tp group; 1 when ``group`` is ``None``."""
    return 1 if group is None else group.size


def tp_rank_of(group: ops.Group | None) -> int:
    """This rank's index in the tp group; 0 when ``group`` is ``None``."""
    return 0 if group is None else group.rank


# ---------------------------------------------------------------- raw collectives
def _all_reduce(x: torch.Tensor, group: ops.Group) -> torch.Tensor:
    # Out of place: the input may be saved by autograd or shared with another
    # consumer (an incoming gradient can be), so never reduce it in place.
    out = x.clone(memory_format=torch.contiguous_format)
    ops.all_reduce(out, group, category=CATEGORY)
    return out


def _split_own_chunk(x: torch.Tensor, group: ops.Group, dim: int) -> torch.Tensor:
    size = x.shape[dim]
    if size % group.size != 0:
        raise ValueError(f"dim {dim} of size {size} is not divisible by tp size {group.size}")
    chunk = size // group.size
    # Contiguous so the slice owns its memory and feeds collectives / matmuls directly.
    return x.narrow(dim, group.rank * chunk, chunk).contiguous()


def _all_gather(x: torch.Tensor, group: ops.Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    dim = dim % x.dim()
    flat_in = x.contiguous().view(-1)  # (numel,)
    flat_out = x.new_empty(group.size * flat_in.numel())  # (tp * numel,)
    ops.all_gather(flat_out, flat_in, group, category=CATEGORY)
    stacked = flat_out.view(group.size, *x.shape)  # (tp, s0, .., s_dim, .., s_n)
    if dim == 0:
        return stacked.view(group.size * x.shape[0], *x.shape[1:])  # (tp * s0, ...)
    # Bring the rank axis next to ``dim`` so that merging the two keeps rank order.
    moved = stacked.movedim(0, dim)  # (s0, .., tp, s_dim, .., s_n)
    shape = list(x.shape)
    shape[dim] *= group.size
    return moved.reshape(shape)  # (s0, .., tp * s_dim, .., s_n)


def _reduce_scatter(x: torch.Tensor, group: ops.Group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group; keep this rank's chunk along ``dim`` (rank order)."""
    size = x.shape[dim]
    if size % group.size != 0:
        raise ValueError(f"dim {dim} of size {size} is not divisible by tp size {group.size}")
    chunk = size // group.size
    # The chunks along ``dim`` become contiguous runs of a flat buffer: (S, ...) with S
    # = size, rank r's run r * chunk .. (r + 1) * chunk.
    leading = x.movedim(dim, 0)  # (S, ...)
    if policy.reduce_scatter_by_all_reduce(group):
        # Out of place (``x`` may be saved by autograd); the chunk is copied out so the
        # full-size sum is freed on return.
        leading = leading.clone(memory_format=torch.contiguous_format)
        ops.all_reduce(leading, group, category=CATEGORY)
        mine = leading.narrow(0, group.rank * chunk, chunk).clone()  # (chunk, ...)
    else:
        leading = leading.contiguous()
        mine = leading.new_empty(chunk, *leading.shape[1:])  # (chunk, ...)
        ops.reduce_scatter(mine.view(-1), leading.view(-1), group, category=CATEGORY)
    return mine.movedim(0, dim).contiguous()  # x's shape, dim / tp


# ---------------------------------------------------------------- autograd pairs
class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's chunk along ``dim``; the gradient is all-gathered back."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps this rank's chunk of the gradient (the consumer
    is replicated, so each rank already holds the full gradient).
    """

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split_own_chunk(grad, ctx.group, ctx.dim), None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` forward; reduce-scatter of the gradient backward (each
    rank's consumers computed a partial gradient of the whole gathered tensor)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


# ---------------------------------------------------------------- public functions
def copy_to_tp(x: torch.Tensor, group: ops.Group | None) -> torch.Tensor:
    """Enter a tp region (``f``): forward identity, backward all-reduce."""
    if tp_size_of(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ops.Group | None) -> torch.Tensor:
    """Leave a tp region (``g``): forward all-reduce (sum), backward identity."""
    if tp_size_of(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: ops.Group | None, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of ``x`` along ``dim``; backward all-gathers the gradient."""
    if tp_size_of(group) == 1:
        return x
    return _ScatterToTP.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, group: ops.Group | None, dim: int = -1) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` in rank order; backward keeps this rank's chunk."""
    if tp_size_of(group) == 1:
        return x
    return _GatherFromTP.apply(x, group, dim)


def gather_sequence(x: torch.Tensor, group: ops.Group | None, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel slices -> the whole sequence (all-gather along ``dim``);
    backward reduce-scatters the gradient."""
    if tp_size_of(group) == 1:
        return x
    return _GatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x: torch.Tensor, group: ops.Group | None, dim: int = 1) -> torch.Tensor:
    """Partial sums over the whole sequence -> this rank's slice of their total
    (reduce-scatter along ``dim``); backward all-gathers the gradient."""
    if tp_size_of(group) == 1:
        return x
    return _ReduceScatterSequence.apply(x, group, dim)
