"""The vocabulary split across tensor-parallel ranks (Megatron-LM, section 3): embedding and
head rows padded to a multiple of tp (padding zero, never looked up), and the loss from
the logit shards, so the ``(tokens, vocab)`` logits are never gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.comm import ops
from meshwise.geometry.init import normal
from meshwise.tensor_parallel.layers import padded_vocab_size, sharded_param
from meshwise.tensor_parallel.mappings import (
    CATEGORY,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_sequence,
    tp_rank_of,
    tp_size_of,
)
from meshwise.tensor_parallel.weight_grads import WeightGradStore, linear


# ---------------------------------------------------------------- vocabulary
class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split across tp.

    Each rank embeds the ids it owns, zeros for the others, and :func:`reduce_from_tp` sums
    them (reduce-scattered along dim 1 with ``sequence_parallel``). Padding rows, up to
    :func:`padded_vocab_size`, are zero and never looked up for valid ids (not checked: no
    device sync).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_group,
        init_std: float = 0.02,
        init_seed: int = 0,
        dtype: torch.dtype | None = None,
        device=None,
        _source=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        tp_size = tp_size_of(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = padded_vocab_size(num_embeddings, tp_size)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = sharded_param(
            (self.padded_num_embeddings, embedding_dim),
            0,
            tp_group,
            dtype or torch.get_default_dtype(),
            device,
            normal(init_std),
            init_seed,
            real_rows=num_embeddings,
            source=_source,
        )
        rows = self.padded_num_embeddings // tp_size  # (padded_vocab / tp, dim)
        self.vocab_start = tp_rank_of(tp_group) * rows
        self.vocab_end = self.vocab_start + rows

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, tp_group, sequence=None):
        return cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            tp_group,
            dtype=embedding.weight.dtype,
            device=embedding.weight.device,
            _source=embedding.weight,
            sequence_parallel=sequence is not None,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size_of(self.tp_group) == 1:
            return F.embedding(ids, self.weight)  # exactly nn.Embedding
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        # masked_fill also zeroes the gradient of the stand-in row 0 lookups.
        emb = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(emb, self.tp_group)  # (B, T / tp, dim)
        return reduce_from_tp(emb, self.tp_group)  # (..., dim)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"padded={self.padded_num_embeddings}, tp_size={tp_size_of(self.tp_group)}"
        )


class VocabParallelHead(nn.Module):
    """The output layer over the vocabulary, split like ``VocabParallelEmbedding`` (a tied head
    shares that table).

    Returns this rank's logits ``(..., padded_vocab / tp)`` for
    :func:`vocab_parallel_cross_entropy`, never gathered for the loss (``full_logits`` gathers
    them for generation). ``sequence``, ``weight_grads``: as for ``ColumnParallelLinear``.
    """

    weight_grads: WeightGradStore | None = None

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        tp_group,
        dtype: torch.dtype | None = None,
        device=None,
        _source=None,
        sequence=None,
    ):
        super().__init__()
        self.in_features, self.vocab_size, self.tp_group = in_features, vocab_size, tp_group
        self.sequence = sequence
        padded = padded_vocab_size(vocab_size, tp_size_of(tp_group))
        self.weight = sharded_param(
            (padded, in_features),
            0,
            tp_group,
            dtype or torch.get_default_dtype(),
            device,
            real_rows=vocab_size,
            source=_source,
        )  # (padded / tp, in)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_group, sequence=None):
        if linear.bias is not None:
            raise ValueError("a vocabulary-parallel head has no bias")
        return cls(
            linear.in_features,
            linear.out_features,
            tp_group,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            _source=linear.weight,
            sequence=sequence,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence is not None:  # the reduce-scatter backward sums over the shards
            return self.sequence.linear(hidden, self.weight)  # (B, T, V / tp)
        # copy_to_tp sums the hidden state's gradient over the vocabulary shards.
        return linear(copy_to_tp(hidden, self.tp_group), self.weight, None, self.weight_grads)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All ranks' logits, ``(..., vocab_size)`` (padding columns dropped)."""
        return gather_from_tp(logits, self.tp_group, dim=-1)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, vocab_size={self.vocab_size}, "
            f"tp_size={tp_size_of(self.tp_group)}"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logit shards; backward is local ``softmax - one_hot``
    (Megatron-LM section 3: ranks exchange per-token scalars, never the logits).
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, ignore_index):
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        # Our own copy in >= fp32, edited in place below; becomes the softmax.
        x = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
        num_real = min(max(vocab_size - start, 0), per_rank)
        if num_real < per_rank:
            x[..., num_real:] = float("-inf")  # padding: never the max, exp() = 0
        x_max = x.amax(dim=-1)  # (...,)
        ops.all_reduce(x_max, group, op="max", category=CATEGORY)
        x -= x_max.unsqueeze(-1)  # global max subtracted for a stable exp
        on_rank = (targets >= start) & (targets < start + per_rank)
        local_t = (targets - start).masked_fill(~on_rank, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~on_rank, 0.0)
        x.exp_()
        # One all-reduce for both per-token sums: half the latency of two on small messages.
        sums = torch.stack([x.sum(dim=-1), target_logit])  # (2, ...)
        ops.all_reduce(sums, group, category=CATEGORY)
        sum_exp, target_logit = sums.unbind(0)
        valid = targets != ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        x /= sum_exp.unsqueeze(-1)  # softmax shard
        ctx.save_for_backward(x, local_t, on_rank & valid, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, target_here, valid = ctx.saved_tensors
        scale = (grad_loss * valid).unsqueeze(-1)  # (..., 1); ignored -> 0
        grad = softmax * scale
        # d loss / d logit = softmax - one_hot(target); only the owner rank has the 1.
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -scale * target_here.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    tp_group,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "sum",
) -> torch.Tensor:
    """Cross-entropy over the full vocabulary from this rank's logit slice.

    ``logits_shard``: ``(..., padded_vocab / tp)``, rank ``r`` holding columns ``[r * V/tp,
    (r+1) * V/tp)``; ``targets``: global ids; columns at or past ``vocab_size`` are masked.
    ``reduction``: ``"none"`` (0 where ignored), ``"sum"`` or ``"mean"`` (over non-ignored
    tokens). Computed and returned in fp32.
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction={reduction!r}; valid: 'none', 'sum', 'mean'")
    tp_size = tp_size_of(tp_group)
    full_width = logits_shard.shape[-1] * tp_size
    vocab_size = full_width if vocab_size is None else vocab_size
    if not 0 < vocab_size <= full_width:
        raise ValueError(f"vocab_size={vocab_size} must be in 1..{full_width} (logit columns x tp)")
    if logits_shard.dtype not in (torch.float32, torch.float64):
        logits_shard = logits_shard.float()
    if tp_size == 1:
        flat = logits_shard[..., :vocab_size].reshape(-1, vocab_size)  # (tokens, vocab)
        loss = F.cross_entropy(
            flat, targets.reshape(-1), ignore_index=ignore_index, reduction=reduction
        )
        return loss.view(targets.shape) if reduction == "none" else loss
    losses = _VocabParallelCrossEntropy.apply(
        logits_shard, targets, tp_group, vocab_size, ignore_index
    )
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / (targets != ignore_index).sum()
