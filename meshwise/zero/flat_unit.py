"""ZeRO-3 units: how a model is cut into them, and one unit's sharded storage.

``cut_into_units`` assigns every trainable parameter to a unit (a module given
by the user, by default each of ``model.blocks``) or to the root unit (the rest).

A unit's parameters are concatenated (in ``named_parameters`` order) into one
flat buffer, padded to a multiple of the dp size (``ShardPlan``) and cut into
equal shards. At rest a rank keeps only its shard of the parameters, of the
gradient and of AdamW's two moments: 16 bytes / N per fp32 parameter (ZeRO,
Rajbhandari et al. 2020, section 5.3).

The full buffer is the storage of one leaf ``flat_param`` (the FlatParameter of
PyTorch FSDP, Zhao et al. 2023). ``use_views`` points every module
attribute at a slice of it through a single ``torch.split``, so autograd sums
the per-parameter gradients into one flat gradient of ``flat_param`` in a single
backward node, ready to reduce-scatter without a copy. Freeing resizes the
storage to zero bytes but keeps the storage *object*: tensors autograd saved in
forward are views of it and see the data again once the unit is re-gathered.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

from meshwise.comm import ops
from meshwise.optim import AdamWConfig, adamw_update, decays, squared_sum
from meshwise.zero.partition import ShardPlan

ROOT = "root"


@dataclass(frozen=True)
class Segment:
    """The part of one parameter inside this rank's shard: ``shard[start:end]``."""

    name: str
    start: int
    end: int
    decays: bool


@dataclass
class _Slot:
    """One parameter of the unit: where it lives in the flat buffer, who uses it."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    owners: list[tuple[nn.Module, str]]  # (module, attribute): several when tied


class PendingGrad:
    """An in-flight reduce-scatter of a unit's full gradient into its shard."""

    def __init__(self, unit: "FlatUnit", handle, out: torch.Tensor, full_grad: torch.Tensor):
        self.unit, self._handle, self._out = unit, handle, out
        self._full_grad = full_grad  # must outlive the transfer

    def finish(self) -> None:
        self._handle.wait()
        # Accumulate: micro-steps add into the same shard until zero_grad().
        self.unit.grad_shard.add_(self._out)
        self._out = self._full_grad = None


class FlatUnit:
    """Sharded storage, gather/free and the sharded AdamW update of one unit.

    ``params`` come from ``cut_into_units``: ``(name, param, owners)`` whose
    owners no longer register the parameter (the unit sets their attributes).
    """

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter, list]], group):
        self.name = name
        self.group = group
        first = params[0][1]
        if any(p.dtype != first.dtype or p.device != first.device for _, p, _ in params):
            raise ValueError(f"unit {name!r}: all parameters must share one dtype and device")
        self.slots, offset = [], 0
        for pname, p, owners in params:
            self.slots.append(_Slot(pname, p.shape, offset, p.numel(), owners))
            offset += p.numel()
        self.plan = ShardPlan(offset, group.size)
        self.segments = self._segments(params)
        dtype, device = first.dtype, first.device
        start, end = self.plan.shard_range(group.rank)
        with torch.no_grad():
            full = torch.zeros(self.plan.padded_numel, dtype=dtype, device=device)
            for slot, (_, p, _) in zip(self.slots, params):
                full[slot.offset:slot.offset + slot.numel].copy_(p.reshape(-1))
            self.shard = full[start:end].clone()
        del full
        self.grad_shard = torch.zeros_like(self.shard)
        self.exp_avg = torch.zeros_like(self.shard)
        self.exp_avg_sq = torch.zeros_like(self.shard)
        self.flat_param = nn.Parameter(torch.empty(self.plan.padded_numel, dtype=dtype,
                                                   device=device))
        # `.data` aliases the storage with its own version counter, so writing the
        # gathered values does not invalidate tensors autograd saved in forward.
        self._full = self.flat_param.data
        self._split_sizes = [s.numel for s in self.slots] + [self.plan.padding]
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self._gather = None  # Handle of an in-flight all-gather
        self._storage_bytes = self.flat_param.untyped_storage().nbytes()
        self.flat_param.untyped_storage().resize_(0)
        self.hide_views()
        self.has_grad = [False] * len(self.slots)  # per parameter, since zero_grad()
        self.needs_backward = False  # ran forward with autograd; backward not done yet
        self.in_backward = False  # between its pre-backward hook and its gradient

    def _segments(self, params) -> list[Segment]:
        start, end = self.plan.shard_range(self.group.rank)
        segments = []
        for slot, (_, p, _) in zip(self.slots, params):
            lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
            if lo < hi:
                segments.append(Segment(slot.name, lo - start, hi - start, decays(slot.name, p)))
        return segments

    # -- gather / free ---------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self.flat_param.untyped_storage().nbytes() > 0

    def gathered_bytes(self) -> int:
        """Bytes of the full parameter buffer alive now (0 when freed)."""
        return self.flat_param.untyped_storage().nbytes()

    def start_gather(self) -> bool:
        """Allocate the full buffer and launch the all-gather; False if already there."""
        if self.is_allocated:
            return False
        self.flat_param.untyped_storage().resize_(self._storage_bytes)
        self._gather = ops.all_gather(self._full, self.shard, self.group,
                                      category="param", async_op=True)
        return True

    def wait_gather(self) -> None:
        assert self.is_allocated, f"unit {self.name}: wait_gather() before start_gather()"
        if self._gather is not None:
            self._gather.wait()
            self._gather = None

    def free(self) -> bool:
        """Release the full buffer's memory; False if it was not allocated."""
        if not self.is_allocated:
            return False
        if self._gather is not None:  # never free memory a transfer is writing
            self.wait_gather()
        self.flat_param.untyped_storage().resize_(0)
        self.hide_views()
        return True

    def use_views(self) -> None:
        """Point module attributes at slices of the (gathered) full buffer.

        Called in each forward, under that forward's grad mode: one ``split``
        node makes the gradient of every slice land in ``flat_param.grad``.
        """
        views = torch.split(self.flat_param, self._split_sizes)
        for i, (slot, view) in enumerate(zip(self.slots, views)):
            tensor = view.view(slot.shape)
            if tensor.requires_grad:  # which parameters get a gradient (AdamW skips others)
                tensor.register_hook(partial(self._mark_grad, i))
            for module, attr in slot.owners:
                setattr(module, attr, tensor)

    def _mark_grad(self, index: int, grad: torch.Tensor) -> None:
        self.has_grad[index] = True

    def hide_views(self) -> None:
        """Empty tensors stand in while freed: a stray use fails on shape, not on freed memory."""
        for slot in self.slots:
            for module, attr in slot.owners:
                setattr(module, attr, self._empty)

    # -- gradients ---------------------------------------------------------------
    def start_reduce_scatter(self) -> PendingGrad:
        """Reduce-scatter ``flat_param.grad`` (summing over dp) and drop the full gradient."""
        full_grad = self.flat_param.grad.contiguous()
        self.flat_param.grad = None
        out = torch.empty_like(self.grad_shard)
        handle = ops.reduce_scatter(out, full_grad, self.group, category="grad", async_op=True)
        return PendingGrad(self, handle, out, full_grad)

    def grad_sq_sum(self, include=None) -> torch.Tensor:
        """Sum of squared gradient elements of this rank's segments (``include`` filters names)."""
        total = torch.zeros((), dtype=torch.float64, device=self.grad_shard.device)
        for seg in self.segments:
            if include is None or include(seg.name):
                total += squared_sum(self.grad_shard[seg.start:seg.end])
        return total

    @torch.no_grad()
    def adamw_step(self, step: int, lr: float, cfg: AdamWConfig, grad_scale: float,
                   used: set[str] | None = None) -> None:
        """AdamW on the owned shard; weight decay per run of same-kind segments.

        ``used``: names of the parameters to update (``None``: all); the others
        got no gradient this step and are left alone, as torch's AdamW does."""
        for start, end, decay in self._runs(used):
            grad = self.grad_shard[start:end]
            if grad_scale != 1.0:
                grad = grad * grad_scale
            adamw_update(self.shard[start:end], grad, self.exp_avg[start:end],
                         self.exp_avg_sq[start:end], step, lr, cfg,
                         weight_decay=cfg.weight_decay if decay else 0.0)

    def _runs(self, used: set[str] | None = None) -> list[tuple[int, int, bool]]:
        # Segments are adjacent in the shard; merging neighbours with the same
        # decay flag keeps the update to a few large calls instead of one per tensor.
        runs: list[list] = []
        for seg in self.segments:
            if used is not None and seg.name not in used:
                continue
            if runs and runs[-1][2] == seg.decays and runs[-1][1] == seg.start:
                runs[-1][1] = seg.end
            else:
                runs.append([seg.start, seg.end, seg.decays])
        return [tuple(r) for r in runs]

    # -- state ---------------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor this unit keeps on the rank (full buffers only while gathered)."""
        tensors = [self.shard, self.grad_shard, self.exp_avg, self.exp_avg_sq, self.flat_param]
        if self.flat_param.grad is not None:
            tensors.append(self.flat_param.grad)
        return tensors

    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter as a full tensor (a collective: all ranks must call)."""
        full = torch.empty(self.plan.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        ops.all_gather(full, self.shard, self.group, category="param")
        return {s.name: full[s.offset:s.offset + s.numel].view(s.shape).clone()
                for s in self.slots}


def cut_into_units(model: nn.Module, units: list[nn.Module] | None):
    """Cut ``model``'s trainable parameters into units.

    Returns ``[(name, module, params), ...]`` for the units that hold parameters
    and the root's ``params`` (everything outside them); ``params`` are
    ``(name, param, [(module, attr), ...])`` in ``named_parameters`` order. The
    parameters are unregistered from their modules: the flat buffers own them.
    """
    unit_modules = _resolve_units(model, units)
    groups = _assign_params(model, [m for _, m in unit_modules])
    found = [(name, module, params) for (name, module), params in zip(unit_modules, groups)
             if params]  # a parameter-free unit needs no gathering
    return found, groups[-1]


def _resolve_units(model: nn.Module, units) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each unit, checked to be disjoint submodules."""
    names = {id(m): n for n, m in model.named_modules()}
    if units is None:
        blocks = getattr(model, "blocks", None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            units = list(blocks)
        else:
            warnings.warn(f"{type(model).__name__} has no `blocks` ModuleList: ZeRO-3 "
                          "treats the whole model as one unit, so every parameter is "
                          "gathered at once; pass `units` to shard the peak", stacklevel=4)
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

    Parameters are taken in ``model.named_parameters()`` order; a tied parameter
    lists every (module, attribute) that holds it, and must stay within one unit.
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
