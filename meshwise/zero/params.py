"""ZeRO stage 3 (fully sharded data parallel): parameters sharded at rest.

The model is cut into *units* (by default each of ``model.blocks``, plus a root
unit holding every other parameter: embeddings, final norm, head). Each unit is
a ``FlatUnit``: one flat buffer sharded over dp. Around each unit's forward and
backward (ZeRO, Rajbhandari et al. 2020, section 5.3; FSDP, Zhao et al. 2023):

- forward: all-gather the unit (unless prefetched), run it, free the full buffer;
  with ``prefetch`` the *next* unit's all-gather is launched before this unit
  computes, so communication can overlap compute;
- backward: a hook on the unit's outputs fires when their gradient is ready,
  i.e. just before the unit's backward: re-gather (tensors autograd saved are
  views of the same storage, so they see the data again) and prefetch the unit
  that ran before it; a post-accumulate-grad hook on the flat parameter fires
  when the unit's flat gradient is complete: reduce-scatter it into this rank's
  gradient shard and free both full buffers.

The root unit's parameters are used at both ends of the forward (embedding
first, head last), so, as FSDP2 does for its root module, it is gathered when
the model's forward starts and kept until its own gradient is reduced at the
very end of the backward. Peak gathered memory is thus about the root plus two
block units (the running one and the prefetched one).

Collectives are issued from hooks that fire in the same order on every rank
(the same model and graph), which is what keeps them matched.

Activation checkpointing works: a recompute inside backward finds its unit
gathered and neither frees nor prefetches anything.

Limits: each unit's forward runs once per forward pass, and each forward is
followed by its backward before the next forward with gradients (no pipeline
interleaving); the wrapped model's managed parameters are no longer registered
``nn.Parameter``s (see ``param_names`` and ``full_state_dict``).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from meshwise.checkpoint.state import FlatRun
from meshwise.comm import ops
from meshwise.optim import AdamWConfig
from meshwise.zero.flat_unit import ROOT, FlatUnit, cut_into_units

# Reduce-scatters allowed in flight at once: each holds a unit's full gradient,
# so bounding them keeps gradient memory at about one unit (FSDP2 waits on the
# previous reduce-scatter in the same way).
MAX_INFLIGHT_REDUCE_SCATTERS = 1


class ZeroStage3:
    """Fully sharded data parallel around ``model`` with a sharded AdamW.

    ``units``: modules that are gathered one at a time (default ``model.blocks``);
    parameters outside them form the root unit. ``prefetch`` launches the next
    unit's all-gather ahead of its use. ``events`` lists what the latest
    forward/backward did, as ``(kind, unit_name)`` with kind in ``gather_start``,
    ``forward``, ``free``, ``backward``, ``reduce_scatter``.
    """

    def __init__(self, model: nn.Module, dp_group, adamw: AdamWConfig,
                 units: list[nn.Module] | None = None, prefetch: bool = True):
        self.model, self.group, self.adamw, self.prefetch = model, dp_group, adamw, prefetch
        # Names of the managed parameters, in model.named_parameters() order.
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        unit_params, root_params = cut_into_units(model, units)
        self.root = FlatUnit(ROOT, root_params, dp_group) if root_params else None
        self.blocks: list[FlatUnit] = []
        for name, module, params in unit_params:
            unit = FlatUnit(name, params, dp_group)
            module.register_forward_pre_hook(partial(self._pre_forward, unit))
            module.register_forward_hook(partial(self._post_forward, unit))
            self.blocks.append(unit)
        self.units = ([self.root] if self.root else []) + self.blocks
        for unit in self.units:
            unit.flat_param.register_post_accumulate_grad_hook(partial(self._on_grad_ready, unit))
        # The root's hooks run first before and last after the model's forward,
        # even when the model itself is a unit (prepend vs registered last).
        model.register_forward_pre_hook(self._root_pre_forward, prepend=True)
        model.register_forward_hook(self._root_post_forward)
        self.step_count = 0
        self.events: list[tuple[str, str]] = []
        self._forward_order: list[FlatUnit] = []
        self._pending: deque = deque()
        self._peak_window = 0
        self._last_step_peak: int | None = None

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    # -- forward / backward hooks ----------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if torch.is_grad_enabled() and not any(u.needs_backward for u in self.units):
            self.events, self._forward_order = [], []  # a new micro-step begins
        if self.root is not None:
            self._ensure_gathered(self.root)
        if self.prefetch and self.blocks:
            self._start_gather(self.blocks[0])
        if self.root is not None:
            self.root.use_views()
            self.events.append(("forward", ROOT))

    def _root_post_forward(self, module, args, output) -> None:
        tensors = _grad_tensors(output)
        if torch.is_grad_enabled() and self.blocks:
            self._check_same_units()
        if tensors:
            if self.root is not None:
                self.root.needs_backward = True
            register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")
        elif self.root is not None and not self.root.needs_backward:
            self._free(self.root)  # forward without autograd (evaluation)

    def _check_same_units(self) -> None:
        """Every dp rank must have run the same units, or their collectives pair up wrongly.

        A unit used on some ranks only would make the reduce-scatters (and the
        gathers of the backward prefetch) of different units meet each other:
        wrong gradients or a hang. One small all-reduce per forward finds it
        before the backward starts, and names the units.
        """
        used = torch.tensor([float(u in self._forward_order) for u in self.blocks],
                            device=self._device())
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
            self._start_gather(waiting[-1])  # the first block unit to run backward

    def _pre_forward(self, unit: FlatUnit, module, args) -> None:
        self._ensure_gathered(unit)
        if unit.in_backward:  # activation checkpointing recomputes inside backward
            unit.use_views()
            return
        index = self.blocks.index(unit)
        if self.prefetch and index + 1 < len(self.blocks):
            self._start_gather(self.blocks[index + 1])
        unit.use_views()
        if torch.is_grad_enabled():
            self._forward_order.append(unit)
        self.events.append(("forward", unit.name))

    def _post_forward(self, unit: FlatUnit, module, args, output) -> None:
        if unit.in_backward:
            return  # a recompute: the backward still needs the gathered unit
        tensors = _grad_tensors(output)
        if tensors:
            unit.needs_backward = True
            register_multi_grad_hook(tensors, partial(self._pre_backward, unit), mode="any")
        # Reshard after forward: the backward hook gathers again.
        self._free(unit)

    def _pre_backward(self, unit: FlatUnit, grad) -> None:
        self._ensure_gathered(unit)
        unit.in_backward = True
        if self.prefetch and unit in self._forward_order:
            earlier = self._forward_order[:self._forward_order.index(unit)]
            waiting = [u for u in earlier if u.needs_backward]
            if waiting:
                self._start_gather(waiting[-1])
        self.events.append(("backward", unit.name))

    def _on_grad_ready(self, unit: FlatUnit, flat_param) -> None:
        self.events.append(("reduce_scatter", unit.name))
        self._pending.append(unit.start_reduce_scatter())
        unit.needs_backward = unit.in_backward = False
        self._free(unit)
        while len(self._pending) > MAX_INFLIGHT_REDUCE_SCATTERS:
            self._pending.popleft().finish()

    # -- gather bookkeeping ------------------------------------------------------
    def _start_gather(self, unit: FlatUnit) -> None:
        if unit.start_gather():
            self.events.append(("gather_start", unit.name))
            live = sum(u.gathered_bytes() for u in self.units)
            self._peak_window = max(self._peak_window, live)

    def _ensure_gathered(self, unit: FlatUnit) -> None:
        self._start_gather(unit)
        unit.wait_gather()

    def _free(self, unit: FlatUnit) -> None:
        if unit.free():
            self.events.append(("free", unit.name))

    # -- the optimizer protocol shared with ZeRO 1/2 -------------------------------
    @contextmanager
    def no_sync(self):
        """Accepted for the common protocol, but stage 3 still reduce-scatters every
        micro-step: keeping unsharded gradients until the last micro-step would cost
        4 bytes per parameter and break the 16/N bytes of model state. Gradients
        accumulate in the shard instead."""
        yield

    def finish_grad_sync(self) -> None:
        """Wait for outstanding reduce-scatters; free units left gathered (unused in backward)."""
        while self._pending:
            self._pending.popleft().finish()
        for unit in self.units:
            unit.needs_backward = unit.in_backward = False
            self._free(unit)

    def zero_grad(self) -> None:
        self.finish_grad_sync()
        for unit in self.units:
            unit.grad_shard.zero_()
            unit.has_grad = [False] * len(unit.slots)

    def grad_sq_norm(self, include=None) -> torch.Tensor:
        """Squared global gradient norm (all dp shards), optionally of parameters
        whose name passes ``include``; the same value on every rank."""
        self.finish_grad_sync()
        total = sum((u.grad_sq_sum(include) for u in self.units),
                    torch.zeros((), dtype=self._dtype(), device=self._device()))
        ops.all_reduce(total, self.group, category="norm")
        return total

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """AdamW on this rank's shards with gradients times ``grad_scale``."""
        self.finish_grad_sync()
        self.step_count += 1
        used = self._params_with_grad()
        for unit in self.units:
            unit.adamw_step(self.step_count, lr, self.adamw, grad_scale, used)

    def _params_with_grad(self) -> set[str]:
        """Names that got a gradient on any dp rank since ``zero_grad()`` (a collective)."""
        flags = torch.tensor([float(f) for u in self.units for f in u.has_grad],
                             device=self._device())
        ops.all_reduce(flags, self.group, op="max", category="check")
        names = [slot.name for u in self.units for slot in u.slots]
        return {name for name, flag in zip(names, flags.tolist()) if flag}
        self._last_step_peak = self._peak_window
        self._peak_window = sum(u.gathered_bytes() for u in self.units)

    # -- measurements and state ---------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state on this rank, measured
        from the storages of the tensors held (each storage counted once)."""
        seen, total = set(), 0
        for unit in self.units:
            for tensor in unit.state_tensors():
                storage = tensor.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    @property
    def peak_gathered_bytes(self) -> int:
        """Most bytes of gathered full parameters alive at once during the last
        step (since the previous ``step()``; before any step, so far)."""
        return self._peak_window if self._last_step_peak is None else self._last_step_peak

    def checkpoint_runs(self) -> list[FlatRun]:
        """Each unit's shard of parameters and optimizer state, as a checkpoint sees it."""
        runs = []
        for unit in self.units:
            start, _ = unit.plan.shard_range(self.group.rank)
            runs.append(FlatRun([(slot.name, slot.offset, slot.numel) for slot in unit.slots],
                                unit.plan.owned_range(self.group.rank),
                                {"param": (unit.shard, start), "exp_avg": (unit.exp_avg, start),
                                 "exp_avg_sq": (unit.exp_avg_sq, start)}))
        return runs

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full copies of every managed parameter by name (a collective)."""
        out = {}
        for unit in self.units:
            out.update(unit.full_tensors())
        return {name: out[name] for name in self.param_names}

    def _dtype(self):
        return self.units[0].shard.dtype if self.units else torch.float32

    def _device(self):
        return self.units[0].shard.device if self.units else torch.device("cpu")


def _grad_tensors(output) -> list[torch.Tensor]:
    """Tensors in a (nested) forward output that autograd will send gradients to."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _grad_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _grad_tensors(item)]
    return []
