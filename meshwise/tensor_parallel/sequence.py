"""Sequence parallelism at the input of column-parallel layers (Korthikanti et al. 2022):
one all-gather for every layer that reads an activation, each keeping only its slice
and gathering it again for the backward (section 4.2.2), so the activations take 1/tp;
and learned positions looked up for this rank's slice only.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.geometry.sequence import sequence_run
from meshwise.tensor_parallel.layers import replicated_param
from meshwise.tensor_parallel.mappings import _all_gather, _reduce_scatter, tp_rank_of, tp_size_of

SEQUENCE_DIM = 1  # activations are (batch, sequence, features)


class SequenceGather:
    """The whole sequence of a sequence-parallel activation, gathered once for every
    layer of one model chunk that reads it (``linear``), and again in backward."""

    def __init__(self, group):
        self.group = group
        self._gathered: tuple | None = None  # (weakref to the slice, whole sequence)
        self._regathered: tuple | None = None  # the same, in backward

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``F.linear`` of the whole sequence of ``x`` (this rank's slice along dim 1)."""
        whole = self._gather(x)  # (B, T, in)
        if not torch.is_grad_enabled():
            return F.linear(whole, weight, bias)
        return _GatheredLinear.apply(whole, x, weight, bias, self)  # (B, T, out)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        memo = self._gathered
        if memo is not None and memo[0]() is x:
            return memo[1]
        whole = _GatherOnce.apply(x, self)
        # Kept until its backward (or the next gather): its readers come one by one.
        self._gathered = (weakref.ref(x), whole)
        return whole

    def regather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence of ``x`` again, without autograd (in backward)."""
        memo = self._regathered
        if memo is not None and memo[0]() is x:
            return memo[1]
        whole = _all_gather(x, self.group, SEQUENCE_DIM)
        self._regathered = (weakref.ref(x), whole)
        return whole

    def release(self) -> None:
        """Every reader's backward is done: drop what was kept for them."""
        self._gathered = self._regathered = None


class _GatherOnce(torch.autograd.Function):
    """All-gather along the sequence; backward reduce-scatters the summed gradient of
    every reader, after which nothing kept for them is needed."""

    @staticmethod
    def forward(ctx, x, gather: SequenceGather):
        ctx.gather = gather
        return _all_gather(x, gather.group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        ctx.gather.release()
        return _reduce_scatter(grad, ctx.gather.group, SEQUENCE_DIM), None


class _GatheredLinear(torch.autograd.Function):
    """``F.linear(whole, weight, bias)`` that saves the slice ``x``, not ``whole``."""

    @staticmethod
    def forward(ctx, whole, x, weight, bias, gather: SequenceGather):
        ctx.gather, ctx.has_bias = gather, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_whole = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_whole = grad @ weight  # (B, T, in)
        flat_grad = grad.reshape(-1, grad.shape[-1])  # (B * T, out)
        if ctx.needs_input_grad[2]:
            whole = ctx.gather.regather(x)
            grad_weight = flat_grad.t() @ whole.reshape(-1, whole.shape[-1])  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = flat_grad.sum(0)
        return grad_whole, None, grad_weight, grad_bias, None


class SequenceParallelEmbedding(nn.Module):
    """Learned positions, replicated across tp, looked up for this rank's slice of the
    positions only (their rows' gradients are summed over tp by the gradient sync)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_group,
        dtype=None,
        device=None,
        _source=None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp_group = (
            num_embeddings,
            embedding_dim,
            tp_group,
        )
        self.weight = replicated_param(
            (num_embeddings, embedding_dim), dtype or torch.get_default_dtype(), device, _source
        )

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, tp_group, sequence=None):
        if sequence is None:  # without sequence parallelism every rank holds every position
            return embedding
        return cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            tp_group,
            embedding.weight.dtype,
            embedding.weight.device,
            embedding.weight,
        )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        mine = sequence_run(
            positions, positions.dim() - 1, tp_rank_of(self.tp_group), tp_size_of(self.tp_group)
        )  # (..., T / tp)
        return F.embedding(mine, self.weight)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"tp_size={tp_size_of(self.tp_group)}, sequence parallel"
        )
