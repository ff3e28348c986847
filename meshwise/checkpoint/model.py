"""A checkpoint's model as one unsharded, single-process module.

What ``meshwise export`` writes and ``meshwise generate`` samples from: the
logical tensors read whole from whatever layout saved them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshwise.checkpoint.state import KIND_PREFIX
from meshwise.checkpoint.store import Checkpoint, CheckpointError, resolve
from meshwise.models.families import family
from meshwise.parallelize import set_param

PARAM_PREFIX = KIND_PREFIX["param"]


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint directory, or a ``--save`` directory's newest one, verified."""
    if not Path(path).exists():
        raise CheckpointError(f"{path}: no such file or directory")
    ckpt = Checkpoint(resolve(path))
    ckpt.verify()
    return ckpt


def model_family(ckpt: Checkpoint) -> str:
    """The checkpoint's model family (older checkpoints are GPTs)."""
    return ckpt.meta["model"].get("family", "gpt")


def model_config(ckpt: Checkpoint):
    """The checkpoint's model config, of its family."""
    return family(model_family(ckpt)).make_config(ckpt.meta["model"])


def model_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Every model parameter, whole, under its single-process name."""
    return {name[len(PARAM_PREFIX):]: ckpt.read(name) for name in sorted(ckpt.tensors)
            if name.startswith(PARAM_PREFIX)}


@torch.no_grad()
def load_model(ckpt: Checkpoint) -> torch.nn.Module:
    """The single-process model holding the checkpoint's parameters (evaluation mode)."""
    fam, cfg = family(model_family(ckpt)), model_config(ckpt)
    with torch.device("meta"):
        model = fam.build(cfg, None)
    tensors = model_tensors(ckpt)
    names = [name for name, _ in model.named_parameters()]  # a tie appears once
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise CheckpointError(f"{ckpt.path}: no values for {', '.join(missing[:3])}")
    model.to_empty(device="cpu")
    params = dict(model.named_parameters())
    for name in names:
        params[name].copy_(tensors[name].view(params[name].shape))
    plan = fam.plan(cfg)
    for tie in plan.ties:  # to_empty gave each member its own storage: tie them again
        for name in tie[1:]:
            set_param(model, name, model.get_parameter(tie[0]))
    return model.eval()
