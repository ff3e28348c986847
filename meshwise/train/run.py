"""Run a training job: checks that need the data, then the ranks.

``prepare`` runs once, in the launching process, before any rank starts: it
builds (or finds) the token file, so ranks never race to build it, and checks
what only the data or the environment can tell. ``train`` starts the ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path

from meshwise import launch
from meshwise.data import TokenDataset, resolve_data
from meshwise.train.config import TrainConfig

log = logging.getLogger("meshwise")


def prepare(cfg: TrainConfig) -> Path:
    """Validate against the data and the launch environment; return the token file."""
    if launch.under_torchrun():
        world = launch.torchrun_world_size()
        if world != cfg.parallel.dims.world_size:
            raise ValueError(f"torchrun started {world} processes but --dp x --tp x --pp = "
                             f"{cfg.parallel.dims.world_size}; launch with "
                             f"--nproc-per-node x --nnodes = {cfg.parallel.dims.world_size}")
    device = launch.resolve_device(cfg.runtime.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is available; valid: cpu, auto")
    path = resolve_data(cfg.data.path, cfg.data.cache_dir)
    TokenDataset(path, cfg.data.seq_len)  # raises if the corpus is too short
    return path


def train(cfg: TrainConfig, data_path: Path) -> None:
    """Start every rank (or join torchrun's) and train; raises ``launch.RankFailed``."""
    device = launch.resolve_device(cfg.runtime.device)
    launch.launch(_rank_main, (cfg, str(data_path), device), cfg.parallel.dims.world_size,
                  device, cfg.comm.timeout_s)


def _rank_main(cfg: TrainConfig, data_path: str, device: str) -> None:
    import dataclasses
    import os

    from meshwise.train.trainer import Trainer

    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device=device))
    rank = int(os.environ.get("RANK", 0))
    # One logger, prefixed with the rank; only rank 0 speaks below warnings.
    level = logging.INFO if rank == 0 and not cfg.runtime.quiet else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {rank}] %(message)s", force=True)
    Trainer(cfg, data_path).train()
