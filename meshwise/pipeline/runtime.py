"""Executes one rank's pipeline schedule: compute, local hand-offs and batched messages,
each micro-batch's ``ForwardContext`` passed to its forwards (messages carry activations
and gradients only), backwards split per linear layer where the schedule has W actions.
See docs/pipelines.md.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from meshwise.comm import ops
from meshwise.comm.checks import strict
from meshwise.device import ranges
from meshwise.device.clocks import IntervalClock
from meshwise.pipeline.mailbox import Mailbox
from meshwise.pipeline.p2p import Channels, Incoming, Outgoing
from meshwise.pipeline.schedules import Action, Schedule, Step, group_steps
from meshwise.tensor_parallel.weight_grads import WeightGradStore, defer_weight_grads


class PipelineRuntime:
    """Runs a rank's actions over its ``chunks`` (chunk ``v`` = logical stage
    ``schedule.stage_of(rank, v)``), on the device of their parameters.

    ``engine`` supplies ``no_sync()``: a chunk's gradients reduce over dp once, from its last
    B (and last weight pass). ``loss_fn(output, targets)`` gives the last stage's summed token
    loss (a 0-dim tensor); without it the last chunk is called as ``chunk(x, targets)``.
    ``action_times()``: the last run's actions on the device's clock.
    """

    def __init__(
        self, chunks, schedule: Schedule, pp_group: ops.Group | None, engine, loss_fn=None
    ):
        self.chunks, self.schedule, self.pp_group = chunks, schedule, pp_group
        self.engine, self.loss_fn = engine, loss_fn
        self.rank = pp_group.rank if pp_group is not None else 0
        self.num_stages = schedule.num_stages
        self.num_logical = schedule.num_logical
        self.steps = group_steps(schedule.ranks[self.rank])
        self.channels = Channels(pp_group)
        self.mail = Mailbox(self.channels, schedule, self.rank)
        self.weight_grads = None
        if schedule.has_weight_actions:
            self.weight_grads = WeightGradStore()
            defer_weight_grads(chunks, self.weight_grads)
        self._last_b, self._last_weights = {}, {}  # chunk -> the action that syncs them
        for a in schedule.compute_actions(self.rank):
            if a.kind == "B":
                self._last_b[a.chunk] = a
            if a.kind == "W" or (a.kind == "B" and not self._split(a)):
                self._last_weights[a.chunk] = a
        self._whole = self._whole_backwards() if self.weight_grads is not None else set()
        self.clock = IntervalClock("cpu")

    def stage(self, chunk: int) -> int:
        return self.schedule.stage_of(self.rank, chunk)

    def _split(self, a: Action) -> bool:
        return self.schedule.splits_backward(self.rank, a.micro_batch, a.chunk)

    def _whole_backwards(self) -> set:
        """``(chunk, micro_batch)`` whose weight pass follows its B with nothing between
        (or is part of it) under the same gradient sync: their layers never defer."""
        whole = set()
        for i, b in enumerate(self.steps):
            if not isinstance(b, Action) or b.kind != "B":
                continue
            w: Step | None = b
            if self._split(b):
                w = self.steps[i + 1] if i + 1 < len(self.steps) else None
                if not (
                    isinstance(w, Action)
                    and w.kind == "W"
                    and (w.chunk, w.micro_batch) == (b.chunk, b.micro_batch)
                ):
                    continue
            if (self._last_b[b.chunk] == b) == (self._last_weights[b.chunk] == w):
                whole.add((b.chunk, b.micro_batch))
        return whole

    @property
    def compute_s(self) -> float:
        """Seconds of the last run's compute actions on the device (read it once the
        device has finished: the rest of the step is bubble and communication)."""
        return sum(end - start for label, start, end in self.clock.intervals() if label != "p2p")

    def action_times(self) -> list[tuple[str, float, float]]:
        """The last run's actions (``F3``, ``B3.1``, ``W2``, ``p2p`` for a batch of
        messages) with start and end in seconds from the run's start, on the device's
        clock (CUDA events on a GPU): read once the device has finished the step."""
        return self.clock.intervals()

    def run(
        self, micro_batches, loss_scale: float, sync: bool = True, contexts=None
    ) -> torch.Tensor:
        """One pass of the schedule over ``micro_batches`` [(inputs, targets)].

        Returns the summed scaled loss, a 0-dim float64 device tensor not waited for (zero off
        the last stage). ``sync=False`` keeps every backward local (accumulation). ``contexts``:
        one per micro-batch, passed to each chunk's forward as ``context=`` (None: not passed).
        """
        assert len(micro_batches) == self.schedule.num_micro_batches
        assert contexts is None or len(contexts) == len(micro_batches)
        self._contexts = contexts
        self._device = self._device_of(micro_batches)
        self.channels.start(
            meta_tag_base=2 * self.num_logical * len(micro_batches), keep_shapes=True
        )
        self.mail.start(self._device)
        # (chunk, mb) -> a forward's input and output; (stage, mb) -> what a stage on
        # this rank hands the next (or, backwards, the previous) one on this rank
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._handoff: dict[tuple[int, int], torch.Tensor] = {}
        self._handoff_grad: dict[tuple[int, int], torch.Tensor] = {}
        self._micro_batches, self._loss_scale, self._sync = micro_batches, loss_scale, sync
        self._loss = torch.zeros((), dtype=torch.float64, device=self._device)
        if self.clock.cuda != (self._device.type == "cuda"):
            self.clock = IntervalClock(self._device)
        self.clock.start()
        with contextlib.nullcontext() if sync else self.engine.no_sync():
            for step in self.steps:
                if isinstance(step, tuple):
                    with ranges.named("pipeline/p2p"), self.clock.measure("p2p"):
                        self.mail.post(step, self._outputs)
                    continue
                if self.mail.waits_for(step):  # its input is still on its way
                    with ranges.named("pipeline/p2p"), self.clock.measure("p2p"):
                        self.mail.wait_for(step)
                with ranges.named(f"pipeline/{step}"), self.clock.measure(str(step)):
                    {"F": self._forward, "B": self._backward, "W": self._weights}[step.kind](step)
            self.mail.finish_sends()
        assert not (self._outputs or self._inputs or self.mail.arriving), (
            "activations left after the step"
        )
        return self._loss

    # ------------------------------------------------------------ compute
    def _capturing(self, a: Action):
        """Linear layers defer their weight gradients (a split backward's F and B)."""
        if self.weight_grads is None or (a.chunk, a.micro_batch) in self._whole:
            return contextlib.nullcontext()
        return self.weight_grads.capturing((a.chunk, a.micro_batch))

    def _syncing(self, a: Action, last: dict):
        """Gradients accumulate locally unless ``a`` is the chunk's last of their kind."""
        if self._sync and last[a.chunk] != a:
            return self.engine.no_sync()
        return contextlib.nullcontext()

    def _forward(self, a: Action) -> None:
        key, stage = (a.chunk, a.micro_batch), self.stage(a.chunk)
        inputs, targets = self._micro_batches[a.micro_batch]
        context = None if self._contexts is None else self._contexts[a.micro_batch]
        if stage == 0:
            x = inputs
        elif key in self.mail.activations:
            x = self.mail.activations.pop(key).requires_grad_()
        else:  # local hand-off from the previous stage on this rank
            x = self._handoff.pop((stage, a.micro_batch)).detach().requires_grad_()
        last = stage == self.num_logical - 1
        with self._capturing(a):
            out = self._stage_forward(a.chunk, x, targets, last, context)
        if last:
            out = out * self._loss_scale
            self._loss += out.detach()  # stays on the device: no host sync per micro-batch
        self._inputs[key] = x
        self._outputs[key] = out
        if not last and self.schedule.owner(stage + 1)[0] == self.rank:
            self._handoff[(stage + 1, a.micro_batch)] = out  # the next stage is here too

    def _stage_forward(self, chunk: int, x, targets, with_loss: bool, context=None):
        """A chunk's forward; ``with_loss`` (last stage): the sum of token losses.
        ``context``: the micro-batch's, passed on as ``context=`` (None: not passed)."""
        given = {} if context is None else {"context": context}
        if not with_loss:
            return self.chunks[chunk](x, **given)
        if self.loss_fn is None:
            loss = self.chunks[chunk](x, targets, **given)
        else:
            loss = self.loss_fn(self.chunks[chunk](x, **given), targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = "loss_fn" if self.loss_fn is not None else "the last chunk called with targets"
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"{what} must return a 0-dim tensor (the sum of token losses), got {shape}"
            )
        return loss

    def _backward(self, a: Action) -> None:
        key, stage = (a.chunk, a.micro_batch), self.stage(a.chunk)
        out, x = self._outputs.pop(key), self._inputs.pop(key)
        with self._syncing(a, self._last_b), self._capturing(a):
            if stage == self.num_logical - 1:
                strict.backward(out)
            else:
                grad = self.mail.gradients.pop(key, None)
                if grad is None:
                    grad = self._handoff_grad.pop((stage, a.micro_batch))
                # ``out`` may hold no data any more (released after its send): only
                # its graph is used, and its shape still matches ``grad``.
                strict.backward(out, grad)
        if self.weight_grads is not None and not self._split(a) and key not in self._whole:
            self._weights(a)  # no W of its own, another sync than B's: the weights now
        if stage > 0:
            # An input the chunk did not use gets no gradient; its sender still waits for one.
            grad_in = x.grad if x.grad is not None else torch.zeros_like(x)
            if self.schedule.owner(stage - 1)[0] == self.rank:
                self._handoff_grad[(stage - 1, a.micro_batch)] = grad_in
            else:
                self.mail.to_send[key] = grad_in

    def _weights(self, a: Action) -> None:
        """The weight pass of ``a``'s micro-batch and chunk (a W, or a whole B's)."""
        if (a.chunk, a.micro_batch) in self._whole:
            return  # its B computed the weight gradients already
        assert self.weight_grads is not None, "only a schedule with W actions defers them"
        with self._syncing(a, self._last_weights):
            self.weight_grads.run((a.chunk, a.micro_batch))

    def reset_shapes(self) -> None:
        """The next ``run`` sends every stage's output shape again (call it on every
        rank when the micro-batches' shapes change between steps)."""
        self.channels.start(meta_tag_base=0)

    @torch.no_grad()
    def forward_only(self, inputs, targets=None, context=None) -> torch.Tensor | None:
        """Forward one batch through every stage (evaluation, generation): the last stage's output
        (loss sum, or logits without ``targets``) on its rank, None elsewhere. ``context``: passed
        to every stage. Each call sends its headers anew, so shapes may change between calls.
        """
        device = self._device_of([(inputs, targets)])
        self.channels.start(meta_tag_base=self.num_logical)  # tensor tags: receiving stage
        x, owner = None, self.schedule.owner
        for stage in range(self.num_logical):
            rank, chunk = owner(stage)
            if rank != self.rank:
                continue
            if stage == 0:
                x = inputs
            elif owner(stage - 1)[0] != self.rank:
                [x], _ = self.channels.exchange(
                    [], [Incoming(owner(stage - 1)[0], stage, stage - 1, stage)], device
                )
            last = stage == self.num_logical - 1
            x = self._stage_forward(chunk, x, targets, last and targets is not None, context)
            if not last and owner(stage + 1)[0] != self.rank:
                _, [pending] = self.channels.exchange(
                    [Outgoing(x, owner(stage + 1)[0], stage + 1, stage, stage + 1)], [], device
                )
                for handle in pending:
                    handle.wait()
        # Its shapes are not training's: the next run sends its headers again, as every
        # rank decides alike (each calls forward_only).
        self.channels.start(meta_tag_base=0)
        return x if owner(self.num_logical - 1)[0] == self.rank else None

    def _device_of(self, micro_batches) -> torch.device:
        """Where this rank computes: its chunks' parameters, else the batch's tensors."""
        for chunk in self.chunks:
            tensors = (
                itertools.chain(chunk.parameters(), chunk.buffers())
                if hasattr(chunk, "parameters")
                else ()
            )
            for t in tensors:
                return t.device
        for t in itertools.chain.from_iterable(micro_batches):
            if isinstance(t, torch.Tensor):
                return t.device
        return torch.device("cpu")
