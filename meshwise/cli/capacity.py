"""What a run needs before it starts: memory for its state, disk for a checkpoint.

Lower bounds from the parameter count (meta device): at least 16 bytes per parameter
across all ranks whatever the layout, refused in one line when more than memory and swap;
a checkpoint 12 bytes per parameter plus, with error feedback, 4 per dp replica.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshwise.checkpoint.save_dir import human_bytes
from meshwise.cli import launch
from meshwise.cli.ranks import memory_limit_bytes
from meshwise.planner.memory import model_state_bytes_per_param
from meshwise.planner.shapes import parameter_count  # noqa: F401 (this module's interface)
from meshwise.train.config import TrainConfig

# fp32 parameter, gradient, AdamW's two moments: the README's table, held once across all
# ranks at ZeRO-3 (the least any layout holds; meshwise plan counts the rest)
# Parameters, gradients and AdamW's moments once across all ranks: what ZeRO-3 shards
# exactly; every other layout replicates more.
TRAIN_STATE_BYTES_PER_PARAM = model_state_bytes_per_param(3, 1, "fp32", "fp32")
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 parameter (the master copy) and both moments


def checkpoint_bytes(cfg: TrainConfig, num_params: int) -> int:
    """About what one checkpoint of this run takes on disk."""
    total = CHECKPOINT_BYTES_PER_PARAM * num_params
    if cfg.comm.compress != "none" and cfg.comm.error_feedback == "on":
        total += 4 * num_params * cfg.parallel.dp
    return total


def check_memory(cfg: TrainConfig, num_params: int, vocab_size: int, device: str) -> None:
    """Refuse a model whose training state cannot fit, however it is laid out."""
    world = cfg.parallel.dims.world_size
    local = world
    if launch.under_torchrun():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    state = TRAIN_STATE_BYTES_PER_PARAM * num_params
    if device == "cuda":
        import torch

        have, where = torch.cuda.get_device_properties(0).total_memory, "one GPU"
        need = state / world
    else:
        have, where = memory_limit_bytes() + _swap_bytes(), "this machine (memory and swap)"
        need = state * local / world
    if have and need > have:
        m = cfg.model.resolved()
        raise ValueError(
            f"the model has {num_params / 1e9:.2f} B parameters (--vocab-size {vocab_size}, "
            f"--d-model {m.d_model}, --n-layer {m.n_layer}); its weights, gradients and AdamW "
            f"state alone need at least {human_bytes(need)} on {where}, which has "
            f"{human_bytes(have)}; valid: a smaller model, or more ranks across machines"
        )


def _swap_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
