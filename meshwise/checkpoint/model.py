"""A checkpoint's model as one unsharded, single-process module.

What ``meshwise export`` writes and ``meshwise generate`` samples from: the
logical tensors read whole from whatever layout saved them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshwise.checkpoint.state import KIND_PREFIX
from meshwise.checkpoint.store import Checkpoint, CheckpointError, resolve
from meshwise.models.gpt import GPT, GPTConfig

PARAM_PREFIX = KIND_PREFIX["param"]


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint directory, or a ``--save`` directory's newest one, verified."""
    if not Path(path).exists():
        raise CheckpointError(f"{path}: no such file or directory")
    ckpt = Checkpoint(resolve(path))
    ckpt.verify()
    return ckpt


def model_config(ckpt: Checkpoint) -> GPTConfig:
    m = ckpt.meta["model"]
    return GPTConfig(n_layer=m["n_layer"], n_head=m["n_head"], d_model=m["d_model"],
                     block_size=m["block_size"], vocab_size=m["vocab_size"])


def model_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Every model parameter, whole, under its single-process name."""
    return {name[len(PARAM_PREFIX):]: ckpt.read(name) for name in sorted(ckpt.tensors)
            if name.startswith(PARAM_PREFIX)}


@torch.no_grad()
def load_gpt(ckpt: Checkpoint) -> GPT:
    """The single-process GPT holding the checkpoint's parameters (evaluation mode)."""
    model = GPT(model_config(ckpt))
    tensors = model_tensors(ckpt)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise CheckpointError(f"{ckpt.path}: no values for {', '.join(missing[:3])}")
    for name, param in params.items():
        param.copy_(tensors[name].view(param.shape))
    return model.eval()
