"""``meshwise train --layout auto``: the planner's best layout for the launched world.

Resolved in the launcher before any rank starts, for the run's model and LoRA settings;
the world is torchrun's, else the product of the axis flags given, else one rank per GPU,
else 2 CPU ranks. Layout flags
given narrow the search; the choice and the next best are logged (docs/choosing-a-layout.md).
"""

from __future__ import annotations

import argparse
import logging

from meshwise.cli import launch
from meshwise.device import choice
from meshwise.planner.layout import Layout
from meshwise.planner.request import plan_request
from meshwise.planner.search import Space
from meshwise.train.config import TrainConfig

log = logging.getLogger("meshwise")
AXES = ("dp", "cp", "tp", "pp")
# Layout settings the planner chooses: given as flags, they narrow its search instead.
CHOSEN = (
    "dp",
    "cp",
    "tp",
    "pp",
    "sp",
    "schedule",
    "virtual_stages",
    "micro_batches",
    "grad_accum",
    "zero",
    "activation_checkpointing",
)


def add_layout_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layout",
        choices=("auto",),
        default=None,
        help="auto: the layout meshwise plan predicts fastest for the launched "
        "world (torchrun's, else the product of the axis flags given, else "
        "one rank per GPU, else 2 on a CPU) that fits the devices' memory; "
        "--zero, --schedule, --activation-checkpointing given narrow the "
        "choice",
    )


def launched_world(cfg: TrainConfig, origins: dict[str, str], device: str) -> int:
    if launch.under_torchrun():
        return launch.torchrun_world_size()
    if any(axis in origins for axis in AXES):
        return cfg.parallel.dims.world_size
    if device == "cuda":
        return len(choice.gpu_facts()["gpus"])
    return 2


def gpu_profile_name(device: str) -> str:
    """The planner's profile of this machine's GPUs (ValueError for one it has none of)."""
    if device != "cuda":
        return "cpu"
    from meshwise.planner.devices import GPU_PROFILES

    name = choice.gpu_facts()["gpus"][0]["name"]
    for key in ("H200", "H100", "A100"):
        if key in name:
            return key.lower()
    raise ValueError(
        f"--layout auto: no planner profile for {name}; valid: GPUs of "
        f"{', '.join(GPU_PROFILES)}, or give the layout's flags"
    )


def choose_layout(cfg: TrainConfig, origins: dict[str, str]) -> TrainConfig:
    """``cfg`` laid out as the planner's best layout for the launched world."""
    device = choice.resolve_device(cfg.runtime.device)
    world = launched_world(cfg, origins, device)
    space = Space(
        zero=(cfg.parallel.zero,) if "zero" in origins else Space().zero,
        schedules=(cfg.parallel.schedule,) if "schedule" in origins else Space().schedules,
        activation_checkpointing=(
            (cfg.runtime.activation_checkpointing,)
            if "activation_checkpointing" in origins
            else Space().activation_checkpointing
        ),
        compress=cfg.comm.compress,
    )
    # the model, data, runtime and LoRA settings (--lora-from's read already); the layout
    # is the planner's
    base = Layout().apply(cfg)
    request = plan_request(
        base, world, gpu_profile_name(device), space, cache_dir=cfg.data.cache_dir
    )
    ranked = request.run()
    best = ranked[0]
    log.info(
        "--layout auto: %s for %d ranks on %s: predicted %s tokens/s, peak %.2f GiB of "
        "%.2f GiB per rank (%d layouts fit)",
        best.layout.flags(),
        world,
        request.device.name,
        f"{best.tokens_per_s:,.0f}",
        best.memory.total / 2**30,
        request.limit / 2**30,
        len(ranked),
    )
    for other in ranked[1:3]:
        log.info(
            "  next: %s: %s tokens/s, %.2f GiB",
            other.layout.flags(),
            f"{other.tokens_per_s:,.0f}",
            other.memory.total / 2**30,
        )
    chosen, default = best.layout.apply(cfg), Layout().apply(TrainConfig())
    for field in CHOSEN:  # marked where auto set a value (the configuration shows it)
        if field in origins or _value(chosen, field) != _value(default, field):
            origins[field] = "auto"
    return chosen


def _value(cfg: TrainConfig, field: str):
    for section in (cfg.parallel, cfg.data, cfg.runtime):
        if hasattr(section, field):
            return getattr(section, field)
    raise KeyError(field)
