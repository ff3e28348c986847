"""``meshwise plan``: which layout to run on N devices, memory and step time predicted by
``meshwise.planner``, the model from ``meshwise train``'s flags (docs/choosing-a-layout.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from meshwise.cli.train_flags import TRAIN_FLAGS, default_text
from meshwise.planner.devices import known_devices
from meshwise.planner.layout import Layout
from meshwise.planner.report import explain, table
from meshwise.planner.search import Space
from meshwise.train.config import DTYPES, GRAD_REDUCE_DTYPES, ZERO_STAGES, TrainConfig

PROG = "meshwise plan"
MODEL_FLAGS = [row for row in TRAIN_FLAGS if row[1] == "model" and row[2] != "dropout"]
# what of LoRA decides memory and time (alpha, dropout and initial values do not)
LORA_FLAGS = [
    row for row in TRAIN_FLAGS if row[2] in ("lora_rank", "lora_targets", "quantize_base")
]
PLAN_HELP = {  # where planning reads less than training
    "init_from": "a local Hugging Face directory: the model's sizes come from its config.json "
    "(nothing else is read; no weights needed)",
    "vocab_size": "vocabulary of the model (default: --init-from's config.json, else 256, "
    "byte-level)",
}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "List every valid layout of --world ranks that fits the devices' memory, ranked by "
        "predicted tokens/s, with each one's peak memory and step time and where they go. "
        "The model is given as to meshwise train (--model and its overrides, or --init-from "
        "a Hugging Face directory: only its config.json is read); with --lora-rank, a LoRA "
        "fine-tune of it (frozen weights, trained adapters)."
    )
    parser.add_argument(
        "--world", type=int, metavar="N", help="ranks (devices) to lay the model out on"
    )
    for flag, section, field, kind, help_text in MODEL_FLAGS + LORA_FLAGS:
        help_text = PLAN_HELP.get(field) or f"{help_text} (default: {default_text(section, field)})"
        parser.add_argument(flag, dest=field, type=kind, default=argparse.SUPPRESS, help=help_text)
    parser.add_argument(
        "--seq-len",
        type=int,
        default=TrainConfig().data.seq_len,
        help="tokens per sequence (default: %(default)s, as meshwise train)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=TrainConfig().data.batch_size,
        help="global sequences per optimizer step (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="compute dtype (auto, the default: bf16 on a GPU profile, fp32 on cpu)",
    )
    parser.add_argument(
        "--grad-reduce-dtype",
        choices=GRAD_REDUCE_DTYPES,
        default="fp32",
        help="with --dtype bf16: the dtype gradients are summed in (default: fp32)",
    )
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=TrainConfig().comm.bucket_mb,
        help="gradient bucket and ZeRO-3 unit size (default: %(default)s)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="price layers as meshwise train --compile runs them (the compiled-over-eager "
        "ratio --calibrate measures on the CPU; 1 where none is measured)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="NAME",
        help=f"device profile: {', '.join(known_devices())} (default: cpu, "
        "this machine as --calibrate measured it)",
    )
    parser.add_argument(
        "--device-memory-gb",
        type=float,
        metavar="G",
        help="memory of one device in GiB (default: the profile's; for cpu "
        "the machine's, shared by its ranks)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        metavar="K",
        help="machines the world spans; groups inside one use its fast links "
        "(default: one per 8 GPUs; cpu: 1)",
    )
    parser.add_argument(
        "--zero",
        metavar="STAGES",
        default=None,
        help="ZeRO stages to consider, comma-separated (default: 0,1,2,3)",
    )
    parser.add_argument(
        "--schedule",
        metavar="KINDS",
        default=None,
        help="pipeline schedules to consider, comma-separated (default: all)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        metavar="MODES",
        default=None,
        help="checkpointing modes to consider: none, selective, full "
        "(default: all; a layout is listed with the least that fits)",
    )
    parser.add_argument(
        "--compress",
        default="none",
        help="dp gradient compression to plan with (default: none; a lossy "
        "one changes the loss curve, so the search never picks one)",
    )
    parser.add_argument(
        "--top",
        type=int,
        default=15,
        metavar="N",
        help="rows of the table (default: %(default)s; --json lists all)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of every layout that fits, best first: layout "
        "(meshwise train's flags), peak_mem_bytes, step_time_s, "
        "tokens_per_s, mfu and the breakdowns",
    )
    parser.add_argument(
        "--explain",
        metavar="LAYOUT",
        help="print the memory and time breakdown of one layout, given as "
        'meshwise train\'s flags, e.g. "--dp 2 --tp 2 --zero 1"',
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (matmul rate per dtype, memory bandwidth, "
        "AdamW, a run's fixed memory, all-reduce alpha-beta on 2 and 4 "
        "ranks) and store it in the cache folder for --device cpu",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where --calibrate stores its results (default: $MESHWISE_CACHE or ~/.cache/meshwise)",
    )


def run_plan(args: argparse.Namespace) -> int:
    from meshwise.planner.request import NoLayoutFits, plan_request

    try:
        if args.calibrate:
            from meshwise.cli.calibrate import calibrate

            print(calibrate(args.cache_dir))
            if args.world is None:
                return 0
        if args.world is None:
            raise ValueError("--world N is needed (the ranks to lay the model out on)")
        request = plan_request(
            model_config(args),
            args.world,
            args.device,
            space_of(args),
            args.device_memory_gb,
            args.nodes,
            args.cache_dir,
        )
        if args.explain:
            print(explain(request, Layout.parse(args.explain)))
            return 0
        results = request.run()
    except NoLayoutFits as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([p.as_json() for p in results], indent=1))
    else:
        print(table(request, results, args.top))
    return 0


def model_config(args: argparse.Namespace) -> TrainConfig:
    """The model, sequence and batch of the plan, as ``meshwise train`` would read them."""
    from meshwise.train.init_from import apply_init_from

    cfg, origins = TrainConfig(), {}
    for _, _, field, _, _ in MODEL_FLAGS:
        if hasattr(args, field):
            setattr(cfg.model, field, getattr(args, field))
            origins[field] = "flag"
    apply_init_from(cfg, origins)
    for _, _, field, _, _ in LORA_FLAGS:
        if hasattr(args, field):
            setattr(cfg.lora, field, getattr(args, field))
    cfg.data.seq_len, cfg.data.batch_size = args.seq_len, args.batch_size
    gpu = args.device != "cpu"
    cfg.runtime.dtype = (
        args.dtype if args.dtype not in (None, "auto") else "bf16" if gpu else "fp32"
    )
    cfg.runtime.grad_reduce_dtype = args.grad_reduce_dtype
    cfg.runtime.device = "cuda" if gpu else "cpu"
    cfg.comm.bucket_mb = args.bucket_mb
    cfg.runtime.compile = args.compile
    cfg.validate()  # the model, sequence and batch on one rank: bad values exit 2 here
    return cfg


def space_of(args: argparse.Namespace) -> Space:
    """The choices the search may make, narrowed by the flags."""
    from meshwise.apply.activation_checkpointing import MODES
    from meshwise.pipeline.schedules import SCHEDULE_KINDS

    zero = _listed("--zero", args.zero, ZERO_STAGES, int)
    schedules = _listed("--schedule", args.schedule, SCHEDULE_KINDS, str)
    modes = _listed("--activation-checkpointing", args.activation_checkpointing, MODES, str)
    return Space(
        zero=zero, schedules=schedules, activation_checkpointing=modes, compress=args.compress
    )


def _listed(flag: str, text: str | None, valid: tuple, kind) -> tuple:
    if text is None:
        return tuple(valid)
    try:
        chosen = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
    except ValueError:
        chosen = ()
    bad = [v for v in chosen if v not in valid]
    if bad or not chosen:
        raise ValueError(
            f"{flag} {text!r} is not valid; valid: a comma-separated list of "
            f"{', '.join(map(str, valid))}"
        )
    return tuple(v for v in valid if v in chosen)  # in the order of the full list
