"""A split backward: linear layers' weight gradients (W) computed after their input
gradients (B), as zero-bubble schedules need (Qi et al. 2024). Split per layer as
DeepSeek's DualPipe ``WeightGradStore`` does, not by cutting the autograd graph, which
recomputes checkpointed blocks again (pytorch#136766). See docs/pipelines.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from meshwise.comm.checks import strict


class WeightGradStore:
    """Weight-gradient work of linear layers, held from a backward (B) until its W runs
    (other parameters, cheap ones, get their gradients in B as usual).
    """

    def __init__(self):
        self.key: Hashable | None = None  # the micro-batch being captured, if any
        self._jobs: dict[Hashable, list] = defaultdict(list)

    @contextlib.contextmanager
    def capturing(self, key: Hashable):
        """Layers given this store defer their weight gradients under ``key`` (enter it
        around the forward and around the backward, so a recompute defers alike)."""
        previous, self.key = self.key, key
        try:
            yield
        finally:
            self.key = previous

    def put(
        self, key: Hashable, weight: GradientEdge, inputs: torch.Tensor, grad_output: torch.Tensor
    ) -> None:
        self._jobs[key].append((weight, inputs, grad_output))

    def pending(self, key: Hashable) -> bool:
        return key in self._jobs

    @torch.no_grad()
    def _weight_grads(self, key: Hashable) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        weights: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        where: dict[tuple[int, int], int] = {}  # a gradient edge -> its place in the lists
        for weight, inputs, grad_output in self._jobs.pop(key, []):
            # dW = dY^T X over every row of the micro-batch: (out, rows) @ (rows, in)
            grad = grad_output.reshape(-1, grad_output.shape[-1]).t() @ inputs.reshape(
                -1, inputs.shape[-1]
            )
            edge = (id(weight.node), weight.output_nr)
            if edge in where:  # a weight used twice in one micro-batch
                grads[where[edge]] += grad
            else:
                where[edge] = len(weights)
                weights.append(weight)
                grads.append(grad)
        return weights, grads

    def run(self, key: Hashable) -> None:
        """The W pass of ``key``: its weight gradients, delivered as autograd would.

        They enter the graph at the weights' gradient edges, taken in the forward:
        a weight that is a view of a buffer rewritten since (a ZeRO-3 unit freed
        after B and gathered again) cannot be a root of a backward itself."""
        weights, grads = self._weight_grads(key)
        if weights:
            strict.backward(weights, grads)


class _LinearWeightLater(torch.autograd.Function):
    """``F.linear`` whose backward gives dX and the bias gradient now and stores the
    weight's share for a W pass (the weight itself is not an input of this node)."""

    @staticmethod
    def forward(ctx, inputs, weight_data, bias, store, key, weight_edge):
        ctx.save_for_backward(inputs, weight_data)
        ctx.store, ctx.key, ctx.weight_edge = store, key, weight_edge
        return F.linear(inputs, weight_data, bias)

    @staticmethod
    def backward(ctx, grad_output):
        inputs, weight_data = ctx.saved_tensors
        grad_inputs = grad_output @ weight_data if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        ctx.store.put(ctx.key, ctx.weight_edge, inputs, grad_output)
        return grad_inputs, None, grad_bias, None, None, None


def linear(
    inputs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_grads: WeightGradStore | None = None,
) -> torch.Tensor:
    """``F.linear``, deferring the weight gradient to ``weight_grads`` while it captures."""
    if (
        weight_grads is None
        or weight_grads.key is None
        or not (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return F.linear(inputs, weight, bias)
    return _LinearWeightLater.apply(
        inputs, weight.detach(), bias, weight_grads, weight_grads.key, get_gradient_edge(weight)
    )


class _DefersWeightGrad:
    """Put in front of ``nn.Linear``'s class: its forward goes through :func:`linear`."""

    # Declared only: the linear class it is put in front of, and defer_weight_grads, set them.
    weight: torch.Tensor
    bias: torch.Tensor | None
    weight_grads: WeightGradStore | None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return linear(inputs, self.weight, self.bias, self.weight_grads)


@functools.cache
def _deferring_class(cls: type) -> type:
    return type(f"WeightLater{cls.__name__}", (_DefersWeightGrad, cls), {})


def defer_weight_grads(modules, store: WeightGradStore) -> int:
    """Give every linear layer inside ``modules`` the ``store``; returns how many.

    ``nn.Linear`` gets a subclass whose forward defers (the same object, as activation
    checkpointing swaps classes: names, hooks and plans unchanged); a subclass of
    ``nn.Linear`` with its own forward is left alone (its weights' gradients come in B).
    """
    count = 0
    for root in modules:
        for module in root.modules():
            if type(module) is nn.Linear:
                module.__class__ = _deferring_class(nn.Linear)
            if isinstance(module, _DefersWeightGrad) or hasattr(type(module), "weight_grads"):
                module.weight_grads = store
                count += 1
    return count


def defers_weight_grad(module: nn.Module, attr: str) -> bool:
    """Whether ``module.attr`` gets its gradient in a W pass when a split backward runs
    (not a sequence-parallel layer's: it gathers its input in an autograd function of
    its own, and its weight gradient comes in B)."""
    return (
        attr == "weight"
        and getattr(module, "weight_grads", None) is not None
        and getattr(module, "sequence", None) is None
    )
