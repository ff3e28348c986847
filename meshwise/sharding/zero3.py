"""ZeRO stage 3 (fully sharded data parallel): parameters sharded at rest.

The model is cut into units (``meshwise.sharding.units``): groups of
consecutive layers, plus a root unit holding every other parameter. Around each
unit's forward and backward (ZeRO, Rajbhandari et al. 2020, section 5.3; FSDP,
Zhao et al. 2023):

- forward: all-gather the unit (unless prefetched) into a pooled buffer, run
  it, give the buffer back; with ``prefetch`` the next unit's all-gather is
  launched before this one computes;
- backward: a hook on the unit's outputs fires just before its backward:
  gather again and prefetch the unit that ran before it; when the unit's
  gradient is complete it is reduce-scattered into this rank's fp32 shard and
  both buffers go back to the pool.

The root unit's parameters are used at both ends of the forward (embedding
first, head last), so, as FSDP2 does for its root module, it is gathered when
the model's forward starts and kept until its own gradient is complete. Peak
gathered memory is about the root plus two units (the running and the
prefetched one); the pool holds about that, reused across units and steps.

Collectives are issued from hooks that fire in the same order on every rank
(the same model and graph), which keeps them matched; a forward that ran
different units on different ranks is caught before its backward.

Activation checkpointing works: a recompute inside backward finds its unit
gathered and neither frees nor prefetches anything.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.utils._python_dispatch import _disable_current_modes

from meshwise.comm import ops, policy
from meshwise.device import ranges
from meshwise.sharding.adamw import AdamWConfig
from meshwise.sharding.binding import BufferPool, device_of, tie_groups, values_of
from meshwise.sharding.engine import EngineBase
from meshwise.sharding.flat import Precision
from meshwise.sharding.units import ROOT, Unit, cut_into_units, grad_tensors


class ZeroStage3(EngineBase):
    """Fully sharded data parallel around ``model`` with a sharded AdamW.

    ``units``: the layers (default ``model.blocks``); parameters outside them form
    the root unit; with ``unit_cap_mb`` consecutive layers are gathered together
    up to that size. ``prefetch`` launches the next unit's all-gather ahead of
    its use. ``values``/``precision``/``device``/``grad_reducer``: as for
    ``ZeroOptimizer``.
    ``events`` lists what the latest forward/backward did, as ``(kind, unit)``
    with kind in ``gather_start``, ``forward``, ``free``, ``backward``,
    ``reduce_scatter``.
    """

    def __init__(self, model: nn.Module, dp_group, adamw: AdamWConfig,
                 units: list[nn.Module] | None = None, prefetch: bool = True, *,
                 precision: Precision | None = None, values=None, device=None,
                 unit_cap_mb: float | None = None, max_inflight_reductions: int | None = None,
                 grad_reducer=None):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        tied = tie_groups(named)
        if tied:
            raise ValueError(f"ZeRO-3 shards parameters, but {named[tied[0][0]][0]} is tied across "
                             "pipeline stages; valid: PipelineZeroStage3 for a pipeline's chunks "
                             "(meshwise train --pp N --zero 3)")
        precision = precision or Precision.of(named[0][1].dtype)
        super().__init__(dp_group, 3, adamw, precision, grad_reducer)
        self.model, self.prefetch = model, prefetch
        self.max_inflight = (policy.overlapped_reductions(dp_group)
                             if max_inflight_reductions is None else max_inflight_reductions)
        self.param_names = [n for n, _ in named]
        device = device or device_of(p for _, p in named)
        values = values or values_of(named)
        cap = unit_cap_mb * 2**20 if unit_cap_mb else None
        unit_params, root_params = cut_into_units(model, units, cap)
        self.pool = BufferPool()
        make = partial(Unit, group=dp_group, precision=precision, device=device, values=values,
                       pool=self.pool, on_gradient=self._on_gradient)
        self.root = make(ROOT, [model], root_params) if root_params else None
        self.blocks: list[Unit] = [make(name, modules, params)
                                   for name, modules, params in unit_params]
        for unit in self.blocks:
            for i, module in enumerate(unit.modules):
                module.register_forward_pre_hook(partial(self._pre_forward, unit, i == 0))
            unit.modules[-1].register_forward_hook(partial(self._post_forward, unit))
        self.units = ([self.root] if self.root else []) + self.blocks
        self.flats = [unit.flat for unit in self.units]
        # The root's hooks run first before and last after the model's forward.
        model.register_forward_pre_hook(self._root_pre_forward, prepend=True)
        model.register_forward_hook(self._root_post_forward, always_call=True)
        self.events: list[tuple[str, str]] = []
        self._forward_order: list[Unit] = []
        self._pending: deque = deque()
        self._by_storage: dict[int, Unit] = {}  # gathered buffers -> their unit
        self._saved_hooks = None
        self._peak_window = 0
        self._last_step_peak: int | None = None
        self._units_checked = False
        self._connect_reducer()

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    # -- tensors saved for backward point into pooled buffers ---------------------
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

    # -- forward / backward hooks ----------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if torch.is_grad_enabled() and not any(u.needs_backward for u in self.units):
            self.events, self._forward_order = [], []  # a new micro-step begins
        self._saved_hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        if self.root is not None:
            self._ensure_gathered(self.root)
        if self.prefetch and self.blocks:
            self._start_gather(self.blocks[0])
        if self.root is not None:
            self.root.use_views()
            self.events.append(("forward", ROOT))

    def _root_post_forward(self, module, args, output) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        tensors = grad_tensors(output)
        if torch.is_grad_enabled() and self.blocks and not self._units_checked:
            self._check_same_units()
            self._units_checked = True
        if tensors:
            if self.root is not None:
                self.root.needs_backward = True
            register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")
        elif self.root is not None and not self.root.needs_backward:
            self._free(self.root)  # forward without autograd (evaluation)

    def _check_same_units(self) -> None:
        """Every dp rank must have run the same units, or their collectives pair up wrongly.

        A unit used on some ranks only would make the reductions (and the gathers
        of the backward prefetch) of different units meet each other: wrong
        gradients or a hang. One small all-reduce, on the first forward only (its
        answer is read on the host, a stall on a GPU), finds a model whose units
        differ by rank before its first backward and names them; a later change
        shows in the collective ledger, which names the rank and call site.
        """
        used = torch.tensor([float(u in self._forward_order) for u in self.blocks],
                            device=self.flats[0].device)
        bounds = torch.stack([used, -used])  # max of both: (max, -min) over ranks
        ops.all_reduce(bounds, self.group, op="max", category="check")
        differ = [u.name for u, hi, neg_lo in zip(self.blocks, bounds[0], bounds[1])
                  if hi != -neg_lo]
        if differ:
            raise RuntimeError(f"ZeRO-3 units {', '.join(differ)} ran on some dp ranks but not "
                               "on others in this forward; every dp rank must run the same "
                               "units (use ZeRO 0-2, whose buckets allow it)")

    def _root_pre_backward(self, grad) -> None:
        if self.root is not None:
            self._ensure_gathered(self.root)
            self.events.append(("backward", ROOT))
        waiting = [u for u in self._forward_order if u.needs_backward]
        if self.prefetch and waiting:
            self._start_gather(waiting[-1])  # the first unit to run backward

    def _pre_forward(self, unit: Unit, first: bool, module, args) -> None:
        self._ensure_gathered(unit)
        if unit.in_backward:  # activation checkpointing recomputes inside backward
            # Parameter plumbing, not the model's computation: hidden from dispatch
            # modes, or selective checkpointing's replay would find ops its forward
            # never recorded.
            with _disable_current_modes():
                unit.use_views()
            return
        if not first:
            return  # the unit's first module already pointed every module at it
        index = self.blocks.index(unit)
        if self.prefetch and index + 1 < len(self.blocks):
            self._start_gather(self.blocks[index + 1])
        unit.use_views()
        if torch.is_grad_enabled():
            self._forward_order.append(unit)
        self.events.append(("forward", unit.name))

    def _post_forward(self, unit: Unit, module, args, output) -> None:
        if unit.in_backward:
            return  # a recompute: the backward still needs the gathered unit
        tensors = grad_tensors(output)
        if tensors:
            unit.needs_backward = True
            register_multi_grad_hook(tensors, partial(self._pre_backward, unit), mode="any")
        self._free(unit)  # reshard after forward: the backward hook gathers again

    def _pre_backward(self, unit: Unit, grad) -> None:
        self._ensure_gathered(unit)
        unit.in_backward = True
        if self.prefetch and unit in self._forward_order:
            earlier = self._forward_order[:self._forward_order.index(unit)]
            waiting = [u for u in earlier if u.needs_backward]
            if waiting:
                self._start_gather(waiting[-1])
        self.events.append(("backward", unit.name))

    def _on_gradient(self, unit: Unit, full_grad: torch.Tensor) -> None:
        if self._by_storage.get(full_grad.untyped_storage().data_ptr()) is unit:
            # The unit's gathered buffer now holds its gradient (``Unit.gradient_ready``).
            del self._by_storage[full_grad.untyped_storage().data_ptr()]
            self.events.append(("free", unit.name))
        self.events.append(("reduce_scatter", unit.name))
        self._pending.append(unit.flat.start_reduce(full_grad, self.grad_reducer,
                                                    key=self.units.index(unit),
                                                    on_done=self.pool.release))
        unit.needs_backward = unit.in_backward = False
        self._free(unit)
        while len(self._pending) > self.max_inflight:
            self._pending.popleft().finish()

    # -- gather bookkeeping ------------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        if unit.start_gather():
            self._by_storage[unit.buffer.untyped_storage().data_ptr()] = unit
            self.events.append(("gather_start", unit.name))
            live = sum(u.gathered_bytes() for u in self.units)
            self._peak_window = max(self._peak_window, live)

    def _ensure_gathered(self, unit: Unit) -> None:
        self._start_gather(unit)
        with ranges.named(f"zero3/gather {unit.name}"):
            unit.wait_gather()

    def _free(self, unit: Unit) -> None:
        storage = unit.buffer.untyped_storage().data_ptr() if unit.is_gathered else None
        if unit.free():
            del self._by_storage[storage]
            self.events.append(("free", unit.name))

    # -- the engine protocol -------------------------------------------------------
    @contextmanager
    def no_sync(self):
        """Accepted for the common protocol, but stage 3 still reduce-scatters every
        micro-step: keeping unsharded gradients until the last micro-step would cost
        a full gradient and break the 16/N bytes of model state. Gradients
        accumulate in the shard instead."""
        yield

    def _idle(self) -> bool:
        return not self._pending and not any(u.needs_backward for u in self.units)

    def _before_update(self) -> None:
        self.finish_grad_sync()

    def _publish(self) -> None:
        # Nothing to publish: the next gather reads the updated shards. A step ends.
        self._last_step_peak = self._peak_window
        self._peak_window = sum(u.gathered_bytes() for u in self.units)

    def finish_grad_sync(self) -> None:
        """Wait for outstanding reductions; free units left gathered (unused in backward)."""
        while self._pending:
            self._pending.popleft().finish()
        for unit in self.units:
            unit.needs_backward = unit.in_backward = False
            self._free(unit)

    def zero_grad(self) -> None:
        self.finish_grad_sync()
        for unit in self.units:
            unit.flat.grad_shard.zero_()
            unit.has_grad = [False] * len(unit.has_grad)

    def _gradient_flags(self) -> tuple[list[str], list[bool]]:
        return ([slot.name for u in self.units for slot in u.flat.slots],
                [flag for u in self.units for flag in u.has_grad])

    @property
    def peak_gathered_bytes(self) -> int:
        """Most bytes of gathered parameters alive at once during the last step."""
        return self._peak_window if self._last_step_peak is None else self._last_step_peak

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 copies of every managed parameter by name (a collective)."""
        out = {}
        for unit in self.units:
            flat = unit.flat
            full = torch.empty(flat.plan.padded_numel, dtype=flat.master.dtype, device=flat.device)
            ops.all_gather(full, flat.master, self.group, category="param")
            out.update({s.name: full[s.offset:s.offset + s.numel].view(s.shape).clone()
                        for s in flat.slots})
        return {name: out[name] for name in self.param_names}

