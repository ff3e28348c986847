"""Tensor-parallel layers (Shoeybi et al. 2019, Megatron-LM, section 3).

* :class:`ColumnParallelLinear`: ``Y = X A`` with ``A`` split by output columns,
  so each rank computes its slice of ``Y`` with no communication (the first GEMM
  of the Megatron MLP and the Q/K/V projections).
* :class:`RowParallelLinear`: ``A`` split by input rows; each rank computes a
  partial sum of ``Y`` and one all-reduce completes it (the second GEMM). A
  column layer followed by a row layer therefore costs one all-reduce forward
  and one backward.
* :class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy`: the
  vocabulary split across ranks, with the loss computed from the logit shards so
  that the ``(tokens, vocab)`` logits are never gathered.

Initialisation never depends on the layout: each layer builds the FULL tensor
with ``torch.Generator().manual_seed(init_seed)`` exactly as a single process
would and keeps this rank's slice (see :func:`init_normal`). Give every layer of
a model its own ``init_seed``. With ``tp_group`` ``None`` (or of size 1) each
layer is numerically identical to ``nn.Linear`` / ``nn.Embedding`` /
``F.cross_entropy`` holding the same tensors.

Parameter convention (relied on by gradient synchronisation, grad-norm and
checkpointing): every parameter created here carries

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

A parameter without the attributes (LayerNorm, ...) counts as replicated; use
:func:`is_tp_sharded`. Replicated parameters receive identical gradients on every
tp rank (their inputs are replicated), so they need no tp all-reduce, and a
global grad-norm counts them once. The vocabulary dim of an embedding is padded
up to a multiple of tp (:func:`padded_vocab_size`); padding rows are zero, never
looked up, masked out of the loss, and so keep zero gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.comm import ops
from meshwise.tensor_parallel.mappings import (CATEGORY, copy_to_tp, gather_from_tp,
                                               reduce_from_tp, scatter_to_tp, tp_rank_of,
                                               tp_size_of)


# ---------------------------------------------------------------- helpers
def init_normal(shape, std: float, seed: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full tensor N(0, std^2) as one process builds it from ``seed``.

    Drawn in at least float32 (a bf16 draw would differ from an fp32 draw of the
    same seed by more than a cast), then cast to ``dtype``.
    """
    dtype = dtype or torch.get_default_dtype()
    gen = torch.Generator().manual_seed(seed)
    full = torch.empty(shape, dtype=torch.promote_types(dtype, torch.float32))
    return full.normal_(0.0, std, generator=gen).to(dtype)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``tp_size``."""
    return -(-vocab_size // tp_size) * tp_size


def mark_tp(param: nn.Parameter, sharded: bool, dim: int | None = None) -> nn.Parameter:
    """Set the ``tp_sharded`` / ``tp_dim`` attributes described in the module docstring."""
    param.tp_sharded = sharded
    param.tp_dim = dim if sharded else None
    return param


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether tp ranks hold different slices of ``param`` (unmarked = replicated)."""
    return bool(getattr(param, "tp_sharded", False))


def _shard(full: torch.Tensor, dim: int, group) -> nn.Parameter:
    size, rank = tp_size_of(group), tp_rank_of(group)
    chunk = full.shape[dim] // size
    local = full.narrow(dim, rank * chunk, chunk).clone(memory_format=torch.contiguous_format)
    return mark_tp(nn.Parameter(local), sharded=True, dim=dim)


def _check_divisible(name: str, value: int, tp_size: int) -> None:
    if value % tp_size != 0:
        raise ValueError(f"{name}={value} is not divisible by tp size {tp_size}")


# ---------------------------------------------------------------- linear layers
class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s output rows (``Y``'s columns) split across tp.

    The input is replicated; :func:`copy_to_tp` (Megatron's ``f``) sums its
    gradient over ranks. The output is this rank's ``out_features / tp`` slice,
    or the full output when ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, tp_group, bias: bool = True,
                 gather_output: bool = False, init_std: float = 0.02, init_seed: int = 0,
                 dtype: torch.dtype | None = None):
        super().__init__()
        _check_divisible("out_features", out_features, tp_size_of(tp_group))
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.gather_output = tp_group, gather_output
        full = init_normal((out_features, in_features), init_std, init_seed, dtype)
        self.weight = _shard(full, 0, tp_group)                  # (out / tp, in)
        if bias:
            self.bias = _shard(torch.zeros(out_features, dtype=full.dtype), 0, tp_group)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.tp_group), self.weight, self.bias)  # (..., out / tp)
        return gather_from_tp(y, self.tp_group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp_size={tp_size_of(self.tp_group)}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s input columns split across tp.

    Each rank multiplies its slice of ``x`` by its slice of ``A``; the partial
    products are summed by :func:`reduce_from_tp` (Megatron's ``g``). The bias is
    replicated and added once, after the reduction (adding it per rank would
    count it ``tp`` times).
    """

    def __init__(self, in_features: int, out_features: int, tp_group, bias: bool = True,
                 input_is_parallel: bool = True, init_std: float = 0.02, init_seed: int = 0,
                 dtype: torch.dtype | None = None):
        super().__init__()
        _check_divisible("in_features", in_features, tp_size_of(tp_group))
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        full = init_normal((out_features, in_features), init_std, init_seed, dtype)
        self.weight = _shard(full, 1, tp_group)                  # (out, in / tp)
        if bias:
            self.bias = mark_tp(nn.Parameter(torch.zeros(out_features, dtype=full.dtype)), False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size_of(self.tp_group) == 1:
            return F.linear(x, self.weight, self.bias)  # exactly nn.Linear
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group, dim=-1)          # (..., in / tp)
        y = reduce_from_tp(F.linear(x, self.weight), self.tp_group)  # (..., out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp_size={tp_size_of(self.tp_group)}, input_is_parallel={self.input_is_parallel}")


# ---------------------------------------------------------------- vocabulary
class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split across tp.

    Each rank embeds the ids it owns, writes zeros for the others, and
    :func:`reduce_from_tp` sums the rows into the full embedding. The table is
    padded to :func:`padded_vocab_size` rows; padding rows start at zero and are
    never looked up for valid ids (``0 <= id < num_embeddings``, not checked, to
    avoid a device sync). :meth:`logits` reuses the table as the LM head.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group,
                 init_std: float = 0.02, init_seed: int = 0, dtype: torch.dtype | None = None):
        super().__init__()
        tp_size = tp_size_of(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = padded_vocab_size(num_embeddings, tp_size)
        self.tp_group = tp_group
        real = init_normal((num_embeddings, embedding_dim), init_std, init_seed, dtype)
        full = torch.zeros(self.padded_num_embeddings, embedding_dim, dtype=real.dtype)
        full[:num_embeddings] = real                              # (padded_vocab, dim)
        self.weight = _shard(full, 0, tp_group)                   # (padded_vocab / tp, dim)
        self.weight.tp_unpadded_size = num_embeddings
        rows = self.padded_num_embeddings // tp_size
        self.vocab_start = tp_rank_of(tp_group) * rows
        self.vocab_end = self.vocab_start + rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size_of(self.tp_group) == 1:
            return F.embedding(ids, self.weight)  # exactly nn.Embedding
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        # masked_fill also zeroes the gradient of the stand-in row 0 lookups.
        emb = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(emb, self.tp_group)                # (..., dim)

    def logits(self, hidden: torch.Tensor, gather_output: bool = False) -> torch.Tensor:
        """Tied LM head: this rank's vocab-parallel logits ``hidden @ E_shard^T``.

        Returns ``(..., padded_vocab / tp)``, ready for
        :func:`vocab_parallel_cross_entropy` with ``vocab_size=num_embeddings``;
        with ``gather_output`` the full ``(..., num_embeddings)`` logits instead
        (for generation: padding columns are dropped).
        """
        logits = vocab_parallel_logits(hidden, self.weight, self.tp_group)
        if not gather_output:
            return logits
        return gather_from_tp(logits, self.tp_group, dim=-1)[..., :self.num_embeddings]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"padded={self.padded_num_embeddings}, tp_size={tp_size_of(self.tp_group)}")


def vocab_parallel_logits(hidden: torch.Tensor, weight_shard: torch.Tensor, tp_group) -> torch.Tensor:
    """``copy_to_tp(hidden) @ weight_shard^T``: logits for this rank's vocabulary slice.

    Takes the weight itself so a pipeline stage holding a tied copy of the
    embedding can use it too. ``copy_to_tp`` sums the hidden state's gradient
    over the vocabulary shards.
    """
    return F.linear(copy_to_tp(hidden, tp_group), weight_shard)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logit shards; backward is local ``softmax - one_hot``.

    Megatron-LM section 3 fuses the parallel output GEMM with the loss so that
    ranks exchange per-token scalars (max, sum of exp, target logit) instead of
    ``(tokens, vocab)`` logits.
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
        x_max = x.amax(dim=-1)                                    # (...,)
        ops.all_reduce(x_max, group, op="max", category=CATEGORY)
        x -= x_max.unsqueeze(-1)  # global max subtracted for a stable exp
        on_rank = (targets >= start) & (targets < start + per_rank)
        local_t = (targets - start).masked_fill(~on_rank, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~on_rank, 0.0)
        x.exp_()
        # One all-reduce for both per-token sums: half the latency of two on small messages.
        sums = torch.stack([x.sum(dim=-1), target_logit])        # (2, ...)
        ops.all_reduce(sums, group, category=CATEGORY)
        sum_exp, target_logit = sums.unbind(0)
        valid = targets != ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        x /= sum_exp.unsqueeze(-1)                                # softmax shard
        ctx.save_for_backward(x, local_t, on_rank & valid, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, target_here, valid = ctx.saved_tensors
        scale = (grad_loss * valid).unsqueeze(-1)                # (..., 1); ignored -> 0
        grad = softmax * scale
        # d loss / d logit = softmax - one_hot(target); only the owner rank has the 1.
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -scale * target_here.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, tp_group,
                                 vocab_size: int | None = None, ignore_index: int = -100,
                                 reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy over the full vocabulary from this rank's logit slice.

    ``logits_shard``: ``(..., padded_vocab / tp)``, rank ``r`` holding columns
    ``[r * V/tp, (r+1) * V/tp)``; ``targets``: ``(...)`` global ids. ``vocab_size``
    is the real vocabulary (default: no padding); columns at or beyond it are
    masked to ``-inf``. ``reduction``: ``"none"`` (per token, 0 where ignored),
    ``"sum"`` or ``"mean"`` (over non-ignored tokens, as ``F.cross_entropy``).
    Logits below fp32 are computed in fp32 and the loss is returned in fp32.
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
        loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore_index,
                               reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss
    losses = _VocabParallelCrossEntropy.apply(logits_shard, targets, tp_group, vocab_size,
                                              ignore_index)
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / (targets != ignore_index).sum()
