"""Executes one rank's pipeline schedule: compute, hand-offs and point-to-point.

The schedule (``meshwise.pipeline.schedules``) is a list of actions per rank;
this runtime walks its own list top to bottom. A run of consecutive messages is
one batch posted with ``batch_isend_irecv`` and waited for before the next
compute action: the schedule's validator proves that order deadlock-free.

Per micro-batch and chunk it keeps the input (a leaf that will receive the
input gradient), the output (or, on the last logical stage, the loss) until
that chunk's backward, then frees them. Between two chunks on the same rank
(``S == 1``) the hand-off is local: no message, same bookkeeping.
"""

from __future__ import annotations

import contextlib
import time

import torch

from meshwise.comm import ops
from meshwise.pipeline.schedules import Action, Schedule, group_steps


class PipelineRuntime:
    """Runs a rank's actions over its ``chunks`` (chunk ``v`` = logical stage ``v*S + rank``).

    ``engine`` supplies ``no_sync()``: every backward of a chunk except its last
    one accumulates locally, so a chunk's gradients are reduced over dp once,
    overlapped with that last backward.
    """

    def __init__(self, chunks, schedule: Schedule, pp_group: ops.Group, engine,
                 hidden_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.chunks, self.schedule, self.pp_group = chunks, schedule, pp_group
        self.engine = engine
        self.hidden_shape, self.dtype, self.device = hidden_shape, dtype, device
        self.rank = pp_group.rank if pp_group is not None else 0
        self.num_stages = schedule.num_stages
        self.num_logical = schedule.num_stages * schedule.num_virtual_stages
        self.steps = group_steps(schedule.ranks[self.rank])
        # Each chunk's final backward: the one that starts its dp reduction.
        self.last_backward = {a.chunk: a for a in schedule.ranks[self.rank] if a.kind == "B"}
        # Called with a micro-batch's index before each of its forwards (the trainer
        # tells the model which samples it computes, for dropout).
        self.before_forward = None

    def stage(self, chunk: int) -> int:
        return chunk * self.num_stages + self.rank

    def run(self, micro_batches, loss_scale: float, sync: bool = True,
            autocast=contextlib.nullcontext) -> torch.Tensor:
        """One pass of the schedule over ``micro_batches`` [(inputs, targets)].

        Returns the summed scaled loss as a 0-dim float64 tensor on the device,
        without waiting for it (zero on ranks without the last logical stage).
        ``sync=False`` keeps every backward local (an accumulation round);
        otherwise each chunk's last backward starts its dp reduction.
        """
        assert len(micro_batches) == self.schedule.num_micro_batches
        self._inputs, self._outputs, self._grads_in = {}, {}, {}
        self._recv_f, self._recv_b, self._handoff, self._handoff_grad = {}, {}, {}, {}
        self._micro_batches, self._loss_scale, self._autocast = micro_batches, loss_scale, autocast
        self._sync, self._pending_sends = sync, []
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.compute_s = 0.0  # time in F and B this run: the rest is bubble and comms
        with contextlib.nullcontext() if sync else self.engine.no_sync():
            for step in self.steps:
                if isinstance(step, tuple):
                    self._communicate(step)
                    continue
                start = time.perf_counter()
                if step.kind == "F":
                    self._forward(step)
                else:
                    self._backward(step)
                self.compute_s += time.perf_counter() - start
            for handle in self._pending_sends:
                handle.wait()
        assert not self._outputs and not self._inputs, "activations left after the step"
        return self._loss

    # ------------------------------------------------------------ compute
    def _forward(self, a: Action) -> None:
        key = (a.chunk, a.micro_batch)
        stage = self.stage(a.chunk)
        inputs, targets = self._micro_batches[a.micro_batch]
        if self.before_forward is not None:
            self.before_forward(a.micro_batch)
        if stage == 0:
            x = inputs
        elif (a.chunk, a.micro_batch) in self._recv_f:
            x = self._recv_f.pop(key).requires_grad_()
        else:  # local hand-off from the previous chunk on this rank
            x = self._outputs_prev_chunk(a)
        with self._autocast():
            if stage == self.num_logical - 1:
                out = self.chunks[a.chunk](x, targets) * self._loss_scale
                self._loss += out.detach()  # stays on the device: no host sync per micro-batch
            else:
                out = self.chunks[a.chunk](x)
        self._inputs[key] = x
        self._outputs[key] = out
        if self.num_stages == 1 and stage < self.num_logical - 1:
            self._handoff[key] = out  # the next chunk on this rank takes it directly

    def _outputs_prev_chunk(self, a: Action) -> torch.Tensor:
        prev = self._handoff.pop((a.chunk - 1, a.micro_batch))
        return prev.detach().requires_grad_()

    @torch.no_grad()
    def forward_only(self, inputs, targets, hidden_shape,
                     autocast=contextlib.nullcontext) -> torch.Tensor | None:
        """Forward one batch through every logical stage in order (evaluation,
        generation). Returns the last stage's output (loss sum, or logits without
        ``targets``) on that stage's rank, None elsewhere."""
        x = None
        for stage in range(self.num_logical):
            owner, chunk = stage % self.num_stages, stage // self.num_stages
            if owner != self.rank:
                continue
            prev_owner = (stage - 1) % self.num_stages
            if stage == 0:
                x = inputs
            elif prev_owner != self.rank:
                x = torch.empty(hidden_shape, dtype=self.dtype, device=self.device)
                ops.recv(x, prev_owner, self.pp_group, tag=stage)
            with autocast():
                last = stage == self.num_logical - 1
                x = self.chunks[chunk](x, targets) if last else self.chunks[chunk](x)
            next_owner = (stage + 1) % self.num_stages
            if not last and next_owner != self.rank:
                ops.send(x, next_owner, self.pp_group, tag=stage + 1)
        return x if self.rank == (self.num_logical - 1) % self.num_stages else None

    def _backward(self, a: Action) -> None:
        key = (a.chunk, a.micro_batch)
        out = self._outputs.pop(key)
        x = self._inputs.pop(key)
        local_only = self._sync and a != self.last_backward[a.chunk]
        sync = self.engine.no_sync() if local_only else contextlib.nullcontext()
        with sync:
            if self.stage(a.chunk) == self.num_logical - 1:
                out.backward()
            else:
                grad = self._recv_b.pop(key) if key in self._recv_b else self._handoff_grad.pop(key)
                torch.autograd.backward(out, grad)
        if self.stage(a.chunk) > 0:
            if a.chunk > 0 and self.num_stages == 1:
                self._handoff_grad[(a.chunk - 1, a.micro_batch)] = x.grad
            else:
                self._grads_in[key] = x.grad

    # ------------------------------------------------------- communication
    def _tag(self, backward: bool, receiver_stage: int, micro_batch: int) -> int:
        """The same number on both ends of a message, unique within the step."""
        num_mb = self.schedule.num_micro_batches
        return ((int(backward) * self.num_logical) + receiver_stage) * num_mb + micro_batch

    def _communicate(self, batch: tuple[Action, ...]) -> None:
        sends, recvs = [], []
        for a in batch:
            key, stage = (a.chunk, a.micro_batch), self.stage(a.chunk)
            if a.kind == "SEND_F":
                sends.append((self._outputs[key].detach(), a.peer,
                              self._tag(False, stage + 1, a.micro_batch)))
            elif a.kind == "SEND_B":
                sends.append((self._grads_in.pop(key), a.peer,
                              self._tag(True, stage - 1, a.micro_batch)))
            else:
                buf = torch.empty(self.hidden_shape, dtype=self.dtype, device=self.device)
                backward = a.kind == "RECV_B"
                (self._recv_b if backward else self._recv_f)[key] = buf
                recvs.append((buf, a.peer, self._tag(backward, stage, a.micro_batch)))
        # Wait for the receives only: a sender computes on while its message
        # travels, which is what reaches the schedule's simulated bubble.
        self._pending_sends += ops.batch_p2p(sends, recvs, self.pp_group, category="p2p",
                                             wait_sends=False)
