"""A checkpoint's model as one unsharded module, its logical tensors read whole from
whatever layout saved them (what ``export`` writes and ``generate`` samples from).
"""

from __future__ import annotations

import torch

from meshwise.apply.parallelize import set_param
from meshwise.checkpoint.state import model_tensors
from meshwise.checkpoint.store import Checkpoint, CheckpointError
from meshwise.geometry.init import on_meta
from meshwise.models.families import family
from meshwise.serve.adapter import merged_tensors, trained_adapters


def model_family(ckpt: Checkpoint) -> str:
    """The checkpoint's model family (older checkpoints are GPTs)."""
    return ckpt.meta["model"].get("family", "gpt")


def model_config(ckpt: Checkpoint):
    """The checkpoint's model config, of its family."""
    return family(model_family(ckpt)).make_config(ckpt.meta["model"])


@torch.no_grad()
def load_model(ckpt: Checkpoint) -> torch.nn.Module:
    """The single-process model holding the checkpoint's parameters (evaluation mode)."""
    fam, cfg = family(model_family(ckpt)), model_config(ckpt)
    with on_meta():
        model = fam.build(cfg)
    if trained_adapters(ckpt):  # adapters only: merged into the frozen weights rebuilt
        tensors = merged_tensors(ckpt, cfg, model_family(ckpt))
    else:
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
