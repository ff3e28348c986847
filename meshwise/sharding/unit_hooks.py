"""When ZeRO-3 gathers and frees its units: module hooks around each unit's forward and
autograd hooks around its backward, the next unit's gather started ahead (prefetch),
and a reshard policy saying when a gathered unit is freed (FSDP2's
``reshard_after_forward``; ZeRO, Rajbhandari et al. 2020, section 5.3). The engine
(``meshwise.sharding.zero3``) holds the state, reduces the gradients and steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks

from meshwise.comm.ops import Group
from meshwise.sharding.units import Gathered, Unit, check_same_units, grad_tensors, saved_views

RESHARD = ("after-forward", "after-backward", "after-step")


def reshard_policy(pipelined: bool, reshard_after_forward: bool = False) -> str:
    """The default policy: per step under a pipeline, whose stages run many forwards
    first, unless ``reshard_after_forward``; else after each forward."""
    return "after-step" if pipelined and not reshard_after_forward else "after-forward"


@dataclass
class Chunk:
    """A module the engine hooks: the model, or one of a rank's pipeline chunks."""

    module: nn.Module
    root: Unit | None
    blocks: list[Unit]
    ran: list[Unit] = field(default_factory=list)  # units run in its latest forward
    checked: bool = False  # its units compared across dp ranks
    root_ends_after_blocks: bool = False  # see ``_chunk_pre_forward``


class UnitHooks:
    """The hooks of ``ZeroStage3``: gathers and frees its units as forwards and backwards
    run. The engine sets the attributes below and ends a backward that a gradient of its
    trained parameters reaches (``_end_backward``)."""

    group: Group
    prefetch: bool
    reshard: str
    units: list[Unit]
    gathered: Gathered
    events: list
    _roots: set[Unit]
    _saved_hooks: saved_tensors_hooks | None

    def _register(self, chunk: Chunk) -> None:
        for unit, following in zip(chunk.blocks, chunk.blocks[1:] + [None]):
            for j, module in enumerate(unit.modules):
                module.register_forward_pre_hook(
                    partial(self._pre_forward, chunk, unit, j == 0, following)
                )
            unit.modules[-1].register_forward_hook(partial(self._post_forward, chunk, unit))
        # The chunk's hooks run first before and last after its forward.
        chunk.module.register_forward_pre_hook(
            partial(self._chunk_pre_forward, chunk), prepend=True
        )
        chunk.module.register_forward_hook(
            partial(self._chunk_post_forward, chunk), always_call=True
        )

    def _frees_now(self, unit: Unit) -> bool:
        """After a forward or a backward: a root's ``after-forward`` is ``after-backward``."""
        if self.reshard == "after-forward" and unit not in self._roots:
            return True
        return self.reshard != "after-step" and not unit.pending

    def _chunk_pre_forward(self, chunk: Chunk, module, args) -> None:
        if torch.is_grad_enabled() and not any(u.pending for u in self.units):
            self.events.clear()  # a new micro-step begins
        chunk.ran = []
        if self.reshard == "after-forward":  # saved views of freed units: rebuilt when regathered
            self._saved_hooks = hooks = saved_views(self.gathered)
            hooks.__enter__()
        if chunk.root is not None:
            # A root of frozen weights only, whose input needs no gradient (token ids),
            # has no backward of its own to end it: its last use is the backward of what
            # follows the layers (the head's input gradient needs the head's weight),
            # over once the gradient reaches the last layer's output.
            chunk.root_ends_after_blocks = not chunk.root.flat.slots and not grad_tensors(args)
            following = chunk.blocks[0] if chunk.blocks else None
            self._pre_forward(chunk, chunk.root, True, following, module, args)

    def _chunk_post_forward(self, chunk: Chunk, module, args, output) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        if torch.is_grad_enabled() and chunk.blocks and not chunk.checked:
            check_same_units(chunk.blocks, chunk.ran, self.group)
            chunk.checked = True
        if chunk.root is not None:
            self._post_forward(chunk, chunk.root, module, args, output)

    def _pre_forward(self, chunk: Chunk, unit: Unit, first: bool, following, module, args) -> None:
        unit.ensure_gathered()
        if unit.in_backward or not first:
            # A recompute (activation checkpointing) inside backward finds the views its
            # pre-backward hook made; a unit's first module pointed all of them.
            return
        if self.prefetch and following is not None:
            following.start_gather()
        unit.use_views()
        inputs = grad_tensors(args) if torch.is_grad_enabled() else None
        if inputs is not None:
            chunk.ran.append(unit)
        if inputs:
            # The gradient of its input ends the unit's backward, also when each of its
            # parameters waits for a W (no gradient reaches its views in B).
            register_multi_grad_hook(inputs, partial(self._input_grad_ready, unit))
        self.events.append(("forward", unit.name))

    def _post_forward(self, chunk: Chunk, unit: Unit, module, args, output) -> None:
        if unit.in_backward:
            return  # a recompute: the backward still needs the gathered unit
        tensors = grad_tensors(output)
        if tensors:
            unit.pending += 1
            previous = next((u for u in reversed(chunk.ran) if u is not unit), None)
            register_multi_grad_hook(
                tensors, partial(self._pre_backward, unit, previous), mode="any"
            )
            root = chunk.root
            if root is not None and chunk.root_ends_after_blocks and unit is chunk.blocks[-1]:
                register_multi_grad_hook(tensors, partial(self._input_grad_ready, root))
        if self._frees_now(unit):
            unit.free()

    def _pre_backward(self, unit: Unit, previous: Unit | None, grads) -> None:
        unit.ensure_gathered()
        unit.in_backward = True
        # The modules point at the gathered unit before any recompute runs: there, under
        # selective checkpointing's dispatch mode, the replay must meet the model's ops only.
        with torch.enable_grad():
            unit.use_views()
        if self.prefetch and previous is not None and previous.pending:
            previous.start_gather()  # its backward comes next
        self.events.append(("backward", unit.name))

    def _input_grad_ready(self, unit: Unit, grads) -> None:
        self._end_backward(unit, grads)

    def _end_backward(self, unit: Unit, grads=None, take: bool = False) -> torch.Tensor | None:
        """A backward of ``unit`` ended: free it if its policy says so (``take``: its buffer
        is returned, to hold the gradient)."""
        if not unit.in_backward:
            return None
        unit.in_backward = False
        unit.pending -= 1
        return unit.free(take) if self._frees_now(unit) else None

    def _free_all(self) -> None:
        for unit in self.units:
            unit.pending, unit.in_backward = 0, False
            unit.free()
