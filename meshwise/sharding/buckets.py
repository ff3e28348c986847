"""Data parallelism with overlapped gradient buckets: ZeRO stages 0, 1 and 2.

Parameters are packed into flat buckets (``BucketPlan``, reverse registration
order); a post-accumulate-grad hook launches a bucket's reduction once its last
gradient arrives, so communication overlaps the rest of backward (Megatron-LM's
``start_grad_sync`` / ``finish_grad_sync``); gradients are summed over dp. Stage
1 shards AdamW's state, stage 2 the gradients too (as DeepSpeed's stage 2); the
parameters' all-gathers after the update overlap the next forward. See
docs/memory.md.
"""

from __future__ import annotations

import contextlib
import warnings
from functools import partial
from typing import Iterable

import torch
from torch import nn

from meshwise.comm import ops
from meshwise.sharding.adamw import AdamWConfig, decays
from meshwise.sharding.binding import (
    BufferPool,
    device_of,
    param_owners,
    rebind,
    tie_groups,
    values_of,
)
from meshwise.sharding.engine import EngineBase
from meshwise.sharding.flat import FlatParams, ParamSlot, Precision
from meshwise.sharding.plans import BucketPlan, ParamSpec

ZERO_STAGES = (0, 1, 2)
# Stage 2: reductions left in flight while backward goes on (each holds a bucket).
MAX_INFLIGHT_REDUCTIONS = 1


class ZeroOptimizer(EngineBase):
    """Data-parallel gradient sync plus AdamW, with ZeRO stage 0, 1 or 2 sharding.

    ``named_params``: ``(name, parameter)`` pairs; they move into flat buckets.
    ``modules``: the model (or its pipeline chunks): needed for parameters on the
    meta device (they are replaced by ones living in the buckets) and to overlap
    the parameter all-gather with the next forward. ``values``: initial values
    (default: the parameters' own). ``precision``: compute and reduction dtypes.
    ``grad_reducer``: takes over the buckets' dp reductions (``EngineBase``).
    ``reduce_once``: stage 2 keeps full gradients over every backward of the step
    and reduce-scatters each bucket once, after its last one (under a pipeline,
    whose chunks run many micro-batches: torchtitan's pipeline x FSDP); without it
    a stage-2 bucket's full gradient lives from its first gradient until its
    reduce-scatter lands, in pooled buffers, and the shard accumulates the
    micro-steps. ``own_buckets``:
    names of parameters that get a bucket to themselves, so that their dp shards
    line up with a tied partner's on another stage (``tie_grad``).
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        dp_group,
        stage: int,
        adamw: AdamWConfig,
        bucket_cap_mb: float = 25.0,
        *,
        precision: Precision | None = None,
        modules: list[nn.Module] | None = None,
        values=None,
        device=None,
        grad_reducer=None,
        reduce_once: bool = False,
        own_buckets=(),
    ):
        if stage not in ZERO_STAGES:
            raise ValueError(f"stage must be one of {ZERO_STAGES}, got {stage!r}")
        named, seen = [], set()
        for n, p in named_params:
            if p.requires_grad and id(p) not in seen:  # a shared parameter is bucketed once
                seen.add(id(p))
                named.append((n, p))
        if not named:
            raise ValueError("no parameters that require grad")
        precision = precision or Precision.of(named[0][1].dtype)
        super().__init__(dp_group, stage, adamw, precision, grad_reducer)
        device = device or device_of(p for _, p in named)
        values = values or values_of(named)
        self._names = [n for n, _ in named]
        self._shapes = [p.shape for _, p in named]
        # One dtype and device for all (the engine's); weight decay is per parameter.
        # The cap is in bytes of gradient, as DDP's bucket_cap_mb.
        grad_bytes = precision.reduce_dtype.itemsize
        # Cross-stage ties (``meshwise.apply.parallelize`` marks them) are summed over
        # their group after dp; each gets a bucket of its own, so that at stage 2 its
        # dp shard lines up with its partner's (``tie_grad``).
        self._ties = tie_groups(named)
        own = set(own_buckets) | {named[i][0] for i, _ in self._ties}
        specs = [
            ParamSpec(n, p.numel(), grad_bytes, ("own", n) if n in own else None) for n, p in named
        ]
        self.reduce_once = reduce_once and stage == 2
        self.plan = BucketPlan(specs, bucket_cap_mb, pad_to=dp_group.size)
        self._slots = [self.plan.slots[n] for n in self._names]
        self._members: list[list[int]] = [[] for _ in self.plan.buckets]  # bucket -> params
        for i, slot in enumerate(self._slots):
            self._members[slot.bucket].append(i)
        self.flats = [self._make_flat(b, named, values, device) for b in self.plan.buckets]
        owners = param_owners(modules or [])
        self._params = [rebind(p, self._param_view(i), owners) for i, (_, p) in enumerate(named)]
        self._pool = BufferPool()
        self._grad_views: list[torch.Tensor | None] = [None] * len(self._params)
        self._full_grads: dict[int, torch.Tensor] = {}  # stage 2: buckets being reduced
        self._accumulate_by_hook = precision.reduce_dtype != precision.param_dtype
        self._fresh = [True] * len(self._params)  # its bucket part awaits this step's first
        if stage < 2:
            for b in range(len(self.flats)):
                self._set_views(b, self.flats[b].grad)
        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad_ready, i))
            for i, p in enumerate(self._params)
        ]
        self._gathers: list = [None] * len(self.flats)
        self._wait_in_forward = bool(modules) and stage > 0
        if modules and self._wait_in_forward:
            self._register_forward_waits(modules)
        self._sync_enabled = True
        self._warned_unused = False
        self._has_grad = [False] * len(self._params)  # got a gradient since zero_grad()
        self._reset_sync_state()
        self._connect_reducer()

    def _make_flat(self, bucket, named, values, device) -> FlatParams:
        params = dict(named)
        slots = [
            ParamSlot(
                n,
                params[n].shape,
                self.plan.slots[n].offset,
                params[n].numel(),
                decays(n, params[n]),
            )
            for n in bucket.names
        ]
        return FlatParams(slots, self.group, self.stage, self.precision, device, values)

    def _param_view(self, i: int) -> torch.Tensor:
        slot = self._slots[i]
        flat = self.flats[slot.bucket].params
        return flat[slot.offset : slot.offset + slot.numel].view(self._shapes[i])

    # ------------------------------------------------------------ gradient buffers
    def _set_views(self, b: int, grad_buf: torch.Tensor) -> None:
        """Bucket ``b``'s parameters' parts of ``grad_buf``, to be written by their first
        gradient."""
        for i in self._members[b]:
            slot = self._slots[i]
            self._grad_views[i] = grad_buf[slot.offset : slot.offset + slot.numel].view_as(
                self._params[i]
            )
            self._fresh[i] = True

    def _full_grad(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s full gradient buffer; stage 2 takes one when its first gradient
        of a backward arrives and gives it back once the reduction has landed."""
        if self.stage < 2:
            return self.flats[b].grad
        if b not in self._full_grads:
            self._full_grads[b] = self.flats[b].new_full_grad(self._pool)
            self._set_views(b, self._full_grads[b])
        return self._full_grads[b]

    @torch.no_grad()
    def _zero_unwritten(self, b: int) -> None:
        """Parts of bucket ``b`` no gradient reached since they were fresh hold zero."""
        for i in self._members[b]:
            view = self._grad_views[i]
            if self._fresh[i] and view is not None:
                view.zero_()
                self._fresh[i] = False
                if not self._accumulate_by_hook:
                    self._params[i].grad = view

    def _release_full_grad(self, b: int, buf: torch.Tensor) -> None:
        for i in self._members[b]:
            self._grad_views[i] = None
            self._params[i].grad = None
        self._pool.release(self._full_grads.pop(b))

    # ------------------------------------------------------------ state machine
    def _reset_sync_state(self) -> None:
        self._ready = [False] * len(self._params)  # got its gradient in the syncing backward
        self._seen = [False] * len(self._params)  # got a gradient since the last finish
        self._pending = [len(m) for m in self._members]
        self._handles: list = [None] * len(self.flats)
        self._next_launch = 0
        self._next_finish = 0
        self._backward_seen = False

    def _idle(self) -> bool:
        return not self._backward_seen and self._next_launch == 0

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        # A step's first gradient of a parameter is copied into its bucket (cast from
        # bf16 there), so buckets are never zeroed: zeroing and adding would read and
        # write it twice more. Later micro-batches add: autograd in place through
        # .grad (a view of the bucket), or this hook for another dtype. A parameter
        # that got no gradient is zeroed when its bucket is reduced.
        bucket = self._slots[index].bucket
        grad = param.grad
        self._full_grad(bucket)
        view = self._grad_views[index]
        assert grad is not None and view is not None, "a gradient hook fired without one"
        with torch.no_grad():
            if self._fresh[index] or (grad is not view and not self._accumulate_by_hook):
                # The step's first gradient (or autograd made a new tensor: .grad was
                # replaced or set to None, or create_graph): it is the bucket's value.
                if grad is not view:
                    view.copy_(grad)  # e.g. bf16 gradients cast into an fp32 bucket
                self._fresh[index] = False
            elif self._accumulate_by_hook:
                view.add_(grad)
        # Mixed dtypes: autograd makes the next gradient anew and the hook adds it.
        param.grad = None if self._accumulate_by_hook else view
        self._seen[index] = self._has_grad[index] = True
        if not self._sync_enabled:
            # Local accumulation may overlap a sync in progress (a pipeline's
            # chunks finish at different times), never into a bucket in flight.
            assert self._handles[bucket] is None, (
                f"gradient of {self._names[index]} arrived in no_sync() after its bucket's "
                "reduction started"
            )
            return
        assert not self._ready[index], (
            f"gradient of {self._names[index]} arrived twice before finish_grad_sync(); "
            "run one backward per sync (use no_sync() for the others)"
        )
        self._ready[index] = self._backward_seen = True
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        # Every rank must issue the same collectives in the same order: bucket k
        # starts only once it is complete and buckets < k have started.
        while self._next_launch < len(self._pending) and self._pending[self._next_launch] == 0:
            b = self._next_launch
            full_grad = self._full_grad(b)
            self._zero_unwritten(b)
            release = partial(self._release_full_grad, b) if self.stage == 2 else None
            self._handles[b] = self.flats[b].start_reduce(
                full_grad, self.grad_reducer, key=b, on_done=release
            )
            self._next_launch += 1
            if self.stage == 2:
                # Each reduction in flight holds a full bucket of gradient: finish the
                # older ones so backward keeps about two buckets, not the whole model.
                self._finish_launched(keep=MAX_INFLIGHT_REDUCTIONS)

    def _finish_launched(self, keep: int = 0) -> None:
        """Finish launched reductions, oldest first, until ``keep`` are in flight."""
        while self._next_launch - self._next_finish > keep:
            self._handles[self._next_finish].finish()
            self._next_finish += 1

    def finish_grad_sync(self) -> None:
        """Launch the buckets not started yet and wait for every reduction; then sum each
        cross-stage tie over its group."""
        self._finish_reductions()
        for i, group in self._ties:  # both copies of a tie take the same step
            ops.all_reduce(self.tie_grad(self._names[i]), group, category="grad")

    def _finish_reductions(self) -> None:
        assert self._sync_enabled, "finish_grad_sync() called inside no_sync()"
        assert self._backward_seen, (
            "finish_grad_sync() without a backward outside no_sync() since the last one"
        )
        unused = [n for n, seen in zip(self._names, self._seen) if not seen]
        if unused and not self._warned_unused:
            self._warned_unused = True
            # Their buckets (and every later one) could only start here, not during
            # backward; a parameter that is never used should not require grad.
            warnings.warn(
                f"parameters got no gradient this step (their gradient stays zero; "
                f"their buckets wait for finish_grad_sync()): {', '.join(unused)}",
                stacklevel=2,
            )
        self.wait_params()  # a bucket unused in forward: its gather must land first
        self._pending = [0] * len(self._pending)
        self._launch_in_order()
        self._finish_launched()
        self._reset_sync_state()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates into the buckets without communication.

        It may be entered while buckets of other parameters are being reduced
        (pipeline chunks whose last backward has passed); a gradient for a bucket
        already in flight is an error. Stage 2 keeps no full gradient between
        backwards: each one is reduce-scattered into the shard when this exits
        (unless ``reduce_once``: then its full gradients wait for the last).
        """
        assert self._sync_enabled, "no_sync() is not re-entrant"
        if self.stage == 2 and not self.reduce_once:
            yield
            self._finish_reductions()  # a tie is summed once, at the step's finish
            return
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def zero_grad(self) -> None:
        """Forget the accumulated gradients: the next ones overwrite the full buffers
        (stages 0-1: see _on_grad_ready); the shards (stage 2) are zeroed."""
        assert self._idle(), "zero_grad() while a gradient sync is in progress"
        if self.stage < 2:
            self._fresh = [True] * len(self._params)
            for param in self._params:
                param.grad = None  # autograd hands its new gradient to the hook
        else:
            for flat in self.flats:
                flat.shard_grad().zero_()
        self._seen = [False] * len(self._params)
        self._has_grad = [False] * len(self._params)

    def _gradient_flags(self) -> tuple[list[str], list[bool]]:
        return self._names, self._has_grad

    def grad_of(self, name: str) -> torch.Tensor:
        """The reduced full gradient of parameter ``name`` (stages 0-1 hold one)."""
        assert self.stage < 2, "stage 2 keeps gradient shards only"
        view = self._grad_views[self._names.index(name)]
        assert view is not None, f"{name}'s bucket has no gradient view"
        return view

    def tie_grad(self, name: str) -> torch.Tensor:
        """What a tie sums across its members: the full reduced gradient (stages 0-1),
        or the shard of the parameter's own bucket (stage 2, ``own_buckets``)."""
        if self.stage < 2:
            return self.grad_of(name)
        flat = self.flats[self._slots[self._names.index(name)].bucket]
        assert [s.name for s in flat.slots] == [name], f"{name} needs a bucket of its own"
        return flat.shard_grad()

    # ------------------------------------------------------------ parameters after a step
    def _publish(self) -> None:
        # Launched in forward order (the last bucket holds the first layers).
        for b in reversed(range(len(self.flats))):
            self._gathers[b] = self.flats[b].publish()
        if not self._wait_in_forward:
            self.wait_params()

    def wait_params(self) -> None:
        """Wait for every parameter all-gather still in flight."""
        for b, handle in enumerate(self._gathers):
            if handle is not None:
                handle.wait()
                self._gathers[b] = None

    def _register_forward_waits(self, modules: list[nn.Module]) -> None:
        bucket_of = {id(p): self._slots[i].bucket for i, p in enumerate(self._params)}
        for root in modules:
            for module in root.modules():
                buckets = sorted(
                    {
                        bucket_of[id(p)]
                        for p in module._parameters.values()
                        if p is not None and id(p) in bucket_of
                    }
                )
                if buckets:
                    module.register_forward_pre_hook(partial(self._wait_buckets, buckets))

    def _wait_buckets(self, buckets: list[int], module, args) -> None:
        for b in buckets:
            if self._gathers[b] is not None:
                self._gathers[b].wait()
                self._gathers[b] = None
