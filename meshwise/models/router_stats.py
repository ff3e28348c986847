"""One forward's router statistics and the load-balancing loss's gradient.

The balancing loss of a micro-batch is Switch Transformer's (Fedus et al. 2021, eq. 4)
in transformers' normalisation: ``E * sum_e (c_e / N) * (P_e / N)`` per MoE layer, with
``c_e`` the token copies routed to expert ``e``, ``P_e`` the sum of its probabilities
and ``N`` the tokens, all over the micro-batch of every rank. Its gradient with
respect to a rank's probabilities needs only the global ``c_e`` (counts carry no
gradient), so the forward sums the counts (``reduce_counts``) and each rank adds the
gradient of its own share ``E * sum_e c_e * P_e(rank) / N^2`` beside the activations
(as Megatron-LM's aux-loss scaler does), which crosses pipeline stages with them.
"""

from __future__ import annotations

from typing import Callable

import torch

AUX_FORMULAS = ("per-layer", "hf-concatenated")


class RouterTally:
    """Router statistics of one forward (one micro-batch), keyed by decoder layer.

    ``aux_scale``: the balancing loss's weight in this micro-batch's objective
    (coefficient / micro-batches; 0: no loss); ``reduce_counts``: sums a (E,) count
    over the ranks that route different tokens (None: one process). A layer seen
    twice is the recompute of activation checkpointing: it is counted once and its
    summed counts are reused, with no collective.
    """

    def __init__(
        self,
        aux_scale: float = 0.0,
        formula: str = "per-layer",
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if formula not in AUX_FORMULAS:
            raise ValueError(f"aux loss formula {formula!r}; valid: {', '.join(AUX_FORMULAS)}")
        self.aux_scale, self.formula = aux_scale, formula
        self.reduce_counts = reduce_counts
        self.counts: dict[int, torch.Tensor] = {}  # layer -> (E,) this rank's counts
        self.global_counts: dict[int, torch.Tensor] = {}  # layer -> (E,) summed counts
        self.aux: dict[int, torch.Tensor] = {}  # layer -> this rank's share of the loss
        self.prob_sums: dict[int, torch.Tensor] = {}  # layer -> (E,) with its graph

    def record(self, layer: int, tokens, counts, probs, top_k: int) -> torch.Tensor:
        """Note ``counts`` (E,) and ``probs`` (N, E) of ``layer`` (each token routed to
        ``top_k`` experts); returns ``tokens``, carrying the balancing loss's gradient
        where it has one."""
        self.top_k = top_k
        first = layer not in self.counts
        if first:
            self.counts[layer] = counts.detach()
        if not self.aux_scale:
            return tokens
        if first:
            summed = counts if self.reduce_counts is None else self.reduce_counts(counts)
            self.global_counts[layer] = summed
        summed = self.global_counts[layer].to(probs.dtype)
        prob_sum = probs.sum(0)  # (E,)
        if self.formula == "hf-concatenated":
            self.prob_sums[layer] = prob_sum  # the loss is formed at the end of the model
            return tokens
        num_tokens = summed.sum() / top_k
        share = (summed * prob_sum).sum() * probs.shape[-1] / num_tokens**2
        if first:
            self.aux[layer] = share.detach()
        return AddAuxGradient.apply(tokens, share, self.aux_scale)

    def concatenated_share(self) -> torch.Tensor:
        """This rank's share of transformers' ``load_balancing_loss_func`` (every layer's
        tokens concatenated), from every layer's statistics: needs them all in one
        process, so pipeline parallelism cannot use it."""
        layers = sorted(self.prob_sums)
        summed = torch.stack([self.global_counts[i] for i in layers]).sum(0).float()
        prob_sum = torch.stack([self.prob_sums[i] for i in layers]).sum(0)  # (E,)
        rows = summed.sum() / self.top_k  # L * N
        return (summed * prob_sum).sum() * prob_sum.shape[-1] / rows**2


class AddAuxGradient(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward, adds ``scale`` as the gradient of ``aux``
    (the balancing loss's share), so its gradient reaches the router wherever the
    activations' gradient goes."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full(ctx.aux_shape, ctx.scale, dtype=torch.float32), None
