"""Run a training job: checks that need the data, then the ranks.

``prepare`` runs once, in the launching process, before any rank starts: it
builds (or finds) the token file, so ranks never race to build it, and checks
what only the data or the environment can tell. ``train`` starts the ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path

from meshwise import launch
from meshwise.checkpoint import resume
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
    if cfg.runtime.metrics:
        check_writable_file(cfg.runtime.metrics, "--metrics")
    path = resolve_data(cfg.data.path, cfg.data.cache_dir)
    dataset = TokenDataset(path, cfg.data.seq_len, vocab_size=cfg.model.vocab_size)  # checks
    c = cfg.checkpoint
    if c.save:
        resume.check_save_dir(c.save)
        resume.check_not_overwriting(c.save, c.resume)
    start = resume.find_resume(c.resume, c.save)
    if start is not None:
        resume.open_verified(start, model_shape(cfg, dataset.vocab_size))
    return path


def check_writable_file(path: str, flag: str) -> None:
    """Create ``path``'s folder and the file itself now, or say why it cannot be."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None


def train(cfg: TrainConfig, data_path: Path) -> None:
    """Start every rank (or join torchrun's) and train; raises ``launch.RankFailed``.

    With ``--max-restarts N``, a failed job is torn down and started again from
    the newest checkpoint in ``--save``, at most N times.
    """
    device = launch.resolve_device(cfg.runtime.device)
    c = cfg.checkpoint
    start = resume.find_resume(c.resume, c.save)
    for attempt in range(c.max_restarts + 1):
        try:
            launch.launch(_rank_main, (cfg, str(data_path), device, start and str(start)),
                          cfg.parallel.dims.world_size, device, cfg.comm.timeout_s)
            return
        except launch.RankFailed as exc:
            if attempt == c.max_restarts:
                raise
            start = resume.newest_or(c.save, start)
            log.warning("%s\nrestart %d of %d from %s", exc, attempt + 1, c.max_restarts,
                        start or "the beginning (no checkpoint yet)")


def model_shape(cfg: TrainConfig, vocab_size: int) -> dict:
    """What a checkpoint must match to be resumed: the model's sizes, not its layout."""
    m = cfg.model.resolved()
    return {"n_layer": m.n_layer, "n_head": m.n_head, "d_model": m.d_model,
            "vocab_size": vocab_size, "block_size": m.block_size}


def _rank_main(cfg: TrainConfig, data_path: str, device: str, start: str | None) -> None:
    import dataclasses
    import os

    from meshwise.train.trainer import Trainer

    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device=device))
    rank = int(os.environ.get("RANK", 0))
    # One logger, prefixed with the rank; only rank 0 speaks below warnings.
    level = logging.INFO if rank == 0 and not cfg.runtime.quiet else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {rank}] %(message)s", force=True)
    Trainer(cfg, data_path, resume=start).train()
