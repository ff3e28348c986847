"""ZeRO stage 3 (fully sharded data parallel): parameters sharded at rest.

One engine for a model or a rank's pipeline chunks, each cut into units
(``meshwise.sharding.units``): its layers, and a root unit of the rest (hooked
on the chunk, kept from a forward to its backward, as FSDP2's root). A unit is
all-gathered for its forward and its backward, the next one's gather started
ahead, and its gradient reduce-scattered into this rank's fp32 shard (ZeRO,
Rajbhandari et al. 2020, section 5.3; FSDP, Zhao et al. 2023). A policy frees
its gathered parameters (FSDP2's ``reshard_after_forward``): ``after-forward``,
``after-backward`` (when no micro-batch in flight awaits its backward) or
``after-step``, whose gradients add up unsharded and are reduce-scattered once,
after the step's last backward (torchtitan's pipeline x FSDP). When units are
gathered and freed: ``meshwise.sharding.unit_hooks``; here, the state, the
gradients' reduction and the step.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from meshwise.comm import ops, policy
from meshwise.sharding.adamw import AdamWConfig
from meshwise.sharding.binding import BufferPool, cut_into_units, device_of, tie_groups, values_of
from meshwise.sharding.engine import EngineBase
from meshwise.sharding.flat import Precision
from meshwise.sharding.unit_hooks import RESHARD, Chunk, UnitHooks, reshard_policy
from meshwise.sharding.units import ROOT, Gathered, Unit

__all__ = ["RESHARD", "PipelineZeroStage3", "ZeroStage3", "reshard_policy"]


class ZeroStage3(UnitHooks, EngineBase):
    """Fully sharded data parallel around ``model`` (or this rank's pipeline chunks, a
    list; ``units`` then per chunk) with a sharded AdamW.

    ``units``: the layers (default ``model.blocks``), consecutive ones merged up to
    ``unit_cap_mb`` except those in ``alone``. ``prefetch``: start the next unit's
    all-gather ahead of its use. ``reshard``: one of ``RESHARD`` (``reshard_policy``).
    ``values``/``precision``/``device``/``grad_reducer``: as for ``ZeroOptimizer``.
    Frozen parameters are sharded and gathered with their unit, never reduced or
    updated; ``exclude``: parameters another engine owns, left alone.
    ``events``: what the latest micro-step did, ``(kind, unit)``, kind one of
    ``gather_start``, ``forward``, ``free``, ``backward``, ``reduce_scatter``.
    """

    def __init__(
        self,
        model: nn.Module | list[nn.Module],
        dp_group,
        adamw: AdamWConfig,
        units=None,
        prefetch: bool = True,
        *,
        reshard: str | None = None,
        alone=(),
        exclude=(),
        precision: Precision | None = None,
        values=None,
        device=None,
        unit_cap_mb: float | None = None,
        grad_reducer=None,
    ):
        modules = [model] if isinstance(model, nn.Module) else list(model)
        pipelined = not isinstance(model, nn.Module)
        reshard = reshard_policy(pipelined) if reshard is None else reshard
        if reshard not in RESHARD:
            raise ValueError(f"reshard {reshard!r} is not valid; valid: {', '.join(RESHARD)}")
        left_out = {id(p) for p in exclude}
        every = [(n, p) for m in modules for n, p in m.named_parameters() if id(p) not in left_out]
        named = [(n, p) for n, p in every if p.requires_grad]
        super().__init__(
            dp_group, 3, adamw, precision or Precision.of(named[0][1].dtype), grad_reducer
        )
        self.model, self.prefetch, self.reshard = model, prefetch, reshard
        self.max_inflight = policy.overlapped_reductions(dp_group)
        self.param_names = [n for n, _ in named]
        # Buffers of the request's size where units of unlike sizes (an embedding
        # alone, a layer) are held at once.
        self.pool = BufferPool(exact=pipelined or reshard == "after-step")
        # The roots are gathered for most of a step, beside the layers: a pool of their
        # own, so that a root (an embedding and a head) does not size every layer's buffer.
        self.root_pool = BufferPool(exact=True)
        self.gathered = Gathered()
        make = partial(
            Unit,
            group=dp_group,
            precision=self.precision,
            device=device or device_of(p for _, p in named),
            values=values or values_of(every),
            pool=self.pool,
            gathered=self.gathered,
            on_gradient=self._views_backward,
        )
        self._chunks: list[Chunk] = []
        for c, module in enumerate(modules):
            unit_params, (root_trained, root_frozen) = cut_into_units(
                module,
                units[c] if pipelined else units,
                unit_cap_mb * 2**20 if unit_cap_mb else None,
                alone,
                exclude,
            )
            root = (
                make(
                    f"root{c}" if pipelined else ROOT,
                    [module],
                    root_trained,
                    frozen=root_frozen,
                    pool=self.root_pool,
                )
                if root_trained or root_frozen
                else None
            )
            blocks = [
                make(name, mods, trained, frozen=frozen)
                for name, mods, trained, frozen in unit_params
            ]
            self._chunks.append(Chunk(module, root, blocks))
            self._register(self._chunks[-1])
        self.units = [u for ch in self._chunks for u in ([ch.root] if ch.root else []) + ch.blocks]
        self.blocks = [u for ch in self._chunks for u in ch.blocks]
        # What trains: a unit of frozen parameters only has an empty flat, left out.
        self.flats = [unit.flat for unit in self.units if unit.flat.slots]
        self._roots = {ch.root for ch in self._chunks if ch.root is not None}
        self.root = self._chunks[0].root  # the model's (the first chunk's)
        self.events = self.gathered.events
        self._pending: deque = deque()  # reductions in flight
        self._accumulated: dict[Unit, torch.Tensor] = {}  # after-step: unsharded gradients
        self._partials: dict = {}  # a split backward's B parts, waiting for W's
        self._saved_hooks: saved_tensors_hooks | None = None
        self._sync_enabled, self._last_step_peak = True, None
        self._ties = [(named[i][0], group) for i, group in tie_groups(named)]
        for name, _ in self._ties:
            self.tie_grad(name)  # ValueError unless it has a unit of its own
        self._connect_reducer()

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def _views_backward(self, unit: Unit, grads, ctx) -> None:
        """``_UnitViews``' backward: all of a forward's gradient, or B's or W's part of it."""
        ends_backward = getattr(ctx, "partial", None) is None
        grads = unit.merge_parts(grads, ctx, self._partials)
        whole = ends_backward and grads is not None
        buffer = self._end_backward(unit, take=True) if whole and unit.can_hold_gradient() else None
        if grads is not None:
            self._gradient(unit, grads, buffer)
        if ends_backward:
            self._end_backward(unit)

    @torch.no_grad()
    def _gradient(self, unit: Unit, grads, buffer: torch.Tensor | None = None) -> None:
        """Reduce-scattered now, or (after-step under ``no_sync()``) kept unsharded."""
        full = unit.add_gradient(grads, self._accumulated.pop(unit, None), buffer)
        if self.reshard == "after-step" and not self._sync_enabled:
            self._accumulated[unit] = full
            return
        self._reduce(unit, full)
        if self.reshard == "after-step":
            unit.free()  # its last gradient of the step: the parameters can go

    def _reduce(self, unit: Unit, full: torch.Tensor) -> None:
        self.events.append(("reduce_scatter", unit.name))
        self._pending.append(
            unit.flat.start_reduce(
                full, self.grad_reducer, key=self.flats.index(unit.flat), on_done=unit.pool.release
            )
        )
        while len(self._pending) > self.max_inflight:
            self._pending.popleft().finish()

    # -- the engine protocol -------------------------------------------------------
    @contextmanager
    def no_sync(self):
        """After-step: gradients add up unsharded until a backward outside it; the other
        policies reduce each micro-batch's all the same (one unsharded costs a full one)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _before_update(self) -> None:
        self._complete()  # a tie's sum belongs to finish_grad_sync, once

    def finish_grad_sync(self) -> None:
        """Complete the step's reductions; sum each cross-stage tie's shard over its group."""
        self._complete()
        for name, group in self._ties:
            ops.all_reduce(self.tie_grad(name), group, category="grad")

    def _complete(self) -> None:
        """Reduce what is left (a deferred weight unused in a forward, after-step gradients
        added under no_sync), wait for every reduction, free every unit."""
        for unit, ctx in list(self._partials.values()):
            self._partials.pop(id(ctx))
            grads, ctx.partial = ctx.partial, None
            self._gradient(unit, grads)
        for unit in list(self._accumulated):
            self._reduce(unit, self._accumulated.pop(unit))
        while self._pending:
            self._pending.popleft().finish()
        self._free_all()

    def _publish(self) -> None:
        # Nothing to publish: the next gather reads the updated shards. A step ends.
        self._free_all()
        self._last_step_peak, self.gathered.peak = self.gathered.peak, 0

    def load_done(self) -> None:
        self._free_all()

    def zero_grad(self) -> None:
        self._complete()
        for unit in self.units:
            unit.flat.shard_grad().zero_()
            unit.has_grad = [False] * len(unit.has_grad)

    def _gradient_flags(self) -> tuple[list[str], list[bool]]:
        return (
            [slot.name for u in self.units for slot in u.flat.slots],
            [flag for u in self.units for flag in u.has_grad],
        )

    def tie_grad(self, name: str) -> torch.Tensor:
        """The reduced gradient shard of parameter ``name``, which has a unit of its own."""
        for unit in self.units:
            if [s.name for s in unit.flat.slots] == [name]:
                return unit.flat.shard_grad()
        raise ValueError(
            f"{name} is tied across pipeline stages and needs a unit of its own, "
            "so that its dp shard lines up with its partner's; pass its module "
            "in alone="
        )

    def state_bytes(self) -> int:
        """The trained parameters' state, and the frozen parameters' shards."""
        frozen = [u.frozen.master for u in self.units if u.frozen is not None]
        return super().state_bytes() + sum(t.numel() * t.element_size() for t in frozen)

    @property
    def peak_gathered_bytes(self) -> int:
        """Most bytes of gathered parameters alive at once during the last step."""
        return self.gathered.peak if self._last_step_peak is None else self._last_step_peak

    def full_state_dict(self, frozen: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 copies of every trained parameter by name (a collective); with
        ``frozen``, of the frozen ones instead, in the compute dtype."""
        out = {}
        frozen_flats = [u.frozen for u in self.units if u.frozen is not None]
        for flat in frozen_flats if frozen else self.flats:
            full = torch.empty(flat.plan.padded_numel, dtype=flat.master.dtype, device=flat.device)
            ops.all_gather(full, flat.master, self.group, category="param")
            out.update(
                {
                    s.name: full[s.offset : s.offset + s.numel].view(s.shape).clone()
                    for s in flat.slots
                }
            )
        return out if frozen else {name: out[name] for name in self.param_names}


def PipelineZeroStage3(
    chunks: list[nn.Module],
    dp_group,
    adamw: AdamWConfig,
    units,
    *,
    reshard_after_forward: bool = False,
    **options,
) -> ZeroStage3:
    """``ZeroStage3`` over a rank's pipeline ``chunks`` (its former name for them)."""
    return ZeroStage3(
        list(chunks),
        dp_group,
        adamw,
        units,
        reshard=reshard_policy(True, reshard_after_forward),
        **options,
    )
