"""ZeRO-3 under a pipeline: sharded units while many micro-batches are in flight.

A pipeline stage runs forwards of several micro-batches before their backwards
(1F1B keeps up to S in flight, ZB-V and DualPipeV hold two chunks), so plain
ZeRO-3's rhythm of one forward then one backward (``meshwise.sharding.zero3``)
does not hold. torchtitan combines pipeline parallelism with FSDP by gathering
a stage's parameters once per step for all its micro-batches and reducing its
gradients once after the last; this engine does the same by default:

- step-resident (default): a unit is gathered at its first use in the step and
  kept until its last gradient of the step; every micro-batch's gradient is
  added into an unsharded buffer of the unit, reduce-scattered once, when the
  unit's last gradient arrives (outside ``no_sync()``): one all-gather and one
  reduce-scatter per unit and step, while the step holds the stage's
  parameters and gradients in full;
- ``reshard_after_forward``: a unit is gathered for each forward and again for
  each backward and freed after each, and each micro-batch's gradient is
  reduce-scattered into the fp32 shard at once: the step holds about two units
  and their gradient, for 2M all-gathers and M reduce-scatters per unit.

With a split backward (``meshwise.tensor_parallel.weight_grads``) a unit's
gradient of one micro-batch comes in two calls of the same autograd node (one
node per forward of the unit): B brings the norms' and biases', W the linear
weights'. The node keeps B's part until W brings the rest, so the unit sees one
gradient per micro-batch. Units are the modules the caller lists for each chunk
(layers; a stage's end modules, a tied embedding alone so that its shards line
up with its partner's); parameters outside them form one root unit per chunk,
gathered for the whole step.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks

from meshwise.comm import ops, policy
from meshwise.device import ranges
from meshwise.sharding.adamw import AdamWConfig
from meshwise.sharding.binding import BufferPool, device_of, tie_groups, values_of
from meshwise.sharding.engine import EngineBase
from meshwise.sharding.flat import Precision
from meshwise.sharding.units import Unit, cut_into_units, grad_tensors
from meshwise.tensor_parallel.weight_grads import defers_weight_grad


class _StepUnit(Unit):
    """A unit whose gradient of a micro-batch may arrive in two parts (B, then W)."""

    def __init__(self, *args, on_backward_done, partials: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_backward_done, self.partials = on_backward_done, partials

    @torch.no_grad()
    def gradient_ready(self, grads, ctx=None) -> None:
        self.on_backward_done(self)
        grads = list(grads)
        deferred = [any(defers_weight_grad(m, a) for m, a in owners) for owners in self.owners]
        if ctx is not None and getattr(ctx, "partial", None) is not None:
            grads = [g if p is None else (p if g is None else p + g)
                     for g, p in zip(grads, ctx.partial)]
            ctx.partial = None
            self.partials.pop(id(ctx), None)
        if any(d and g is None for d, g in zip(deferred, grads)) and ctx is not None:
            ctx.partial = grads  # B's part: the deferred weights come through here in W
            self.partials[id(ctx)] = (self, ctx)
            return
        self.on_gradient(self, grads)


class PipelineZeroStage3(EngineBase):
    """ZeRO-3 over a rank's pipeline ``chunks`` with a sharded AdamW.

    ``units``: per chunk, the modules to gather as units (consecutive ones merged
    up to ``unit_cap_mb``, except those in ``alone``); ``reshard_after_forward``:
    see the module docstring. ``values``/``precision``/``device``/``grad_reducer``:
    as for ``ZeroOptimizer``.
    """

    def __init__(self, chunks: list[nn.Module], dp_group, adamw: AdamWConfig,
                 units: list[list[nn.Module]], *, reshard_after_forward: bool = False,
                 alone=(), precision: Precision | None = None, values=None, device=None,
                 unit_cap_mb: float | None = None, grad_reducer=None):
        super().__init__(dp_group, 3, adamw, precision or Precision(), grad_reducer)
        named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
        device = device or device_of(p for _, p in named)
        values = values or values_of(named)
        self.reshard = reshard_after_forward
        self.max_inflight = policy.overlapped_reductions(dp_group)
        # Buffers of the request's size: units of very different sizes (an embedding,
        # a layer) are all held at once here, not one after the other.
        self.pool, self._partials = BufferPool(exact=True), {}
        cap = unit_cap_mb * 2**20 if unit_cap_mb else None
        make = partial(_StepUnit, group=dp_group, precision=self.precision, device=device,
                       values=values, pool=self.pool, on_gradient=self._on_gradient,
                       on_backward_done=self._backward_done, partials=self._partials)
        self.chunk_units: list[list[_StepUnit]] = []
        self.roots: list[_StepUnit | None] = []
        for c, chunk in enumerate(chunks):
            unit_params, root_params = cut_into_units(chunk, units[c], cap, alone)
            blocks = [make(name, modules, params) for name, modules, params in unit_params]
            root = make(f"root{c}", [chunk], root_params) if root_params else None
            self._register(chunk, root, blocks)
            self.chunk_units.append(blocks)
            self.roots.append(root)
        self.units = [u for c, blocks in enumerate(self.chunk_units)
                      for u in ([self.roots[c]] if self.roots[c] else []) + blocks]
        self.flats = [unit.flat for unit in self.units]
        self._accumulated: dict[_StepUnit, torch.Tensor] = {}  # unsharded gradients (step-resident)
        self._pending: deque = deque()
        self._by_storage: dict[int, _StepUnit] = {}
        self._sync_enabled = True
        self._peak_window, self._last_step_peak = 0, None
        self._ties = [(named[i][0], group) for i, group in tie_groups(named)]
        for name, _ in self._ties:
            if not any([s.name for s in u.flat.slots] == [name] for u in self.units):
                raise ValueError(f"{name} is tied across pipeline stages and needs a unit of "
                                 "its own, so that its dp shard lines up with its partner's; "
                                 "pass its module in alone=")
        self._connect_reducer()

    def _register(self, chunk: nn.Module, root, blocks: list[_StepUnit]) -> None:
        for i, unit in enumerate(blocks):
            following = blocks[i + 1] if i + 1 < len(blocks) else None
            previous = blocks[i - 1] if i > 0 else None
            for j, module in enumerate(unit.modules):
                module.register_forward_pre_hook(
                    partial(self._pre_forward, unit, j == 0, following))
            unit.modules[-1].register_forward_hook(partial(self._post_forward, unit, previous))
        chunk.register_forward_pre_hook(partial(self._chunk_pre_forward, root), prepend=True)
        chunk.register_forward_hook(self._chunk_post_forward, always_call=True)

    # -- gathering --------------------------------------------------------------
    def _start_gather(self, unit: _StepUnit | None) -> None:
        if unit is not None and unit.start_gather():
            self._by_storage[unit.buffer.untyped_storage().data_ptr()] = unit
            live = sum(u.gathered_bytes() for u in self.units)
            self._peak_window = max(self._peak_window, live)

    def _ensure_gathered(self, unit: _StepUnit) -> None:
        self._start_gather(unit)
        with ranges.named(f"zero3/gather {unit.name}"):
            unit.wait_gather()

    def _free(self, unit: _StepUnit) -> None:
        storage = unit.buffer.untyped_storage().data_ptr() if unit.is_gathered else None
        if unit.free():
            del self._by_storage[storage]

    def _pack(self, tensor: torch.Tensor):
        if tensor.layout == torch.strided:
            unit = self._by_storage.get(tensor.untyped_storage().data_ptr())
            if unit is not None:
                return unit, tensor.size(), tensor.stride(), tensor.storage_offset()
        return tensor

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        unit, size, stride, offset = packed
        assert unit.is_gathered, f"unit {unit.name}: a saved view was needed while it is freed"
        unit.wait_gather()
        return unit.buffer.as_strided(size, stride, offset)

    # -- hooks ------------------------------------------------------------------
    def _chunk_pre_forward(self, root, module, args) -> None:
        if root is not None:
            self._ensure_gathered(root)
            root.use_views()
        if self.reshard:  # saved views of freed units are rebuilt when regathered
            module._zero3_saved = saved_tensors_hooks(self._pack, self._unpack)
            module._zero3_saved.__enter__()

    def _chunk_post_forward(self, module, args, output) -> None:
        saved = getattr(module, "_zero3_saved", None)
        if saved is not None:
            saved.__exit__(None, None, None)
            module._zero3_saved = None

    def _pre_forward(self, unit, first: bool, following, module, args) -> None:
        self._ensure_gathered(unit)
        if unit.in_backward:  # activation checkpointing recomputes inside backward
            unit.use_views()
            return
        if first:
            self._start_gather(following)  # prefetch the next unit of this chunk
            unit.use_views()
            inputs = grad_tensors(args)
            if self.reshard and inputs:
                # The gradient of the unit's input ends its backward, also when every
                # parameter of the unit waits for a W (no gradient reaches its views in B).
                register_multi_grad_hook(inputs, lambda grads: self._backward_done(unit))

    def _post_forward(self, unit, previous, module, args, output) -> None:
        if unit.in_backward or not self.reshard:
            return  # a recompute, or the unit stays for the step
        tensors = grad_tensors(output)
        if tensors:
            register_multi_grad_hook(tensors, partial(self._pre_backward, unit, previous),
                                     mode="any")
        self._free(unit)

    def _pre_backward(self, unit, previous, grad) -> None:
        self._ensure_gathered(unit)
        unit.in_backward = True
        self._start_gather(previous)  # its backward comes next in this chunk

    def _backward_done(self, unit: _StepUnit) -> None:
        if self.reshard and unit.in_backward:
            unit.in_backward = False
            self._free(unit)

    # -- gradients --------------------------------------------------------------
    @torch.no_grad()
    def _on_gradient(self, unit: _StepUnit, grads) -> None:
        full = self._accumulated.get(unit)
        fresh = full is None
        if fresh:
            full = self.pool.acquire(unit.flat.plan.padded_numel,
                                     unit.flat.precision.reduce_dtype, unit.flat.device)
        for i, (slot, grad) in enumerate(zip(unit.flat.slots, grads)):
            part = full[slot.offset:slot.offset + slot.numel]
            if grad is None:
                if fresh:
                    part.zero_()
                continue
            if fresh:
                part.copy_(grad.reshape(-1))
            else:
                part.add_(grad.reshape(-1))
            unit.has_grad[i] = True
        if fresh:
            full[unit.flat.numel:].zero_()  # padding
        if self.reshard or self._sync_enabled:
            self._accumulated.pop(unit, None)
            self._reduce(unit, full)
            if not self.reshard:
                self._free(unit)  # its last gradient of the step: the parameters can go
        else:
            self._accumulated[unit] = full

    def _reduce(self, unit: _StepUnit, full: torch.Tensor) -> None:
        self._pending.append(unit.flat.start_reduce(full, self.grad_reducer,
                                                    key=self.units.index(unit),
                                                    on_done=self.pool.release))
        while len(self._pending) > self.max_inflight:
            self._pending.popleft().finish()

    # -- the engine protocol ----------------------------------------------------
    @contextmanager
    def no_sync(self):
        """Gradients accumulate (step-resident: unsharded; resharding: in the shard)
        without completing a unit's reduction."""
        assert self._sync_enabled, "no_sync() is not re-entrant"
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def _idle(self) -> bool:
        return not self._pending and not self._accumulated and not self._partials

    def _before_update(self) -> None:
        self._complete()  # a tie's sum belongs to finish_grad_sync, once

    def finish_grad_sync(self) -> None:
        """Complete the step's reductions, then sum each cross-stage tie's shard over its
        group (both copies take the same step)."""
        self._complete()
        for name, group in self._ties:
            ops.all_reduce(self.tie_grad(name), group, category="grad")

    def _complete(self) -> None:
        """Complete what is left (a deferred weight unused in a forward, units whose last
        gradient came under no_sync), wait for every reduction, free the units."""
        for unit, ctx in list(self._partials.values()):
            self._partials.pop(id(ctx))
            grads, ctx.partial = ctx.partial, None
            self._on_gradient(unit, grads)
        for unit in list(self._accumulated):
            self._reduce(unit, self._accumulated.pop(unit))
        while self._pending:
            self._pending.popleft().finish()
        self._free_all()

    def _free_all(self) -> None:
        for unit in self.units:
            unit.in_backward = False
            self._free(unit)

    def _publish(self) -> None:
        # The shards changed: nothing gathered may outlive the step. A step ends.
        self._free_all()
        self._last_step_peak = self._peak_window
        self._peak_window = 0

    def load_done(self) -> None:
        self._free_all()

    def zero_grad(self) -> None:
        self._complete()
        for unit in self.units:
            unit.flat.grad_shard.zero_()
            unit.has_grad = [False] * len(unit.has_grad)

    def _gradient_flags(self) -> tuple[list[str], list[bool]]:
        return ([slot.name for u in self.units for slot in u.flat.slots],
                [flag for u in self.units for flag in u.has_grad])

    def tie_grad(self, name: str) -> torch.Tensor:
        """The reduced gradient shard of parameter ``name``, which has a unit of its own."""
        unit = next(u for u in self.units if [s.name for s in u.flat.slots] == [name])
        return unit.flat.grad_shard

    @property
    def peak_gathered_bytes(self) -> int:
        """Most bytes of gathered parameters alive at once during the last step."""
        return self._peak_window if self._last_step_peak is None else self._last_step_peak
