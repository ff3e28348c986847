"""``meshwise train``: flags (and ``--config``) to a validated configuration, the checks and
run state of ``preflight``, then every rank started (or torchrun's joined); bad
configuration exits 2 with one line before any rank starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

from meshwise.checkpoint import resume
from meshwise.checkpoint.lineage import new_run_id
from meshwise.cli import launch
from meshwise.cli.auto_layout import choose_layout
from meshwise.cli.checkpoint_dir import held_save_dir
from meshwise.cli.preflight import prepare
from meshwise.cli.train_flags import config_from_args, effective_config
from meshwise.cli.unused_settings import noop_warnings
from meshwise.device import choice
from meshwise.train.config import TrainConfig
from meshwise.train.init_from import apply_init_from
from meshwise.train.lora_setup import apply_lora_from
from meshwise.train.lr_schedule import warmup_warning
from meshwise.train.run_state import RunState, record

log = logging.getLogger("meshwise")


def run_train(args: argparse.Namespace) -> int:
    """``meshwise train``: the exit status."""
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    launch.die_with_torchrun()  # before the checks, which may take a while (a corpus build)
    # SIGTERM and SIGHUP unwind like Ctrl-C, so a half-built corpus or save leaves no
    # temporary.
    previous = {
        signum: signal.signal(signum, launch.raise_stopped) for signum in launch.STOP_SIGNALS
    }
    try:
        with contextlib.ExitStack() as held:
            try:
                cfg, origins = train_config(args)
                clamped = warmup_warning(cfg.optim)
                for warning in noop_warnings(cfg, origins) + ([clamped] if clamped else []):
                    log.warning("warning: %s", warning)
                run_id = new_run_id()
                # Held until the job ends, however it ends.
                held.enter_context(held_save_dir(cfg, run_id))
                data_path, run = prepare(cfg, run_id)
                record_config(cfg, run, origins)
            except ValueError as exc:
                print(f"meshwise train: error: {exc}", file=sys.stderr)
                return 2
            train(cfg, run, data_path)
    except launch.RankFailed as exc:
        print(f"meshwise train: {exc}", file=sys.stderr)
        return 1
    except launch.Stopped as exc:
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def train_config(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, str]]:
    """The validated configuration of ``meshwise train`` and where each value came from."""
    cfg, origins = config_from_args(args)
    cfg.runtime.quiet = args.quiet
    apply_init_from(cfg, origins)
    apply_lora_from(cfg, origins)
    apply_launch_defaults(cfg, origins)
    if getattr(args, "layout", None) == "auto":
        cfg = choose_layout(cfg, origins)  # the planner's best for the launched world
    return cfg.validate(), origins


def apply_launch_defaults(cfg: TrainConfig, origins: dict[str, str]) -> None:
    """``--dtype auto`` for the device; ``--dp`` when not given: the world / (cp x tp x
    pp) under torchrun, 2 for the CPU demo."""
    p = cfg.parallel
    if cfg.runtime.dtype == "auto":
        device = choice.resolve_device(cfg.runtime.device)
        cfg.runtime.dtype = choice.resolve_dtype("auto", device, gpus_take_bf16)
        if cfg.runtime.dtype != "fp32":
            origins["dtype"] = f"auto on {device}"
    if launch.under_torchrun() and not cfg.comm.ranks_per_node and "LOCAL_WORLD_SIZE" in os.environ:
        cfg.comm.ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])  # node grouping
        origins["ranks_per_node"] = "torchrun"
    if "dp" in origins:
        return
    if launch.under_torchrun():
        world, per_replica = launch.torchrun_world_size(), p.cp * p.tp * p.pp
        if world % per_replica == 0 and world // per_replica != p.dp:
            p.dp = world // per_replica
            origins["dp"] = "torchrun"
            log.info(
                "--dp %d: torchrun started %d processes for cp %d x tp %d x pp %d",
                p.dp,
                world,
                p.cp,
                p.tp,
                p.pp,
            )
        return
    demo = (
        p.tp == 1
        and p.pp == 1
        and p.cp == 1
        and cfg.data.batch_size % (2 * cfg.data.grad_accum) == 0
    )
    if demo and choice.resolve_device(cfg.runtime.device) == "cpu":
        p.dp = 2
        origins["dp"] = "demo"


def gpus_take_bf16() -> bool:
    """Whether the visible GPUs and NCCL take bf16, asked of a child process (the
    launcher creates no CUDA context)."""
    facts = choice.gpu_facts()
    return choice.takes_bf16([gpu["capability"] for gpu in facts["gpus"]], facts["nccl"])


def record_config(cfg: TrainConfig, run: RunState, origins: dict[str, str]) -> None:
    """Show the effective configuration once; keep it, with the run state, beside the
    metrics file."""
    log.info(
        "configuration (marked: not a default):\n  %s", "\n  ".join(effective_config(cfg, origins))
    )
    if cfg.runtime.metrics:
        path = Path(cfg.runtime.metrics)
        side = path.with_name(path.name + ".config.json")
        side.write_text(json.dumps({**record(cfg, run), "origins": origins}, indent=1) + "\n")


def train(cfg: TrainConfig, run: RunState, data_path: Path) -> None:
    """Start every rank (or join torchrun's) and train; raises ``launch.RankFailed``. With
    ``--max-restarts N`` a failed job starts again from the newest checkpoint, N times at most,
    each launch's run state starting from the checkpoint it resumes.
    """
    device = choice.resolve_device(cfg.runtime.device)
    c = cfg.checkpoint
    for attempt in range(c.max_restarts + 1):
        try:
            launch.launch(
                _rank_main,
                (cfg, run, str(data_path), device),
                cfg.parallel.dims.world_size,
                device,
                cfg.comm.timeout_s,
                ledger_out=cfg.ledger_dir(),
            )
            return
        except launch.RankFailed as exc:
            if attempt == c.max_restarts:
                if c.max_restarts:
                    raise launch.RankFailed(
                        f"{exc}\ngave up: the job failed {attempt + 1} "
                        f"times (--max-restarts {c.max_restarts})"
                    ) from None
                raise
            start = resume.newest_or(c.save, run.start)
            run = run.starting_from(cfg.optim, start)
            log.warning(
                "%s\nrestart %d of %d from %s",
                exc,
                attempt + 1,
                c.max_restarts,
                start or "the beginning (no checkpoint yet)",
            )


def _rank_main(cfg: TrainConfig, run: RunState, data_path: str, device: str) -> None:
    # In the rank: the launcher needs no model.
    from meshwise.train import faults
    from meshwise.train.trainer import Trainer

    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device=device))
    rank = int(os.environ.get("RANK", 0))
    # One logger, prefixed with the rank; only rank 0 speaks below warnings.
    level = logging.INFO if rank == 0 and not cfg.runtime.quiet else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {rank}] %(message)s", force=True)
    trainer = Trainer(cfg, data_path, run=run)
    faults.install(trainer)  # MESHWISE_FAIL_AT, for the tests of how a failing job ends
    trainer.train()
