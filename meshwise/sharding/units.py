"""ZeRO-3 units: how a model is cut into them, and one unit's gathered parameters.

``cut_into_units`` assigns every trainable parameter to a unit (a group of
consecutive layers) or to the root unit (everything else: embeddings, final
norm, head). A ``Unit`` keeps its parameters' shard (a ``FlatParams`` at stage
3) and, only while gathered, a full buffer taken from a ``BufferPool``.

Modules see their parameters as views of that buffer, made by one autograd
function (``_UnitViews``) whose backward runs once the gradients of every view
are complete: it copies them into one flat gradient buffer, ready to be
reduce-scattered, without any flat parameter or ``AccumulateGrad`` of its own.
Because the gathered buffer is handed to another unit once this one is freed,
tensors autograd saves in forward must not hold on to it: ``Unit.pack`` and
``Unit.unpack`` (saved-tensor hooks, installed by the engine) store a view's
place in the buffer instead and rebuild it from the unit's buffer of the
moment, which the backward's pre-hook has gathered again.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from meshwise.sharding.adamw import decays
from meshwise.sharding.flat import FlatParams, ParamSlot

ROOT = "root"


class _UnitViews(torch.autograd.Function):
    """Forward: the unit's parameters as views of its buffer. Backward: the unit's
    gradient is complete; hand it over (nothing flows to ``anchor``)."""

    @staticmethod
    def forward(ctx, anchor, unit):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None
        return tuple(unit.plain_views())

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.gradient_ready(grads, ctx)
        return None, None


class Unit:
    """Sharded storage, gathered buffer and gradient hand-off of one ZeRO-3 unit."""

    def __init__(self, name: str, modules: list[nn.Module], params, group, precision,
                 device, values, pool, on_gradient):
        self.name, self.modules, self.pool = name, modules, pool
        self.on_gradient = on_gradient  # called with (unit, flat gradient buffer)
        slots, offset = [], 0
        for pname, p, _ in params:
            slots.append(ParamSlot(pname, p.shape, offset, p.numel(), decays(pname, p)))
            offset += p.numel()
        self.owners = [owners for _, _, owners in params]
        self.flat = FlatParams(slots, group, 3, precision, device, values)
        self.param_dtype = precision.param_dtype
        self.anchor = torch.zeros(0, device=device, requires_grad=True)
        self._empty = torch.empty(0, dtype=self.param_dtype, device=device)
        self.buffer: torch.Tensor | None = None  # the gathered parameters, while gathered
        self._pooled = False  # the buffer is the pool's (not the shard itself)
        self._gather = None  # the all-gather in flight
        self.has_grad = [False] * len(slots)  # per parameter, since zero_grad()
        self.needs_backward = False  # ran forward with autograd; backward not done yet
        self.in_backward = False  # between its pre-backward hook and its gradient
        self.hide_views()

    # -- gather / free -----------------------------------------------------------
    @property
    def is_gathered(self) -> bool:
        return self.buffer is not None

    def gathered_bytes(self) -> int:
        """Bytes held for the gathered parameters beyond the shard."""
        return self.buffer.numel() * self.buffer.element_size() if self._pooled else 0

    def start_gather(self) -> bool:
        """Take a buffer and launch the all-gather; False if already gathered. A shard
        that is the whole unit in the compute dtype (a group of one) is used as it is."""
        if self.buffer is not None:
            return False
        whole = self.flat.whole_params()
        self._pooled = whole is None
        if whole is not None:
            self.buffer = whole
            return True
        self.buffer = self.pool.acquire(self.flat.plan.padded_numel, self.param_dtype,
                                        self.flat.device)
        self._gather = self.flat.publish(self.buffer)
        return True

    def wait_gather(self) -> None:
        assert self.buffer is not None, f"unit {self.name}: wait_gather() before start_gather()"
        if self._gather is not None:
            self._gather.wait()
            self._gather = None

    def free(self) -> bool:
        """Give the buffer back to the pool; False if it was not gathered."""
        if self.buffer is None:
            return False
        self.wait_gather()  # never hand out memory a transfer is writing
        if self._pooled:
            self.pool.release(self.buffer)
        self.buffer, self._pooled = None, False
        self.hide_views()
        return True

    # -- views ---------------------------------------------------------------------
    def plain_views(self) -> list[torch.Tensor]:
        return [self.buffer[s.offset:s.offset + s.numel].view(s.shape) for s in self.flat.slots]

    def use_views(self) -> None:
        """Point module attributes at views of the gathered buffer; with autograd on,
        through ``_UnitViews`` so the unit's gradient is collected in one place."""
        if torch.is_grad_enabled():
            views = _UnitViews.apply(self.anchor, self)
        else:
            views = self.plain_views()
        for view, owners in zip(views, self.owners):
            for module, attr in owners:
                setattr(module, attr, view)

    def hide_views(self) -> None:
        """Empty tensors stand in while freed: a stray use fails on shape, not on freed memory."""
        for owners in self.owners:
            for module, attr in owners:
                setattr(module, attr, self._empty)

    # -- gradients -----------------------------------------------------------------
    @torch.no_grad()
    def gradient_ready(self, grads, ctx=None) -> None:
        """Every view's gradient is complete: one flat buffer in the reduction dtype.

        The unit's backward is over, so its gathered parameters are not needed any
        more: when the dtypes agree their buffer takes the gradient (one buffer less
        at the peak); the engine frees the unit without giving it back to the pool.
        """
        flat = self.flat
        if self._pooled and self.buffer.dtype == flat.precision.reduce_dtype:
            self.wait_gather()
            full, self.buffer, self._pooled = self.buffer, None, False
            self.hide_views()
        else:
            full = self.pool.acquire(flat.plan.padded_numel, flat.precision.reduce_dtype,
                                     flat.device)
        for i, (slot, grad) in enumerate(zip(flat.slots, grads)):
            part = full[slot.offset:slot.offset + slot.numel]
            if grad is None:
                part.zero_()
            else:
                part.copy_(grad.reshape(-1))
                self.has_grad[i] = True
        full[flat.numel:].zero_()  # padding
        self.on_gradient(self, full)


def cut_into_units(model: nn.Module, units: list[nn.Module] | None,
                   cap_bytes: float | None = None, alone=()):
    """Cut ``model``'s trainable parameters into units.

    ``units``: the layers (default ``model.blocks``); consecutive layers are merged
    into one unit while it stays within ``cap_bytes`` (``None``: a unit per
    layer), except the modules in ``alone``, which always make a unit of their own
    (a tied embedding whose shards must line up with its partner's on another
    stage). Returns ``[(name, modules, params), ...]`` for units holding
    parameters and the root's ``params``; ``params`` are ``(name, param,
    [(module, attr), ...])`` in ``named_parameters`` order. The parameters are
    unregistered from their modules: the units own them.
    """
    layers = _resolve_layers(model, units)
    groups = _assign_params(model, [m for _, m in layers])
    merged: list[list] = []
    for (name, module), params in zip(layers, groups):
        if not params:
            continue  # a parameter-free layer needs no gathering
        size = sum(p.numel() * p.element_size() for _, p, _ in params)
        last = merged[-1] if merged else None
        mergeable = last and module not in alone and last[1][-1] not in alone
        if mergeable and cap_bytes and last[3] + size <= cap_bytes:
            last[0], last[1], last[2], last[3] = (f"{last[0]}+{name}", last[1] + [module],
                                                  last[2] + params, last[3] + size)
        else:
            merged.append([name, [module], params, size])
    return [(name, modules, params) for name, modules, params, _ in merged], groups[-1]


def _resolve_layers(model: nn.Module, units) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each layer, checked to be disjoint submodules."""
    names = {id(m): n for n, m in model.named_modules()}
    if units is None:
        blocks = getattr(model, "blocks", None)
        if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)) and len(blocks) > 0:
            units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
        else:
            warnings.warn(f"{type(model).__name__} has no `blocks`: ZeRO-3 treats the whole "
                          "model as one unit, so every parameter is gathered at once; pass "
                          "`units` to shard the peak", stacklevel=4)
            return []
    resolved = []
    for module in units:
        if id(module) not in names:
            raise ValueError(f"unit {type(module).__name__} is not a submodule of the model")
        resolved.append((names[id(module)] or "model", module))
    inside = [id(sub) for _, m in resolved for sub in m.modules()]
    if len(inside) != len(set(inside)):
        raise ValueError("units must be disjoint: one unit is inside another or listed twice")
    return resolved


def _assign_params(model: nn.Module, unit_modules: list[nn.Module]) -> list[list]:
    """Per unit (then the root last): ``(name, param, [(module, attr), ...])``.

    A tied parameter lists every (module, attribute) holding it and must stay
    within one unit.
    """
    owner_unit = {id(sub): i for i, m in enumerate(unit_modules) for sub in m.modules()}
    root = len(unit_modules)
    slots: dict[int, list] = {}
    units_of: dict[int, set] = {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is None or not p.requires_grad:
                continue  # frozen parameters stay ordinary, unsharded parameters
            slots.setdefault(id(p), []).append((module, attr))
            units_of.setdefault(id(p), set()).add(owner_unit.get(id(module), root))
    groups: list[list] = [[] for _ in range(root + 1)]
    for name, p in model.named_parameters():
        if id(p) not in slots:
            continue
        if len(units_of[id(p)]) > 1:
            raise ValueError(f"parameter {name!r} is shared by several units; "
                             "tied parameters must live in one unit")
        groups[next(iter(units_of[id(p)]))].append((name, p, slots[id(p)]))
    # Only once everything is validated: the units' flat buffers now own them.
    for owners in slots.values():
        for module, attr in owners:
            del module._parameters[attr]
    return groups


def grad_tensors(output) -> list[torch.Tensor]:
    """Tensors in a (nested) forward output that autograd will send gradients to."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in grad_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in grad_tensors(item)]
    return []
