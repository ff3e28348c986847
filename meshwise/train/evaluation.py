"""Forwards without a backward: the held-out loss (``--eval-every``) and the forward-only
pass the end-of-run sample decodes with, through the pipeline where there is one.
"""

from __future__ import annotations

import torch

from meshwise.train.non_finite import reduce_to_host


@torch.no_grad()
def evaluate(trainer) -> float | None:
    """Mean labelled-token loss over ``eval_batches`` held-out global batches (None
    when they hold no labelled token)."""
    trainer.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=trainer.device)
    labelled = 0
    for i in range(trainer.cfg.data.eval_batches):
        [(inputs, targets)], contexts, count = trainer._micro_batches(i + 1, "val", num=1)
        labelled += count
        loss = forward_only(trainer, inputs, targets, contexts[0])
        if loss is not None and trainer.reports_loss:
            total += loss.detach()
    trainer.model.train()
    sums = reduce_to_host([total], "sum", trainer.device, trainer.mesh.world_group)
    return sums[0] / labelled if labelled else None


def forward_only(trainer, inputs, targets=None, context=None):
    """Forward only: the loss sum (or full logits) where the last stage is, else None."""
    if trainer.pipeline is None:
        out = call_model(trainer.model, inputs, context)
    else:
        out = trainer.pipeline.forward_only(inputs, context=context)
        if out is None:
            return None
    return (
        trainer.parallel_model.loss(out, targets)
        if targets is not None
        else trainer.parallel_model.full_logits(out)
    )


def call_model(model, inputs, context):
    """The model on ``inputs``, told its forward's ``context`` where it takes one."""
    return model(inputs) if context is None else model(inputs, context=context)
