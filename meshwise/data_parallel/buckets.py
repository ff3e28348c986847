"""Gradient buckets for data parallelism: plan (pure) and runtime.

``BucketPlan`` packs parameters into flat buckets in reverse registration order,
because backward produces gradients roughly back to front (Li et al. 2020,
"PyTorch Distributed", section 3.2.3). ``GradBuckets`` owns one flat parameter
buffer and one flat gradient buffer per bucket, makes every parameter's
``.data`` and ``.grad`` views into them, and starts a bucket's reduction from a
post-accumulate-grad hook as soon as its last gradient arrives, so communication
overlaps the rest of backward (Megatron-LM's ``start_grad_sync`` /
``finish_grad_sync`` buckets).

Gradients are SUMMED over dp, never averaged: each micro-batch loss is already
divided by the global token count, so the sum is the gradient of the global mean.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Hashable, Iterable, Sequence

import torch

from meshwise.comm import ops
from meshwise.zero.partition import ShardPlan

REDUCE_MODES = ("all_reduce", "reduce_scatter")


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about a parameter."""

    name: str
    numel: int
    element_size: int
    group_key: Hashable = None  # buckets never mix keys, e.g. (dtype, device, decays)


@dataclass(frozen=True)
class Slot:
    """Where a parameter lives: ``[offset, offset + numel)`` of bucket ``bucket``."""

    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    index: int
    names: tuple[str, ...]  # in buffer order, i.e. reverse registration order
    group_key: Hashable
    numel: int  # real elements
    padded_numel: int  # numel rounded up to a multiple of pad_to


class BucketPlan:
    """Assignment of parameters to flat buckets (pure; no process groups).

    Parameters are visited in reverse registration order. Each group key has one
    open bucket; a parameter joins its key's open bucket unless that would pass
    ``bucket_cap_mb`` (MiB), in which case the open bucket is closed first. A
    parameter larger than the cap thus gets a bucket alone. Buckets are numbered
    by when they become complete in a back-to-front backward (the position of
    their last member), which is the order they are launched in. Each bucket's
    length is padded to a multiple of ``pad_to`` (the dp size) so ZeRO can cut
    it into equal shards with ``ShardPlan``.
    """

    def __init__(self, params: Sequence[ParamSpec], bucket_cap_mb: float, pad_to: int = 1):
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to!r}")
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique")
        cap_bytes = bucket_cap_mb * 2**20
        open_buckets: dict[Hashable, list[ParamSpec]] = {}
        used_bytes: dict[Hashable, int] = {}
        closed: list[list[ParamSpec]] = []
        for spec in reversed(params):
            key, nbytes = spec.group_key, spec.numel * spec.element_size
            if key in open_buckets and used_bytes[key] + nbytes > cap_bytes:
                closed.append(open_buckets.pop(key))
            if key not in open_buckets:
                open_buckets[key], used_bytes[key] = [], 0
            open_buckets[key].append(spec)
            used_bytes[key] += nbytes
            if used_bytes[key] >= cap_bytes:
                closed.append(open_buckets.pop(key))
        closed.extend(open_buckets.values())
        # Launch order = completion order: sort by the reverse position of the last member.
        position = {name: i for i, name in enumerate(reversed(names))}
        closed.sort(key=lambda members: position[members[-1].name])

        self.pad_to = pad_to
        self.buckets: list[Bucket] = []
        self.slots: dict[str, Slot] = {}
        for index, members in enumerate(closed):
            offset = 0
            for spec in members:
                self.slots[spec.name] = Slot(index, offset, spec.numel)
                offset += spec.numel
            padded = -(-offset // pad_to) * pad_to
            self.buckets.append(Bucket(index, tuple(p.name for p in members),
                                       members[0].group_key, offset, padded))

    def __repr__(self) -> str:
        sizes = ", ".join(str(b.padded_numel) for b in self.buckets)
        return f"BucketPlan({len(self.buckets)} buckets: [{sizes}] elements)"


class GradBuckets:
    """Flat parameter/gradient buffers per bucket, reduced over dp during backward.

    ``reduce="all_reduce"``: every rank ends with the full summed gradient in the
    bucket views (``param.grad``). ``reduce="reduce_scatter"``: every rank ends
    with only its ``ShardPlan`` slice of each bucket (``_grad_shards``), which
    accumulates over micro-steps; the full-size gradient buffers exist only
    during a backward and until its reduction lands, and ``param.grad`` is None
    between steps (ZeRO stage 2). There ``no_sync()`` still communicates: it
    reduces its micro-step into the shard when it exits.

    Protocol per optimizer step: ``zero_grad()``; micro-steps whose backward runs
    under ``no_sync()`` accumulate locally; the last backward runs outside it and
    launches each bucket as it completes; ``finish_grad_sync()`` launches what is
    left and waits for everything.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], dp_group,
                 bucket_cap_mb: float = 25.0, reduce: str = "all_reduce"):
        if reduce not in REDUCE_MODES:
            raise ValueError(f"reduce must be one of {', '.join(REDUCE_MODES)}, got {reduce!r}")
        named, seen = [], set()
        for n, p in named_params:
            if p.requires_grad and id(p) not in seen:  # a shared parameter is bucketed once
                seen.add(id(p))
                named.append((n, p))
        if not named:
            raise ValueError("no parameters that require grad")
        self.dp_group = dp_group
        self.reduce = reduce
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        specs = [ParamSpec(n, p.numel(), p.element_size(), self._group_key(n, p)) for n, p in named]
        self.plan = BucketPlan(specs, bucket_cap_mb, pad_to=dp_group.size)
        self._slots = [self.plan.slots[n] for n in self._names]
        self._members = [[] for _ in self.plan.buckets]  # bucket -> param indices
        for i, slot in enumerate(self._slots):
            self._members[slot.bucket].append(i)
        self._shard_plans = [ShardPlan(b.padded_numel, dp_group.size) for b in self.plan.buckets]
        # Gloo's reduce_scatter_tensor is slower than its all_reduce (2 ranks, 2 cores:
        # 16 MiB 32.8 vs 21.2 ms, 64 MiB 121 vs 54 ms; never faster at 1-4 MiB), so on
        # gloo a reduce-scatter is an all-reduce followed by taking our slice.
        self._rs_via_all_reduce = ops.backend(dp_group) == "gloo"
        self._param_bufs = self._flatten_params()
        self._grad_bufs: list[torch.Tensor] | None = None
        self._grad_views: list[torch.Tensor | None] = [None] * len(self._params)
        self._grad_shards: list[torch.Tensor] = []
        if reduce == "all_reduce":
            self._allocate_grad_buffers()
        else:
            self._grad_shards = [torch.zeros(sp.shard_numel, dtype=buf.dtype, device=buf.device)
                                 for sp, buf in zip(self._shard_plans, self._param_bufs)]
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._on_grad_ready, i))
                       for i, p in enumerate(self._params)]
        self._sync_enabled = True
        self._warned_unused = False
        self._has_grad = [False] * len(self._params)  # got a gradient since zero_grad()
        self._reset_sync_state()

    def _group_key(self, name: str, param: torch.Tensor) -> Hashable:
        """Parameters that may share a flat buffer. Subclasses refine it."""
        return (param.dtype, param.device)

    # ---------------------------------------------------------------- buffers
    @torch.no_grad()
    def _flatten_params(self) -> list[torch.Tensor]:
        bufs = []
        for bucket, members in zip(self.plan.buckets, self._members):
            first = self._params[members[0]]
            buf = torch.zeros(bucket.padded_numel, dtype=first.dtype, device=first.device)
            for i in members:
                slot, param = self._slots[i], self._params[i]
                view = buf[slot.offset:slot.offset + slot.numel].view_as(param)
                view.copy_(param)  # keep the values; then the parameter lives in the bucket
                param.data = view
            bufs.append(buf)
        return bufs

    def _allocate_grad_buffers(self) -> None:
        """Zeroed flat gradient buffers; point every ``.grad`` at its view so that
        autograd accumulates in place (it does ``grad += new`` when grad is set)."""
        self._grad_bufs = [torch.zeros_like(buf) for buf in self._param_bufs]
        for i, (slot, param) in enumerate(zip(self._slots, self._params)):
            view = self._grad_bufs[slot.bucket][slot.offset:slot.offset + slot.numel]
            self._grad_views[i] = view.view_as(param)
            param.grad = self._grad_views[i]

    def _release_grad_buffers(self) -> None:
        for param in self._params:
            param.grad = None
        self._grad_views = [None] * len(self._params)
        self._grad_bufs = None

    # ------------------------------------------------------------ state machine
    def _reset_sync_state(self) -> None:
        self._ready = [False] * len(self._params)  # got its gradient in the syncing backward
        self._seen = [False] * len(self._params)  # got a gradient since the last finish
        self._pending = [len(m) for m in self._members]
        self._handles: list = [None] * len(self.plan.buckets)
        self._rs_outputs: list = [None] * len(self.plan.buckets)
        self._next_launch = 0
        self._backward_seen = False

    def _idle(self) -> bool:
        return not self._backward_seen and self._next_launch == 0

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        grad, view = param.grad, self._grad_views[index]
        if view is None:  # reduce_scatter mode: first gradient of this window
            self._allocate_grad_buffers()  # later gradients accumulate in place
            view = self._grad_views[index]
        if grad is not view:
            # Autograd made a new tensor (no buffer yet, .grad was replaced or set
            # to None, or create_graph): copy it into the bucket.
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view
        self._seen[index] = True
        self._has_grad[index] = True
        bucket = self._slots[index].bucket
        if not self._sync_enabled:
            # Local accumulation may overlap a sync in progress (a pipeline's
            # chunks finish at different times), never into a bucket in flight.
            assert self._handles[bucket] is None, (
                f"gradient of {self._names[index]} arrived in no_sync() after its bucket's "
                "reduction started")
            return
        assert not self._ready[index], (
            f"gradient of {self._names[index]} arrived twice before finish_grad_sync(); "
            "run one backward per sync (use no_sync() for the others)")
        self._ready[index] = True
        self._backward_seen = True
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        # Every rank must issue the same collectives in the same order: bucket k
        # starts only once it is complete and buckets < k have started.
        while self._next_launch < len(self._pending) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    # --compress / --allreduce: a ``meshwise.comm.reducer.GradReducer`` set by the trainer
    # takes over each bucket's reduction; its result lands in the bucket (or our shard of it).
    grad_reducer = None

    def _launch(self, b: int) -> None:
        buf = self._grad_bufs[b]
        if self.grad_reducer is not None:
            shard = (self._shard_plans[b].shard_range(self.dp_group.rank)
                     if self.reduce == "reduce_scatter" else None)
            self._handles[b] = self.grad_reducer.start(b, buf, shard)
        elif self.reduce == "all_reduce" or self._rs_via_all_reduce:
            self._handles[b] = ops.all_reduce(buf, self.dp_group, category="grad", async_op=True)
        else:  # into a fresh output, added to the shard when it lands
            self._rs_outputs[b] = torch.empty_like(self._grad_shards[b])
            self._handles[b] = ops.reduce_scatter(self._rs_outputs[b], buf, self.dp_group,
                                                  category="grad", async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch the buckets not started yet and wait for every reduction."""
        assert self._sync_enabled, "finish_grad_sync() called inside no_sync()"
        assert self._backward_seen, (
            "finish_grad_sync() without a backward outside no_sync() since the last one")
        unused = [n for n, seen in zip(self._names, self._seen) if not seen]
        if unused and not self._warned_unused:
            self._warned_unused = True
            # Their buckets (and every later one) could only start here, not during
            # backward; a parameter that is never used should not require grad.
            warnings.warn(f"parameters got no gradient this step (their gradient stays zero; "
                          f"their buckets wait for finish_grad_sync()): {', '.join(unused)}",
                          stacklevel=2)
        self._pending = [0] * len(self._pending)
        self._launch_in_order()
        for b, handle in enumerate(self._handles):
            handle.wait()
            if self.reduce == "reduce_scatter":  # accumulate into the shard
                start, end = self._shard_plans[b].shard_range(self.dp_group.rank)
                reduced = (self._grad_bufs[b][start:end] if self._rs_outputs[b] is None
                           else self._rs_outputs[b])
                self._grad_shards[b].add_(reduced)
                self._rs_outputs[b] = None
        if self.reduce == "reduce_scatter":
            self._release_grad_buffers()
        self._reset_sync_state()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates into the buckets without communication.

        It may be entered while buckets of other parameters are being reduced
        (pipeline chunks whose last backward has passed); a gradient for a bucket
        already in flight is an error.
        """
        assert self._sync_enabled, "no_sync() is not re-entrant"
        if self.reduce == "reduce_scatter":
            # Only the gradient shard may persist (ZeRO-2): every micro-step is
            # reduce-scattered into it, as DeepSpeed's stage 2 does, instead of
            # accumulating a full-size gradient locally.
            yield
            self.finish_grad_sync()
            return
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def zero_grad(self) -> None:
        """Zero the accumulated gradients (the flat buffers, or the shards)."""
        assert self._idle(), "zero_grad() while a gradient sync is in progress"
        if self.reduce == "all_reduce":
            for buf in self._grad_bufs:
                buf.zero_()
        else:
            self._release_grad_buffers()
            for shard in self._grad_shards:
                shard.zero_()
        self._seen = [False] * len(self._params)
        self._has_grad = [False] * len(self._params)

    def params_with_grad(self) -> list[bool]:
        """Per parameter: whether any dp rank gave it a gradient since ``zero_grad()``
        (a collective: every dp rank must call it, and all get the same answer)."""
        flags = torch.tensor(self._has_grad, dtype=torch.float32,
                             device=self._param_bufs[0].device)
        ops.all_reduce(flags, self.dp_group, op="max", category="check")
        return flags.bool().tolist()
