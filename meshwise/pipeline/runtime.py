"""Executes one rank's pipeline schedule: compute, hand-offs and point-to-point.

The schedule (``meshwise.pipeline.schedules``) is a list of actions per rank;
this runtime walks its own list top to bottom. A run of consecutive messages is
one batch posted with ``batch_isend_irecv`` and waited for before the next
compute action: the schedule's validator proves that order deadlock-free.
Messages carry their shape and dtype (``meshwise.pipeline.p2p``), so the stages
may be any modules: nothing about the activations is fixed up front.

Per micro-batch and chunk it keeps the input (a leaf that will receive the
input gradient), the output (or, on the last logical stage, the loss) until
that chunk's backward, then frees them. An output sent to the next rank keeps
only its autograd graph once the send has completed (``release_storage``).
Between two chunks on the same rank (``S == 1``) the hand-off is local: no
message, same bookkeeping.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from meshwise.comm import ops, ranges
from meshwise.comm.devices import Stopwatch
from meshwise.pipeline.p2p import Channels, Incoming, Outgoing, release_storage
from meshwise.pipeline.schedules import Action, Schedule, group_steps


class PipelineRuntime:
    """Runs a rank's actions over its ``chunks`` (chunk ``v`` = logical stage ``v*S + rank``).

    ``engine`` supplies ``no_sync()``: every backward of a chunk except its last
    one accumulates locally, so a chunk's gradients are reduced over dp once,
    overlapped with that last backward.

    ``loss_fn(output, targets)``, when given, turns the last logical stage's
    output into the SUM of token losses (a 0-dim tensor); without it the last
    chunk is called as ``chunk(x, targets)`` and returns that sum itself.
    Tensors are computed where the chunks' parameters live.
    """

    def __init__(self, chunks, schedule: Schedule, pp_group: ops.Group | None, engine,
                 loss_fn=None):
        self.chunks, self.schedule, self.pp_group = chunks, schedule, pp_group
        self.engine, self.loss_fn = engine, loss_fn
        self.rank = pp_group.rank if pp_group is not None else 0
        self.num_stages = schedule.num_stages
        self.num_logical = schedule.num_stages * schedule.num_virtual_stages
        self.steps = group_steps(schedule.ranks[self.rank])
        self.channels = Channels(pp_group)
        # Each chunk's final backward: the one that starts its dp reduction.
        self.last_backward = {a.chunk: a for a in schedule.ranks[self.rank] if a.kind == "B"}
        # Called with a micro-batch's index before each of its forwards (the trainer
        # tells the model which samples it computes, for dropout).
        self.before_forward = None

    def stage(self, chunk: int) -> int:
        return chunk * self.num_stages + self.rank

    @property
    def compute_s(self) -> float:
        """Seconds of the last run's forwards and backwards on the device (read it once
        the device has finished: the rest of the step is bubble and communication)."""
        return self.compute.seconds()

    def run(self, micro_batches, loss_scale: float, sync: bool = True) -> torch.Tensor:
        """One pass of the schedule over ``micro_batches`` [(inputs, targets)].

        Returns the summed scaled loss as a 0-dim float64 tensor on the device,
        without waiting for it (zero on ranks without the last logical stage).
        ``sync=False`` keeps every backward local (an accumulation round);
        otherwise each chunk's last backward starts its dp reduction.
        """
        assert len(micro_batches) == self.schedule.num_micro_batches
        self._device = self._device_of(micro_batches)
        self.channels.start(meta_tag_base=2 * self.num_logical * len(micro_batches),
                            keep_shapes=True)
        self._inputs, self._outputs, self._grads_in = {}, {}, {}
        self._recv_f, self._recv_b, self._handoff, self._handoff_grad = {}, {}, {}, {}
        self._micro_batches, self._loss_scale = micro_batches, loss_scale
        self._sync, self._in_flight = sync, []
        self._loss = torch.zeros((), dtype=torch.float64, device=self._device)
        self.compute = Stopwatch(self._device)  # F and B this run: the rest is bubble and comms
        with contextlib.nullcontext() if sync else self.engine.no_sync():
            for step in self.steps:
                if isinstance(step, tuple):
                    with ranges.named("pipeline/p2p"):
                        self._communicate(step)
                    continue
                with ranges.named(f"pipeline/{step}"), self.compute.measure():
                    if step.kind == "F":
                        self._forward(step)
                    else:
                        self._backward(step)
            self._finish_sends()
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
        elif key in self._recv_f:
            x = self._recv_f.pop(key).requires_grad_()
        else:  # local hand-off from the previous chunk on this rank
            x = self._handoff.pop((a.chunk - 1, a.micro_batch)).detach().requires_grad_()
        last = stage == self.num_logical - 1
        out = self._stage_forward(a.chunk, x, targets, with_loss=last)
        if last:
            out = out * self._loss_scale
            self._loss += out.detach()  # stays on the device: no host sync per micro-batch
        self._inputs[key] = x
        self._outputs[key] = out
        if self.num_stages == 1 and not last:
            self._handoff[key] = out  # the next chunk on this rank takes it directly

    def _stage_forward(self, chunk: int, x, targets, with_loss: bool):
        """A chunk's forward; ``with_loss`` (last stage): the sum of token losses."""
        if not with_loss:
            return self.chunks[chunk](x)
        if self.loss_fn is None:
            loss = self.chunks[chunk](x, targets)
        else:
            loss = self.loss_fn(self.chunks[chunk](x), targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = "loss_fn" if self.loss_fn is not None else "the last chunk called with targets"
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"{what} must return a 0-dim tensor (the sum of token losses), "
                             f"got {shape}")
        return loss

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
                # ``out`` may hold no data any more (released after its send): only
                # its graph is used, and its shape still matches ``grad``.
                torch.autograd.backward(out, grad)
        if self.stage(a.chunk) > 0:
            # An input the chunk did not use gets no gradient; its sender still waits for one.
            grad_in = x.grad if x.grad is not None else torch.zeros_like(x)
            if a.chunk > 0 and self.num_stages == 1:
                self._handoff_grad[(a.chunk - 1, a.micro_batch)] = grad_in
            else:
                self._grads_in[key] = grad_in

    def reset_shapes(self) -> None:
        """The next ``run`` sends every stage's output shape again (call it on every
        rank when the micro-batches' shapes change between steps)."""
        self.channels.start(meta_tag_base=0)

    @torch.no_grad()
    def forward_only(self, inputs, targets=None) -> torch.Tensor | None:
        """Forward one batch through every logical stage in order (evaluation,
        generation). Returns the last stage's output (loss sum, or logits without
        ``targets``) on that stage's rank, None elsewhere. Shapes may differ from
        call to call (a growing sequence): each call sends its headers anew."""
        device = self._device_of([(inputs, targets)])
        self.channels.start(meta_tag_base=self.num_logical)  # tensor tags: receiving stage
        x = None
        for stage in range(self.num_logical):
            owner, chunk = stage % self.num_stages, stage // self.num_stages
            if owner != self.rank:
                continue
            prev_owner = (stage - 1) % self.num_stages
            if stage == 0:
                x = inputs
            elif prev_owner != self.rank:
                [x], _ = self.channels.exchange(
                    [], [Incoming(prev_owner, stage, stage - 1, stage)], device)
            last = stage == self.num_logical - 1
            x = self._stage_forward(chunk, x, targets, with_loss=last and targets is not None)
            next_owner = (stage + 1) % self.num_stages
            if not last and next_owner != self.rank:
                _, [pending] = self.channels.exchange(
                    [Outgoing(x, next_owner, stage + 1, stage, stage + 1)], [], device)
                for handle in pending:
                    handle.wait()
        return x if self.rank == (self.num_logical - 1) % self.num_stages else None

    def _device_of(self, micro_batches) -> torch.device:
        """Where this rank computes: its chunks' parameters, else the batch's tensors."""
        for chunk in self.chunks:
            tensors = itertools.chain(chunk.parameters(), chunk.buffers()) \
                if hasattr(chunk, "parameters") else ()
            for t in tensors:
                return t.device
        for t in itertools.chain.from_iterable(micro_batches):
            if isinstance(t, torch.Tensor):
                return t.device
        return torch.device("cpu")

    # ------------------------------------------------------- communication
    def _tag(self, backward: bool, receiver_stage: int, micro_batch: int) -> int:
        """The same number on both ends of a message, unique within the step."""
        num_mb = self.schedule.num_micro_batches
        return ((int(backward) * self.num_logical) + receiver_stage) * num_mb + micro_batch

    def _communicate(self, batch: tuple[Action, ...]) -> None:
        sends, recvs, sent_keys = [], [], []
        for a in batch:
            key, stage, mb = (a.chunk, a.micro_batch), self.stage(a.chunk), a.micro_batch
            if a.kind == "SEND_F":
                sends.append(Outgoing(self._outputs[key].detach(), a.peer,
                                      self._tag(False, stage + 1, mb), stage, stage + 1))
                sent_keys.append(key)
            elif a.kind == "SEND_B":
                sends.append(Outgoing(self._grads_in.pop(key), a.peer,
                                      self._tag(True, stage - 1, mb), stage, stage - 1, True))
                sent_keys.append(None)
            else:
                backward = a.kind == "RECV_B"
                src = stage + 1 if backward else stage - 1
                recvs.append(Incoming(a.peer, self._tag(backward, stage, mb), src, stage, backward))
        # Only the receives are waited for: a sender computes on while its message
        # travels, which is what reaches the schedule's simulated bubble.
        received, handles = self.channels.exchange(sends, recvs, self._device)
        receivers = [a for a in batch if a.kind in ("RECV_F", "RECV_B")]
        for a, tensor in zip(receivers, received, strict=True):
            inbox = self._recv_b if a.kind == "RECV_B" else self._recv_f
            inbox[(a.chunk, a.micro_batch)] = tensor
        # Sends are waited for, and their activations freed, at the latest in the next
        # batch (torch's pipelining waits at the same point): a runtime that waits for
        # them at once is proven deadlock-free, so waiting later is too. A send listed
        # before a receive from the same peer is waited for now: messages are placed in
        # meeting-time order, so that peer has posted its end already and waiting costs
        # at most the transfer (1F1B's steady state frees each output as soon as it is sent).
        sent = iter(zip(handles, sent_keys, strict=True))
        now, later = [], []
        for i, a in enumerate(batch):
            if a.kind in ("SEND_F", "SEND_B"):
                answered = any(b.kind in ("RECV_F", "RECV_B") and b.peer == a.peer
                               for b in batch[i + 1:])
                (now if answered else later).append(next(sent))
        self._in_flight += now
        self._finish_sends()
        self._in_flight = later

    def _finish_sends(self) -> None:
        for pending, _ in self._in_flight:
            for handle in pending:
                handle.wait()
        self._release([key for _, key in self._in_flight])
        self._in_flight = []

    def _release(self, sent_keys) -> None:
        """Free the data of activations whose send completed; their backward needs only
        the graph (the gradient comes back from the next stage)."""
        for key in sent_keys:
            if key is not None and key in self._outputs:
                release_storage(self._outputs[key])
