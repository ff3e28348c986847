"""One flat buffer of parameters sharded over dp: the core of every ZeRO stage.

A ``FlatParams`` holds some parameters back to back (padded to a multiple of the
dp size, cut by ``ShardPlan``) with what a rank keeps of them (Rajbhandari et al.
2020, "ZeRO", section 5; FSDP's flat parameter, Zhao et al. 2023):

===== ======================= ============================ ========================
stage compute parameters      fp32 master + AdamW moments  gradient kept
===== ======================= ============================ ========================
0     full, persistent        full                         full, all-reduced
1     full, persistent        this rank's shard            full, all-reduced
2     full, persistent        this rank's shard            shard, reduce-scattered
3     gathered when used only this rank's shard            shard, reduce-scattered
===== ======================= ============================ ========================

The gradient buckets (stages 0-2, ``meshwise.sharding.buckets``) and the ZeRO-3
units (``meshwise.sharding.zero3``) are lists of these; the update, the norm,
the collectives and the checkpoint view are written once, here.

Precision (``Precision``): parameters compute in ``param_dtype``; the master
copy the optimizer updates and AdamW's moments are always fp32, as in
mixed-precision training (Micikevicius et al. 2018). With fp32 compute the
master *is* the compute buffer's own range (no copy); with bf16 it is a separate
fp32 tensor, cast into the compute buffer after each step. Gradients are reduced
in ``reduce_dtype`` and accumulated in fp32 once they are a shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshwise.comm import ops, policy
from meshwise.geometry.flat_runs import FlatRun
from meshwise.sharding.adamw import squared_sum
from meshwise.sharding.plans import ShardPlan


@dataclass(frozen=True)
class Precision:
    """Dtypes of compute parameters and of gradient reduction; the master copy and
    the optimizer state are at least fp32 (float64 models stay float64)."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, dtype: torch.dtype) -> "Precision":
        """Everything in ``dtype`` (no mixed precision)."""
        return cls(dtype, dtype)

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.promote_types(self.param_dtype, torch.float32)

    @property
    def mixed(self) -> bool:
        return self.param_dtype != self.master_dtype


@dataclass(frozen=True)
class ParamSlot:
    """A parameter inside the flat buffer: ``[offset, offset + numel)``."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    decays: bool


class PendingReduce:
    """A gradient reduction in flight; ``finish()`` exactly once."""

    def __init__(self, flat: "FlatParams", handle, full_grad: torch.Tensor, out=None, on_done=None):
        self.flat, self._handle = flat, handle
        self._full: torch.Tensor | None = full_grad
        self._out: torch.Tensor | None = out
        self._on_done = on_done

    def finish(self) -> None:
        full, out = self._full, self._out
        assert full is not None, "a reduction finished twice"
        self._handle.wait()
        if self.flat.stage >= 2:  # accumulate our chunk into the fp32 shard
            s0, s1 = self.flat.shard_range
            chunk = full[s0:s1] if out is None else out
            self.flat.reduce_across_replicas(chunk)
            self.flat.shard_grad().add_(chunk)
        else:
            self.flat.reduce_across_replicas(full)
        if self._on_done is not None:
            self._on_done(full)
        self._full = self._out = None


class FlatParams:
    """Parameters ``slots`` in one flat buffer over ``group`` at ZeRO ``stage``.

    ``values(name, start, end)`` gives elements ``[start, end)`` of a parameter's
    (flattened) initial value; only what this rank keeps is asked for. ``frozen``
    (stage 3): parameters that never train keep only their shard, in the compute
    dtype, with no gradient or optimizer state.
    """

    def __init__(
        self,
        slots: list[ParamSlot],
        group,
        stage: int,
        precision: Precision,
        device,
        values,
        frozen: bool = False,
    ):
        assert stage == 3 or not frozen, "only stage 3 holds frozen parameters"
        self.slots, self.group, self.stage, self.precision = slots, group, stage, precision
        self.frozen = frozen
        # Hybrid sharding: the ranks holding this shard in the other replicas (None: one).
        self.replicate_group = None
        self.replica_reducer = None  # (GradReducer, key) of --compress / --allreduce across them
        self.numel = sum(s.numel for s in slots)
        self.plan = ShardPlan(self.numel, group.size)
        self.shard_range = self.plan.shard_range(group.rank)
        self.update_range = (0, self.numel) if stage == 0 else self.plan.owned_range(group.rank)
        lo, hi = self.update_range
        self.device = device
        fp32 = precision.master_dtype
        self.params: torch.Tensor | None = None  # the persistent compute buffer (stages 0-2)
        if stage < 3:
            self.params = torch.zeros(
                self.plan.padded_numel, dtype=precision.param_dtype, device=device
            )
            self._fill(self.params, 0, self.numel, values)
        if self.params is not None and not precision.mixed:
            self.master = self.params[lo:hi]  # the optimizer updates the compute values
        else:  # stage 3 keeps its whole (padded) shard: the all-gather's input
            size = hi - lo if stage < 3 else self.plan.shard_numel
            kept = precision.param_dtype if frozen else fp32  # frozen: nothing to update
            self.master = torch.zeros(size, dtype=kept, device=device)
            self._fill(self.master, lo, hi, values)
        state = 0 if frozen else hi - lo
        self.exp_avg = torch.zeros(state, dtype=fp32, device=device)
        self.exp_avg_sq = torch.zeros(state, dtype=fp32, device=device)
        # the reduced gradient: whole (stages 0-1, ``grad``) or this rank's shard (2-3)
        self.grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self._all_pieces: list[tuple] | None = None  # update_pieces() of every parameter
        if stage < 2:
            self.grad = torch.zeros(
                self.plan.padded_numel, dtype=precision.reduce_dtype, device=device
            )
        elif not frozen:
            self.grad_shard = torch.zeros(self.plan.shard_numel, dtype=fp32, device=device)

    def _overlaps(self, lo: int, hi: int):
        """``(slot, a, b)``: each parameter's part ``[a, b)`` inside ``[lo, hi)``, in order."""
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                yield slot, a, b

    def _fill(self, dst: torch.Tensor, start: int, end: int, values) -> None:
        """``dst`` holds buffer elements ``[start, ...)``: fill ``[start, end)`` from ``values``."""
        with torch.no_grad():
            for slot, a, b in self._overlaps(start, end):
                dst[a - start : b - start].copy_(
                    values(slot.name, a - slot.offset, b - slot.offset)
                )

    # ------------------------------------------------------------ gradients
    def new_full_grad(self, pool) -> torch.Tensor:
        """A full-size gradient buffer (stages 2-3: only while reducing) whose padding is
        zero; the caller writes every parameter's part before reducing it."""
        buf = pool.acquire(self.plan.padded_numel, self.precision.reduce_dtype, self.device)
        buf[self.numel :].zero_()
        return buf

    def start_reduce(
        self, full_grad: torch.Tensor, reducer=None, key=None, on_done=None
    ) -> PendingReduce:
        """Sum ``full_grad`` over dp: in place (stages 0-1) or into our shard (2-3)."""
        scatter = self.stage >= 2
        if reducer is not None:
            handle = reducer.start(key, full_grad, self.shard_range if scatter else None)
            return PendingReduce(self, handle, full_grad, on_done=on_done)
        # A group of one: the all-reduce returns at once and its shard is all of it.
        if not scatter or self.group.size == 1 or policy.reduce_scatter_by_all_reduce(self.group):
            handle = ops.all_reduce(full_grad, self.group, category="grad", async_op=True)
            return PendingReduce(self, handle, full_grad, on_done=on_done)
        out = torch.empty(self.plan.shard_numel, dtype=full_grad.dtype, device=self.device)
        handle = ops.reduce_scatter(out, full_grad, self.group, category="grad", async_op=True)
        return PendingReduce(self, handle, full_grad, out, on_done=on_done)

    def reduce_across_replicas(self, grad: torch.Tensor) -> None:
        """Sum a gradient reduced within this replica over the replicas, in place: the
        shard only at stages 2-3 (1/N of the bytes), the whole buffer at stages 0-1."""
        if self.replica_reducer is not None:
            reducer, key = self.replica_reducer
            reducer.start(key, grad).wait()
        elif self.replicate_group is not None and self.replicate_group.size > 1:
            ops.all_reduce(grad, self.replicate_group, category="grad")

    def replica_layout(self) -> list[tuple[int, tuple[int, ...]]]:
        """``[(offset, shape)]`` of the parameters whole inside what crosses the replicas
        (the shard at stages 2-3, offsets from its start; the buffer at 0-1): PowerSGD
        compresses those matrices and sends a parameter cut by the shard's edge as is."""
        lo, hi = self.shard_range if self.stage >= 2 else (0, self.numel)
        return [
            (s.offset - lo, tuple(s.shape))
            for s in self.slots
            if lo <= s.offset and s.offset + s.numel <= hi
        ]

    def full_grad(self) -> torch.Tensor:
        """The whole reduced-gradient buffer (stages 0-1)."""
        assert self.grad is not None, f"stage {self.stage} keeps a gradient shard"
        return self.grad

    def shard_grad(self) -> torch.Tensor:
        """This rank's fp32 shard of the reduced gradient (stages 2-3)."""
        assert self.grad_shard is not None, f"stage {self.stage} keeps the whole gradient"
        return self.grad_shard

    def owned_grad(self) -> torch.Tensor:
        """The reduced gradient of ``update_range`` (the full buffer's part, or the shard)."""
        lo, hi = self.update_range
        return self.full_grad()[lo:hi] if self.stage < 2 else self.shard_grad()[: hi - lo]

    def held_grads(self, names: set[str]) -> list[torch.Tensor]:
        """Views of the reduced gradient this rank holds of the parameters ``names``, in
        buffer order (stages 0-1: whole parameters; 2-3: their parts in the shard).
        Ranks whose buffers hold the same parameters at the same offsets (tp ranks
        of one dp rank) get views of the same elements."""
        if self.stage < 2:
            grad = self.full_grad()
            return [grad[s.offset : s.offset + s.numel] for s in self.slots if s.name in names]
        lo, hi = self.update_range
        shard = self.shard_grad()
        return [
            shard[a - lo : b - lo] for slot, a, b in self._overlaps(lo, hi) if slot.name in names
        ]

    def grad_sq_sum(self, include=None) -> torch.Tensor:
        """Sum of squared reduced-gradient elements this rank holds (stages 0-1: the
        whole buffer, complete; 2-3: the shard, to be summed over dp).

        One pass over the whole buffer, less the parameters ``include`` leaves out
        (few: replicas counted on another rank), each subtracted in float64."""
        lo, hi = (0, self.numel) if self.stage < 2 else self.update_range
        grad = self.full_grad()[: self.numel] if self.stage < 2 else self.shard_grad()[: hi - lo]
        total = squared_sum(_upcast(grad))
        if include is not None:
            for slot, a, b in self._overlaps(lo, hi):
                if not include(slot.name):
                    total = total - squared_sum(_upcast(grad[a - lo : b - lo]))
        return total

    # ------------------------------------------------------------ update
    def update_pieces(self, used: set[str] | None = None) -> list[tuple]:
        """What AdamW updates here: ``(decays, master, grad, exp_avg, exp_avg_sq)``, views
        of each parameter's part of ``update_range``, leaving out parameters not in
        ``used`` (no gradient; ``None``: all got one). Gradients reduced in another
        dtype (bf16) are cast once, for the whole buffer.

        A piece per parameter, not runs of several: the fused kernel's rounding
        differs in a tensor's last few elements (its vector loop's remainder), so
        a whole parameter takes exactly ``torch.optim.AdamW(fused=True)``'s step."""
        grad = self.owned_grad()
        cast = grad.dtype != self.master.dtype
        if used is None and not cast and self._all_pieces is not None:
            return self._all_pieces  # views of buffers kept for the engine's life
        if cast:
            grad = grad.to(self.master.dtype)
        lo, hi = self.update_range
        pieces = [
            (
                slot.decays,
                self.master[a - lo : b - lo],
                grad[a - lo : b - lo],
                self.exp_avg[a - lo : b - lo],
                self.exp_avg_sq[a - lo : b - lo],
            )
            for slot, a, b in self._overlaps(lo, hi)
            if used is None or slot.name in used
        ]
        if used is None and not cast:
            self._all_pieces = pieces
        return pieces

    # ------------------------------------------------------------ parameters
    def whole_params(self) -> torch.Tensor | None:
        """The compute parameters themselves where this rank's shard is all of them, in
        the compute dtype (stage 3 over a group of one, without mixed precision): a
        unit then uses them as they are, with nothing to gather or copy. Else None."""
        whole = self.stage == 3 and self.group.size == 1
        if whole and self.master.dtype == self.precision.param_dtype:
            return self.master
        return None

    def publish(self, buf: torch.Tensor | None = None):
        """Make the updated values visible in a compute buffer: ``buf`` (stage 3's
        gathered buffer) or the persistent one, cast from the master copy in one
        operation. Stages 1-3 all-gather over dp (returns its ``Handle``); stage 0
        and a group of one hold everything already (None)."""
        buf = self.params if buf is None else buf
        assert buf is not None, "stage 3 publishes into a gathered buffer"
        lo, hi = self.update_range
        if self.stage == 3:
            s0, s1 = self.shard_range
            buf[s0:s1].copy_(self.master)  # cast to the compute dtype
        elif self.precision.mixed:
            buf[lo:hi].copy_(self.master)
        if self.stage == 0 or self.group.size == 1:
            return None
        return self._all_gather_in_place(buf)

    def own_shard_only(self, buf: torch.Tensor) -> None:
        """Stage 3: ``buf`` holds this rank's shard (cast from the master) and zeros
        elsewhere, so that its sum over dp is every parameter (``x + 0`` is exact): the
        gather as an all-reduce, whose caller may sum several such buffers at once."""
        s0, s1 = self.shard_range
        buf[s0:s1].copy_(self.master)
        self._zero_others(buf)

    def _zero_others(self, buf: torch.Tensor) -> None:
        s0, s1 = self.shard_range
        buf[:s0].zero_()
        buf[s1:].zero_()

    def _all_gather_in_place(self, buf: torch.Tensor):
        s0, s1 = self.shard_range
        if policy.all_gather_by_all_reduce(self.group):
            self._zero_others(buf)  # x + 0 is exact: the sum is the owners' values
            return ops.all_reduce(buf, self.group, category="param", async_op=True)
        # In place: the input is this rank's chunk of the output (NCCL and gloo accept it).
        return ops.all_gather(buf, buf[s0:s1], self.group, category="param", async_op=True)

    # ------------------------------------------------------------ checkpoint, memory
    def checkpoint_run(self) -> FlatRun:
        """This buffer as a checkpoint sees it: the rank writes its dp shard of the
        fp32 parameters and of both moments."""
        lo = self.update_range[0]
        # fp32 stages 0-2 update the compute buffer itself: every rank loads all of it.
        shared = self.stage < 3 and not self.precision.mixed
        param = (self.params, 0) if shared and self.params is not None else (self.master, lo)
        save = self.plan.owned_range(self.group.rank)
        if self.replicate_group is not None and self.replicate_group.rank > 0:
            save = (save[0], save[0])  # the first replica writes; every replica loads
        return FlatRun(
            [(s.name, s.offset, s.numel) for s in self.slots],
            save,
            {"param": param, "exp_avg": (self.exp_avg, lo), "exp_avg_sq": (self.exp_avg_sq, lo)},
        )

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor kept between steps (views share their storage)."""
        kept = [self.params, self.master, self.exp_avg, self.exp_avg_sq, self.grad, self.grad_shard]
        return [t for t in kept if t is not None]


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 (a norm summed in bf16 would lose most of its bits)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()
