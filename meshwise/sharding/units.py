"""One ZeRO-3 unit's parameters: sharded at rest, gathered for use.

A ``Unit`` (consecutive layers, or a root of the rest: ``binding.cut_into_units``)
keeps its parameters' shard (a stage-3 ``FlatParams``) and, while gathered, a
full buffer from a ``BufferPool``, which modules see through views made by one
autograd function (``_UnitViews``): its backward hands the views' gradients to
the engine in one call, with no flat parameter or ``AccumulateGrad``. A freed
buffer goes to another unit, so ``saved_views`` keeps a saved view as its place
in the buffer, rebuilt from the unit's buffer once gathered again.

A unit's frozen parameters (``requires_grad=False``: LoRA's base weights) are
sharded and gathered with it, in the same buffer after the trained ones (one
all-reduce for both where a gather is one), as FSDP2 shards them; they get plain
views, so no gradient, reduction or optimizer state exists for them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from meshwise.comm import ops, policy
from meshwise.device import ranges
from meshwise.sharding.adamw import decays
from meshwise.sharding.flat import FlatParams, ParamSlot
from meshwise.tensor_parallel.weight_grads import defers_weight_grad

ROOT = "root"


class _UnitViews(torch.autograd.Function):
    """Forward: the unit's parameters as views of its buffer. Backward: the views'
    gradients of that forward are in; hand them over (nothing flows to ``anchor``)."""

    @staticmethod
    def forward(ctx, anchor, unit):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None
        return tuple(unit.plain_views())

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.on_gradient(ctx.unit, grads, ctx)
        return None, None


class Gathered(dict):
    """An engine's gathered units by buffer storage, what its units did (``events``) and
    the most bytes gathered at once (``peak``)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self.peak = 0


class Unit:
    """Sharded storage, gathered buffer and gradient hand-off of one ZeRO-3 unit."""

    def __init__(
        self,
        name: str,
        modules: list[nn.Module],
        params,
        group,
        precision,
        device,
        values,
        pool,
        gathered: Gathered,
        on_gradient,
        frozen=(),
    ):
        self.name, self.modules, self.pool, self.gathered = name, modules, pool, gathered
        self.on_gradient = on_gradient  # called with (unit, grads per parameter, ctx)
        self.owners = [owners for _, _, owners in params]
        self.flat = FlatParams(_slots(params), group, 3, precision, device, values)
        self.frozen_owners = [owners for _, _, owners in frozen]
        self.frozen = (
            FlatParams(_slots(frozen), group, 3, precision, device, values, frozen=True)
            if frozen
            else None
        )
        self.param_dtype = precision.param_dtype
        self.anchor = torch.zeros(0, device=device, requires_grad=True)
        self._empty = torch.empty(0, dtype=self.param_dtype, device=device)
        self.buffer: torch.Tensor | None = None  # the gathered parameters, while gathered
        self._pooled = False  # the buffer is the pool's (not the shard itself)
        self._gather: list = []  # the all-gathers in flight
        self.has_grad = [False] * len(self.flat.slots)  # per parameter, since zero_grad()
        self.pending = 0  # forwards run with autograd whose backward has not ended
        self.in_backward = False  # between its pre-backward hook and the end of that backward
        self.hide_views()

    # -- gather / free -----------------------------------------------------------
    @property
    def is_gathered(self) -> bool:
        return self.buffer is not None

    def gathered_bytes(self) -> int:
        """Bytes held for the gathered parameters beyond the shard."""
        buf = self.buffer
        return buf.numel() * buf.element_size() if self._pooled and buf is not None else 0

    def start_gather(self) -> bool:
        """Take a buffer and launch the all-gather; False if already gathered. A shard
        that is the whole unit in the compute dtype (a group of one) is used as it is."""
        if self.buffer is not None:
            return False
        whole = self.flat.whole_params() if self.frozen is None else None
        self._pooled = whole is None
        if whole is not None:
            self.buffer = whole
        else:
            trained = self.flat.plan.padded_numel
            size = trained + (self.frozen.plan.padded_numel if self.frozen else 0)
            self.buffer = self.pool.acquire(size, self.param_dtype, self.flat.device)
            self._gather = self._publish(self.buffer, trained)
        self.gathered[self.buffer.untyped_storage().data_ptr()] = self
        self.gathered.events.append(("gather_start", self.name))
        live = sum(u.gathered_bytes() for u in self.gathered.values())
        self.gathered.peak = max(self.gathered.peak, live)
        return True

    def _publish(self, buffer: torch.Tensor, trained: int) -> list:
        """Launch the gathers of the trained parameters into ``buffer[:trained]`` and of
        the frozen ones after them. Where a gather is an all-reduce (gloo), both are one
        all-reduce of the buffer: LoRA's adapters, about 1% of a unit's bytes, would
        otherwise pay a collective's latency of their own (a small all-reduce: 0.6-2.5 ms
        on 2 cores) at each of the unit's two gathers a step."""
        parts = [(self.flat, buffer[:trained])]
        if self.frozen is not None:
            parts.append((self.frozen, buffer[trained:]))
        parts = [(flat, part) for flat, part in parts if flat.numel]
        group = self.flat.group
        if len(parts) > 1 and group.size > 1 and policy.all_gather_by_all_reduce(group):
            for flat, part in parts:
                flat.own_shard_only(part)
            return [ops.all_reduce(buffer, group, category="param", async_op=True)]
        handles = [flat.publish(part) for flat, part in parts]
        return [h for h in handles if h is not None]

    def ensure_gathered(self) -> None:
        self.start_gather()
        with ranges.named(f"zero3/gather {self.name}"):
            self.wait_gather()

    def wait_gather(self) -> None:
        assert self.buffer is not None, f"unit {self.name}: wait_gather() before start_gather()"
        for handle in self._gather:
            handle.wait()
        self._gather = []

    def free(self, take: bool = False) -> torch.Tensor | None:
        """Give the buffer (if any) back to the pool, or with ``take`` return it."""
        if self.buffer is None:
            return None
        self.wait_gather()  # never hand out memory a transfer is writing
        del self.gathered[self.buffer.untyped_storage().data_ptr()]
        self.gathered.events.append(("free", self.name))
        buffer, pooled = self.buffer, self._pooled
        self.buffer, self._pooled = None, False
        self.hide_views()
        if take:  # the trained parameters' part: the frozen ones get no gradient
            return buffer[: self.flat.plan.padded_numel]
        if pooled:
            self.pool.release(buffer)
        return None

    def can_hold_gradient(self) -> bool:
        """Whether the gathered buffer may take the unit's gradient once its backward is
        over (the pool's, in the reduction dtype): one buffer less at the peak."""
        return (
            self._pooled
            and self.buffer is not None
            and self.buffer.dtype == self.flat.precision.reduce_dtype
        )

    # -- views ---------------------------------------------------------------------
    def plain_views(self, frozen: bool = False) -> list[torch.Tensor]:
        """Views of the trained parameters in the gathered buffer (``frozen``: of the
        frozen ones, which follow them)."""
        buf = self.buffer
        assert buf is not None, f"unit {self.name}: its views were asked for while freed"
        flat, start = (self.frozen, self.flat.plan.padded_numel) if frozen else (self.flat, 0)
        slots = flat.slots if flat is not None else []
        return [buf[start + s.offset : start + s.offset + s.numel].view(s.shape) for s in slots]

    def use_views(self) -> None:
        """Point module attributes at views of the gathered buffer; with autograd on, the
        trained ones through ``_UnitViews`` so their gradient is collected in one place."""
        if torch.is_grad_enabled() and self.flat.slots:
            views = _UnitViews.apply(self.anchor, self)
        else:
            views = self.plain_views()
        pairs = zip([*views, *self.plain_views(frozen=True)], self.owners + self.frozen_owners)
        for view, owners in pairs:
            for module, attr in owners:
                setattr(module, attr, view)

    def hide_views(self) -> None:
        """Empty tensors stand in while freed: a stray use fails on shape, not on freed memory."""
        for owners in self.owners + self.frozen_owners:
            for module, attr in owners:
                setattr(module, attr, self._empty)

    # -- gradients -----------------------------------------------------------------
    def merge_parts(self, grads, ctx, waiting: dict) -> list | None:
        """The views' gradients of one forward, or None while W's part is to come: under
        a split backward (``meshwise.tensor_parallel.weight_grads``) B brings the norms'
        and biases', W the deferred linear weights'; B's part waits on ``ctx`` (and in
        ``waiting``) for the rest."""
        grads = list(grads)
        if getattr(ctx, "partial", None) is not None:
            grads = [
                g if p is None else (p if g is None else p + g) for g, p in zip(grads, ctx.partial)
            ]
            ctx.partial = None
            waiting.pop(id(ctx), None)
        deferred = [any(defers_weight_grad(m, a) for m, a in owners) for owners in self.owners]
        if ctx is not None and any(d and g is None for d, g in zip(deferred, grads)):
            ctx.partial = grads
            waiting[id(ctx)] = (self, ctx)
            return None
        return grads

    @torch.no_grad()
    def add_gradient(
        self, grads, full: torch.Tensor | None = None, buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``grads`` (per parameter; None: none) added into the flat gradient ``full``,
        or written into a new one (``buffer``, else the pool's), zero where none came."""
        flat = self.flat
        fresh = full is None
        if full is None:
            full = (
                buffer
                if buffer is not None
                else self.pool.acquire(
                    flat.plan.padded_numel, flat.precision.reduce_dtype, flat.device
                )
            )
            full[flat.numel :].zero_()  # padding
        for i, (slot, grad) in enumerate(zip(flat.slots, grads)):
            part = full[slot.offset : slot.offset + slot.numel]
            if grad is not None:
                (part.copy_ if fresh else part.add_)(grad.reshape(-1))
                self.has_grad[i] = True
            elif fresh:
                part.zero_()
        return full


def _slots(params) -> list[ParamSlot]:
    """``(name, param, owners)`` back to back in a flat buffer."""
    slots, offset = [], 0
    for name, p, _ in params:
        slots.append(ParamSlot(name, p.shape, offset, p.numel(), decays(name, p)))
        offset += p.numel()
    return slots


def saved_views(gathered: Gathered) -> saved_tensors_hooks:
    """Saved-tensor hooks that keep a view of a gathered buffer as its place in its
    unit, rebuilt from the unit's buffer when used."""

    def pack(tensor: torch.Tensor):
        unit = (
            gathered.get(tensor.untyped_storage().data_ptr())
            if tensor.layout == torch.strided
            else None
        )
        return (
            tensor
            if unit is None
            else (unit, tensor.size(), tensor.stride(), tensor.storage_offset())
        )

    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        unit, size, stride, offset = packed
        assert unit.is_gathered, f"unit {unit.name}: a saved view was needed while it is freed"
        unit.wait_gather()
        return unit.buffer.as_strided(size, stride, offset)

    return saved_tensors_hooks(pack, unpack)


def check_same_units(units: list[Unit], ran: list[Unit], group) -> None:
    """Every dp rank must have run the same ``units`` in a forward, or their collectives
    pair up wrongly (wrong gradients or a hang): one small all-reduce, read on the host
    (so, once); a later change shows in the collective ledger, with rank and call site."""
    used = torch.tensor([float(u in ran) for u in units], device=units[0].flat.device)
    bounds = torch.stack([used, -used])  # max of both: (max, -min) over ranks
    ops.all_reduce(bounds, group, op="max", category="check")
    differ = [u.name for u, hi, neg_lo in zip(units, bounds[0], bounds[1]) if hi != -neg_lo]
    if differ:
        raise RuntimeError(
            f"ZeRO-3 units {', '.join(differ)} ran on some dp ranks but not on "
            "others in this forward; every dp rank must run the same units "
            "(use ZeRO 0-2, whose buckets allow it)"
        )


def grad_tensors(output) -> list[torch.Tensor]:
    """Tensors in a (nested) forward output that autograd will send gradients to."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in grad_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in grad_tensors(item)]
    return []
