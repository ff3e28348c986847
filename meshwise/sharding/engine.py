"""The engine protocol, and what the ZeRO 0-2 and ZeRO-3 engines share.

An engine owns a model's parameters as a list of ``FlatParams`` (``self.flats``)
and offers the trainer one protocol, whatever the stage:

- ``zero_grad()``; backward(s), all but the last under ``no_sync()``;
  ``finish_grad_sync()`` (reductions were started during backward);
- ``grad_sq_norm(include)``: the squared global gradient norm over dp;
- ``held_grads(names)``: views of the reduced gradients it holds of ``names``;
- ``step(lr, grad_scale, skip)``: AdamW on what this rank owns, then the
  updated values are published to the compute parameters (an all-gather that
  may still be in flight: ``wait_params()`` before reading them outside a
  forward); ``grad_scale`` and ``skip`` may be tensors on the device, so a step
  needs no host read;
- ``checkpoint_runs()``, ``load_done()``, ``state_bytes()``, ``step_count``.
"""

from __future__ import annotations

import torch

from meshwise.comm import ops
from meshwise.device.clocks import host_to_device
from meshwise.geometry.flat_runs import FlatRun
from meshwise.sharding.adamw import AdamWConfig, adamw_update


class EngineBase:
    """Optimizer step, norm, checkpoint view and memory over ``self.flats``.

    ``grad_reducer``: a ``meshwise.comm.allreduce.reducer.GradReducer`` (``--compress``,
    ``--allreduce``) that takes over each flat buffer's dp reduction; ``None``:
    the group's native collectives. Each engine calls ``_connect_reducer()``
    once its flat buffers exist.
    """

    def __init__(self, group, stage: int, adamw: AdamWConfig, precision, grad_reducer=None):
        self.group, self.stage, self.adamw, self.precision = group, stage, adamw, precision
        self.grad_reducer = grad_reducer
        self.step_count = 0
        self.flats: list = []
        self.replicate_group = None  # hybrid sharding: ``replicate_over``

    def _connect_reducer(self) -> None:
        """Tell the reducer which parameters each buffer holds (PowerSGD compresses
        the matrices among them)."""
        if self.grad_reducer is not None:
            self.grad_reducer.set_layouts(self.reduction_layouts())

    def replicate_over(self, group, reducer=None) -> None:
        """Hybrid sharding: ``self.group`` is one replica; each shard's gradient is then
        summed over ``group``, the ranks holding the same shard in the other replicas
        (after the reduction within the replica), and the first replica saves.
        ``reducer``: a ``GradReducer`` over ``group`` (``--compress``, ``--allreduce``)
        for that sum, keyed by buffer; ``None``: the group's native all-reduce."""
        self.replicate_group = group
        for key, flat in enumerate(self.flats):
            flat.replicate_group = group
            if reducer is not None:
                flat.replica_reducer = (reducer, key)
        if reducer is not None:
            reducer.set_layouts({key: flat.replica_layout() for key, flat in enumerate(self.flats)})

    # -- to be provided by each engine -------------------------------------------------
    def _idle(self) -> bool:
        raise NotImplementedError

    def _gradient_flags(self) -> tuple[list[str], list[bool]]:
        """Each parameter's name, and whether it got a gradient here since ``zero_grad()``."""
        raise NotImplementedError

    def _used_names(self) -> set[str] | None:
        """Parameters any dp rank gave a gradient since ``zero_grad()``; ``None`` when
        this rank gave every one a gradient (then so did the group). A collective:
        every rank reduces the flags, but only a rank that lacks a gradient reads
        them on the host."""
        names, flags = self._gradient_flags()
        used = host_to_device(flags, torch.float32, self.flats[0].device)
        ops.all_reduce(used, self.group, op="max", category="check")
        if self.replicate_group is not None:  # the replicas must skip the same parameters
            ops.all_reduce(used, self.replicate_group, op="max", category="check")
        if all(flags):
            return None
        return {name for name, flag in zip(names, used.tolist()) if flag}

    def _before_update(self) -> None:
        """Gradients must be complete before the norm and the update."""
        assert self._idle(), "the gradient sync is still in progress: call finish_grad_sync()"

    def _publish(self) -> None:
        """Start making the updated master values the compute parameters."""

    def wait_params(self) -> None:
        """Wait until the compute parameters hold the latest values."""

    # -- shared --------------------------------------------------------------------------
    @torch.no_grad()
    def grad_sq_norm(self, include=None, over_dp: bool = True) -> torch.Tensor:
        """Sum of squared reduced-gradient elements over the parameters, complete over dp.

        ``include(name)`` picks which parameters count (e.g. tp-replicated ones
        on one tp rank only). Sharded gradients (stages 2-3) are summed over dp, so
        every dp rank must call it; with ``over_dp=False`` the caller sums them (at
        stages 0-1 every dp rank's value is already the whole).
        """
        self._before_update()
        total = torch.zeros((), dtype=torch.float64, device=self.flats[0].device)
        for flat in self.flats:
            total += flat.grad_sq_sum(include)
        if self.stage >= 2 and over_dp:
            ops.all_reduce(total, self.group, category="norm")
        return total

    def held_grads(self, names: set[str]) -> list[torch.Tensor]:
        """Views of the reduced gradients of ``names`` this rank holds (whole or its
        shard's part), in a fixed order: to complete them over another axis."""
        self._before_update()
        return [view for flat in self.flats for view in flat.held_grads(names)]

    @torch.no_grad()
    def step(self, lr: float, grad_scale=1.0, skip: torch.Tensor | None = None) -> None:
        """AdamW on what this rank owns, gradients times ``grad_scale`` (clipping).

        A parameter that got no gradient since ``zero_grad()`` on any dp rank is
        left alone, moments and weight decay included, as ``torch.optim.AdamW``
        skips a parameter whose ``.grad`` is None. ``skip``: a 0-dim bool tensor
        on the device; where true, the step changes nothing (a non-finite step,
        found without a host read; the caller then calls ``unstep()``). One fused
        kernel per weight decay updates every buffer (``adamw_update``); then the
        values are published (mixed precision: one cast per buffer).
        """
        self._before_update()
        self.wait_params()
        self.step_count += 1
        used = self._used_names()
        pieces = [piece for flat in self.flats for piece in flat.update_pieces(used)]
        decay = self.adamw.weight_decay
        for decays in (True, False) if decay else (None,):
            chosen = [piece[1:] for piece in pieces if decays is None or piece[0] == decays]
            if chosen:
                params, grads, exp_avgs, exp_avg_sqs = (list(t) for t in zip(*chosen))
                adamw_update(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    self.step_count,
                    lr,
                    self.adamw,
                    weight_decay=decay if decays is not False else 0.0,
                    grad_scale=grad_scale,
                    skip=skip,
                )
        self._publish()

    def unstep(self) -> None:
        """The last ``step`` was skipped on the device: its count does not advance
        AdamW's bias correction (as a step ``torch.optim.AdamW`` never took)."""
        self.step_count -= 1

    def checkpoint_runs(self) -> list[FlatRun]:
        """Each flat buffer as a checkpoint sees it (this rank's dp shard of the fp32
        parameters and of AdamW's moments)."""
        self.wait_params()
        return [flat.checkpoint_run() for flat in self.flats]

    @torch.no_grad()
    def load_done(self) -> None:
        """Values were written into ``checkpoint_runs()``' tensors: publish them."""
        handles = [flat.publish() for flat in self.flats if flat.stage < 3]
        for handle in handles:
            if handle is not None:
                handle.wait()

    def reduction_layouts(self) -> dict:
        """``{key: [(offset, shape), ...]}``: the parameters inside each flat buffer whose
        gradient a ``GradReducer`` reduces under that key."""
        return {
            key: [(s.offset, tuple(s.shape)) for s in flat.slots]
            for key, flat in enumerate(self.flats)
        }

    def state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state this rank keeps between
        steps, counted from the storages of the tensors it holds (each once)."""
        storages = {}
        for flat in self.flats:
            for tensor in flat.state_tensors():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        storages.pop(0, None)  # empty tensors may share the null pointer
        return sum(storages.values())
