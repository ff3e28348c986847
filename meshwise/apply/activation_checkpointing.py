"""Activation checkpointing applied from outside the model (as torchtitan does): ``full``
(Chen et al. 2016) or ``selective`` (Korthikanti et al. 2022, section 4.2, per op). A block
stays the same object, its class swapped, so names, plans and ZeRO units are untouched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

MODES = ("none", "selective", "full")
_aten = torch.ops.aten
# Outputs kept under "selective": matmuls and fused attention (costly to redo).
_KEEP = {
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_aten, name)
}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str) -> None:
    """Recompute each of ``blocks`` (in any order, of a model or this rank's chunks) in
    backward: whole for ``"full"``, the cheap parts for ``"selective"``.
    """
    if mode not in MODES:
        raise ValueError(
            f"activation checkpointing {mode!r} is not valid; valid: {', '.join(MODES)}"
        )
    if mode == "none":
        return
    if isinstance(blocks, nn.ModuleDict):
        blocks = blocks.values()
    for block in blocks:
        if not isinstance(block, Checkpointed):
            # As FSDP2's fully_shard does: the same object, a subclass of its class, so
            # names, hooks and copies (``copy.deepcopy``) stay those of the block.
            cls: type = type(block)  # plain type: mypy takes a type[Module] for unhashable
            block.__class__ = _checkpointed_class(cls)
        assert isinstance(block, Checkpointed)  # as its class now says
        block._ac_inside = False
        block._ac_selective = mode == "selective"


class Checkpointed:
    """Put in front of a block's class: its forward runs under ``checkpoint``."""

    # Declared only: apply_activation_checkpointing sets them on each block.
    _ac_inside: bool
    _ac_selective: bool

    def forward(self, *args, **kwargs):
        if self._ac_inside or not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)  # the recompute's own call; no autograd

        def run(*args, **kwargs):
            if self._ac_inside:  # the first run, inside this forward's __call__
                return super(Checkpointed, self).forward(*args, **kwargs)
            # The recompute, inside backward: through __call__ so the block's hooks
            # run (ZeRO-3's pre-backward hook has already pointed the block at its
            # gathered unit: they only check it), with the first run's arguments: its
            # forward context among them, so the same dropout masks and documents,
            # also under a pipeline.
            with self._ac_entered():
                return self(*args, **kwargs)

        extra = {"context_fn": _selective_contexts} if self._ac_selective else {}
        with self._ac_entered():
            return checkpoint(run, *args, use_reentrant=False, **extra, **kwargs)

    @contextlib.contextmanager
    def _ac_entered(self):
        self._ac_inside = True
        try:
            yield
        finally:
            self._ac_inside = False


@functools.cache
def _checkpointed_class(cls: type) -> type:
    return type(f"Checkpointed{cls.__name__}", (Checkpointed, cls), {})
