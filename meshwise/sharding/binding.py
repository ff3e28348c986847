"""Where engine storage meets the model: initial values, parameter owners, ZeRO-3's
units, buffer reuse.

Engines never need a model's full parameters to exist: they ask a *values*
function for the elements each rank keeps, ``values(name, start, end)`` (the
flattened parameter's ``[start, end)``), and allocate their flat buffers
directly. A model built on the meta device (``torch.device("meta")``) thus never
holds memory for what a rank does not keep; ``meshwise.apply.parallelize`` supplies
the layout-independent initial values (or a checkpoint's). For a model whose
parameters already hold values, ``values_of`` reads them.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Callable, Iterable, Sequence, cast

import torch
from torch import nn

from meshwise.comm import ops
from meshwise.geometry.params import cross_stage_tie

Values = Callable[[str, int, int], torch.Tensor]


def values_of(named_params: Iterable[tuple[str, torch.Tensor]]) -> Values:
    """Initial values read from parameters that hold them (not on the meta device)."""
    params = dict(named_params)
    for name, p in params.items():
        if p.device.type == "meta":
            raise ValueError(
                f"parameter {name} is on the meta device: pass the values to "
                "materialise it from (see meshwise.apply.parallelize)"
            )

    def read(name: str, start: int, end: int) -> torch.Tensor:
        return params[name].detach().reshape(-1)[start:end]

    return read


def param_owners(modules: Iterable[nn.Module]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every ``(module, attribute)`` registering each parameter (several when tied)."""
    owners: dict[int, list] = defaultdict(list)
    seen = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for attr, p in module._parameters.items():
                if p is not None:
                    owners[id(p)].append((module, attr))
    return owners


def rebind(param: nn.Parameter, storage: torch.Tensor, owners) -> nn.Parameter:
    """Make ``param`` live in ``storage`` (a view of a flat buffer), keeping its attributes.

    In place when the types allow it; a parameter on the meta device (or of
    another dtype) is replaced by a new one in every module that registers it.
    """
    if param.device == storage.device and param.dtype == storage.dtype:
        param.data = storage
        return param
    if not owners.get(id(param)):
        raise ValueError(
            "a parameter on another device or dtype than its engine buffer must "
            "be reached through the modules given to the engine"
        )
    new = nn.Parameter(storage, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)  # tensor-parallel marks and the like
    for module, attr in owners[id(param)]:
        module._parameters[attr] = new
    return new


class BufferPool:
    """Flat buffers handed out again instead of allocated anew.

    Buffers that are used and dropped every step (a ZeRO-3 unit's gathered
    parameters and its gradient, a ZeRO-2 bucket's gradient) would otherwise go
    back to the allocator each time; on CPU, glibc then keeps much of that memory
    resident anyway and the process grows. A pool holds at most what was in use
    at once (the running unit, the prefetched one, the one being reduced).

    Buckets differ in size by a few elements, so a request is served by the
    smallest free buffer large enough (as a view of its start), and a new buffer
    is made as large as the largest request so far, to serve them all. With
    ``exact`` a new buffer has the requested size: for a user that holds every
    buffer at once (a pipeline stage's units for a whole step), where a buffer
    per request the size of the largest would multiply what is resident.
    """

    def __init__(self, exact: bool = False):
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._largest: dict[tuple, int] = defaultdict(int)
        self.exact = exact

    def acquire(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = (dtype, str(device))
        self._largest[key] = max(self._largest[key], numel)
        free = self._free[key]
        fits = [i for i, buf in enumerate(free) if buf.numel() >= numel]
        if fits:
            base = free.pop(min(fits, key=lambda i: free[i].numel()))
        else:
            size = numel if self.exact else self._largest[key]
            base = torch.empty(size, dtype=dtype, device=device)
        return base if base.numel() == numel else base[:numel]

    def release(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        self._free[(base.dtype, str(base.device))].append(base)


def cut_into_units(
    model: nn.Module,
    units: list[nn.Module] | None,
    cap_bytes: float | None = None,
    alone=(),
    exclude=(),
):
    """Cut ``model``'s parameters into units, which own them from then on (they are
    unregistered from their modules); the parameters in ``exclude`` (another engine's)
    stay where they are.

    ``units``: the layers (default ``model.blocks``), consecutive ones merged while
    within ``cap_bytes`` except the modules in ``alone`` (a tied embedding, whose
    shards must line up with its partner's). Returns ``[(name, modules, trained,
    frozen)]`` for units holding parameters and the root's ``(trained, frozen)``,
    each parameter ``(name, param, [(module, attr), ...])`` in ``named_parameters``
    order; frozen ones (``requires_grad=False``) are apart, as they never train.
    """
    layers = _resolve_layers(model, units)
    groups = _assign_params(model, [m for _, m in layers], {id(p) for p in exclude})
    merged: list[list] = []
    for (name, module), (trained, frozen) in zip(layers, groups):
        if not trained and not frozen:
            continue  # a parameter-free layer needs no gathering
        size = sum(p.numel() * p.element_size() for _, p, _ in trained + frozen)
        last = merged[-1] if merged else None
        mergeable = last is not None and module not in alone and last[1][-1] not in alone
        if last is not None and mergeable and cap_bytes and last[4] + size <= cap_bytes:
            last[:] = (
                f"{last[0]}+{name}",
                last[1] + [module],
                last[2] + trained,
                last[3] + frozen,
                last[4] + size,
            )
        else:
            merged.append([name, [module], trained, frozen, size])
    return [tuple(unit[:4]) for unit in merged], groups[-1]


def _resolve_layers(model: nn.Module, units) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each layer, checked to be disjoint submodules."""
    names = {id(m): n for n, m in model.named_modules()}
    if units is None:
        blocks = getattr(model, "blocks", None)
        if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)) and len(blocks) > 0:
            units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
        else:
            warnings.warn(
                f"{type(model).__name__} has no `blocks`: ZeRO-3 treats the whole "
                "model as one unit, so every parameter is gathered at once; pass "
                "`units` to shard the peak",
                stacklevel=4,
            )
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


def _assign_params(model: nn.Module, unit_modules: list[nn.Module], exclude: set[int]) -> list:
    """Per unit (then the root last): ``(trained, frozen)``, lists of ``(name, param,
    [(module, attr), ...])``, leaving out the parameters whose ids are in ``exclude``.
    A tied parameter lists every (module, attribute) holding it and must stay within
    one unit."""
    unit_of = {id(sub): i for i, m in enumerate(unit_modules) for sub in m.modules()}
    owners = param_owners([model])
    groups: list[tuple[list, list]] = [([], []) for _ in range(len(unit_modules) + 1)]
    for name, p in model.named_parameters():
        if id(p) in exclude:
            continue
        held_by = {unit_of.get(id(module), len(unit_modules)) for module, _ in owners[id(p)]}
        if len(held_by) > 1:
            raise ValueError(
                f"parameter {name!r} is shared by several units; "
                "tied parameters must live in one unit"
            )
        groups[held_by.pop()][0 if p.requires_grad else 1].append((name, p, owners[id(p)]))
    # Only once everything is validated: the units' flat buffers now own them.
    for trained, frozen in groups:
        for _, _, held in trained + frozen:
            for module, attr in held:
                del module._parameters[attr]
    return groups


def device_of(params) -> torch.device:
    """Where the first parameter not on the meta device lives; the CPU if none is."""
    return next((p.device for p in params if p.device.type != "meta"), torch.device("cpu"))


def tie_groups(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[int, ops.Group]]:
    """``(index in named, group)`` of each cross-stage tie copy (marked by
    ``meshwise.apply.parallelize``); ValueError for one marked without a group,
    whose gradient nothing would sum with its other copy's."""
    out = []
    for i, (name, param) in enumerate(named):
        tied, group = cross_stage_tie(param)
        if tied and group is None:
            raise ValueError(
                f"{name} is tied to a parameter on another pipeline stage, but "
                "parallelize was given no group to sum their gradients over; "
                "pass mesh= (or tie_group=mesh.tie_group) to parallelize"
            )
        if tied:
            out.append((i, cast(ops.Group, group)))  # the mesh's group parallelize attached
    return out
