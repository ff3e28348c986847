"""Run a training job: checks that need the data, then the ranks.

``prepare`` runs once, in the launching process, before any rank starts: it
builds (or finds) the token file, so ranks never race to build it, and checks
what only the data or the environment can tell. ``train`` starts the ranks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from meshwise import launch
from meshwise.checkpoint import resume
from meshwise.corpus import available_cpus
from meshwise.data import TokenDataset, recorded_tokenizer, resolve_data
from meshwise.tokenizer import check_vocab_fits, load_tokenizer
from meshwise.train.config import TrainConfig
from meshwise.train.init_from import check_init_from

log = logging.getLogger("meshwise")


def apply_launch_defaults(cfg: TrainConfig, origins: dict[str, str]) -> None:
    """``--dp`` when not given: the world / (tp x pp) under torchrun, 2 for the CPU demo."""
    p = cfg.parallel
    if launch.under_torchrun() and not cfg.comm.ranks_per_node and "LOCAL_WORLD_SIZE" in os.environ:
        cfg.comm.ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])  # node grouping
        origins["ranks_per_node"] = "torchrun"
    if "dp" in origins:
        return
    if launch.under_torchrun():
        world, per_replica = launch.torchrun_world_size(), p.tp * p.pp
        if world % per_replica == 0 and world // per_replica != p.dp:
            p.dp = world // per_replica
            origins["dp"] = "torchrun"
            log.info("--dp %d: torchrun started %d processes for tp %d x pp %d", p.dp, world,
                     p.tp, p.pp)
        return
    demo = (p.tp == 1 and p.pp == 1 and cfg.data.batch_size % (2 * cfg.data.grad_accum) == 0)
    if demo and launch.resolve_device(cfg.runtime.device) == "cpu":
        p.dp = 2
        origins["dp"] = "demo"


def record_config(cfg: TrainConfig, origins: dict[str, str]) -> None:
    """Show the effective configuration once; keep it beside the metrics file."""
    from meshwise.train.flags import effective_config

    log.info("configuration (marked: not a default):\n  %s",
             "\n  ".join(effective_config(cfg, origins)))
    if cfg.runtime.metrics:
        path = Path(cfg.runtime.metrics)
        side = path.with_name(path.name + ".config.json")
        side.write_text(json.dumps({"config": dataclasses.asdict(cfg), "origins": origins},
                                   indent=1) + "\n")


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
        local = cfg.parallel.dims.world_size
        if not launch.under_torchrun() and local > torch.cuda.device_count():
            raise ValueError(f"dp x tp x pp = {local} local ranks need {local} GPUs, but "
                             f"{torch.cuda.device_count()} are visible; use fewer ranks, or "
                             "torchrun across nodes")
        if cfg.runtime.dtype == "bf16" and not _native_bf16(torch):
            name = torch.cuda.get_device_name()
            raise ValueError(f"--dtype bf16: {name} has no bfloat16 support (CUDA needs "
                             "compute capability 8.0 or newer); valid here: --dtype fp32")
    if cfg.runtime.metrics:
        check_writable_file(cfg.runtime.metrics, "--metrics")
    if device == "cpu" and cfg.runtime.dtype == "bf16":
        slowdown = bf16_slowdown()
        if slowdown > 2:
            log.warning("warning: --dtype bf16: a bf16 matmul measured %.0fx slower than fp32 on "
                        "this CPU (no native bf16 support); fp32 will train faster", slowdown)
    check_init_from(cfg)
    path = prepare_data(cfg)
    dataset = TokenDataset(path, cfg.data.seq_len, vocab_size=cfg.model.vocab_size)  # checks
    c = cfg.checkpoint
    if c.save:
        resume.check_save_dir(c.save)
        resume.check_not_overwriting(c.save, c.resume)
    start = resume.find_resume(c.resume, c.save)
    if start is not None:
        ckpt = resume.open_verified(start, cfg.model.sizes(dataset.vocab_size))
        check_same_tokenizer(ckpt.meta.get("config", {}), cfg)
    return path


def prepare_data(cfg: TrainConfig) -> Path:
    """The token file for ``--data``, encoded with ``--tokenizer`` when given.

    Records the tokenizer (path and digest) in ``cfg.data``, so the metrics'
    config file and every checkpoint's manifest name it, and takes the model's
    vocabulary from it when ``--vocab-size`` is not given. A ``.bin`` prepared
    with a tokenizer brings it along when ``--tokenizer`` is not given.
    """
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer) if d.tokenizer else None
    if tokenizer is not None:
        check_vocab_fits(tokenizer, cfg.model.vocab_size)
    path = resolve_data(d.path, d.cache_dir, tokenizer, num_workers=available_cpus())
    tokenizer = tokenizer or recorded_tokenizer(path)
    if tokenizer is not None and tokenizer.path is not None:
        d.tokenizer, d.tokenizer_digest = tokenizer.path, tokenizer.digest
        cfg.model.vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
        log.info("tokenizer: %s", tokenizer.describe())
    return path


def check_same_tokenizer(saved: dict, cfg: TrainConfig) -> None:
    """A run resumes only with the tokenizer its checkpoint was trained with."""
    theirs = saved.get("data", {}).get("tokenizer_digest")
    if theirs != cfg.data.tokenizer_digest:
        name = saved.get("data", {}).get("tokenizer") or "byte-level"
        raise ValueError(f"--resume: the checkpoint was trained with the tokenizer {name} "
                         f"(digest {theirs}), this run has {cfg.data.tokenizer or 'byte-level'} "
                         f"(digest {cfg.data.tokenizer_digest}); valid: --tokenizer {name}")


def _native_bf16(torch) -> bool:
    """Whether the GPU computes in bf16 itself (not emulated through fp32)."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # PyTorch before 2.3 only reports native support
        return torch.cuda.is_bf16_supported()


def bf16_slowdown(size: int = 256, repeats: int = 5) -> float:
    """Time of a bf16 matmul over an fp32 one here (median of ``repeats``).

    On one thread: the launcher forks the ranks afterwards, and a thread pool
    must not exist at a fork (``meshwise.launch.start_method``).
    """
    import statistics
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(size, size).to(dtype)
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ a
                runs.append(time.perf_counter() - start)
            times[dtype] = statistics.median(runs)
    finally:
        torch.set_num_threads(threads)
    return times[torch.bfloat16] / max(times[torch.float32], 1e-9)


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
