"""``meshwise`` command line: ``train``, ``schedule``, ``export`` and ``generate``.

The entry point only parses, validates and hands over: configuration errors exit
with status 2 and one line before any rank starts; training itself lives in
``meshwise.train``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from meshwise.train.config import (DEVICES, DTYPES, MODEL_PRESETS, ON_NAN, SCHEDULES,
                                   ZERO_STAGES, TrainConfig)

# (flag, config section, field, type, help). TOML files use the same names,
# either flat (``batch-size = 32``) or under their section (``[data] batch_size = 32``).
TRAIN_FLAGS = [
    ("--dp", "parallel", "dp", int, "data-parallel ranks (default 2 for the CPU demo, else 1)"),
    ("--tp", "parallel", "tp", int, "tensor-parallel ranks (default 1)"),
    ("--pp", "parallel", "pp", int, "pipeline stages (default 1)"),
    ("--schedule", "parallel", "schedule", str,
     f"pipeline schedule: {', '.join(SCHEDULES)} (default 1f1b)"),
    ("--virtual-stages", "parallel", "virtual_stages", int,
     "model chunks per pipeline rank, for interleaved-1f1b (default 1)"),
    ("--micro-batches", "parallel", "micro_batches", int,
     "pipeline micro-batches per step (default: pp)"),
    ("--zero", "parallel", "zero", int,
     "ZeRO stage: 0 none, 1 optimizer state, 2 +gradients, 3 +parameters (default 0)"),
    ("--grad-accum", "data", "grad_accum", int,
     "gradient accumulation micro-steps per optimizer step (default 1)"),
    ("--model", "model", "preset", str, f"model preset: {', '.join(MODEL_PRESETS)} (default tiny)"),
    ("--n-layer", "model", "n_layer", int, "override the preset's number of layers"),
    ("--n-head", "model", "n_head", int, "override the preset's number of attention heads"),
    ("--d-model", "model", "d_model", int, "override the preset's hidden size"),
    ("--block-size", "model", "block_size", int,
     "override the preset's context length (learned positions)"),
    ("--vocab-size", "model", "vocab_size", int,
     "vocabulary of the model; needed for a .bin with token ids past 255 "
     "(default: the data's, byte-level 256)"),
    ("--seq-len", "data", "seq_len", int, "tokens per sequence (default 128)"),
    ("--batch-size", "data", "batch_size", int,
     "global sequences per optimizer step, whatever the layout (default 16)"),
    ("--data", "data", "path", str, "a text file, a folder of text files, or a .bin of uint16 "
     "tokens (default: the Python standard library's sources, byte-level)"),
    ("--cache-dir", "data", "cache_dir", str,
     "where built token files are cached (default $MESHWISE_CACHE or ~/.cache/meshwise)"),
    ("--eval-every", "data", "eval_every", int,
     "validation loss every N steps; 0: only at the end (default 0)"),
    ("--eval-batches", "data", "eval_batches", int, "global batches per evaluation (default 4)"),
    ("--sample-tokens", "data", "sample_tokens", int,
     "print a sample of N generated tokens at the end (default 0)"),
    ("--seed", "data", "seed", int, "seed for initialisation and batches (default 1234)"),
    ("--steps", "optim", "steps", int, "optimizer steps (default 200)"),
    ("--lr", "optim", "lr", float, "peak learning rate (default 1e-3)"),
    ("--warmup-steps", "optim", "warmup_steps", int,
     "linear warmup steps before cosine decay (default 20)"),
    ("--weight-decay", "optim", "weight_decay", float,
     "AdamW weight decay on matrices (default 0.1)"),
    ("--clip", "optim", "clip", float, "max global gradient norm; 0 turns clipping off (default 1.0)"),
    ("--beta1", "optim", "beta1", float, "AdamW's first-moment decay (default 0.9)"),
    ("--beta2", "optim", "beta2", float, "AdamW's second-moment decay (default 0.95)"),
    ("--on-nan", "optim", "on_nan", str,
     f"on a non-finite loss or gradient: {' or '.join(ON_NAN)} (default stop)"),
    ("--max-skipped-steps", "optim", "max_skipped_steps", int,
     "with --on-nan skip: stop after more than N skipped steps in a row (default 3)"),
    ("--bucket-mb", "comm", "bucket_mb", float, "gradient bucket size in MB (default 25)"),
    ("--timeout-s", "comm", "timeout_s", float,
     "seconds a collective may wait before the job fails (default 300)"),
    ("--device", "runtime", "device", str,
     f"{', '.join(DEVICES)}: auto picks cuda (NCCL) when available, else cpu (gloo)"),
    ("--dtype", "runtime", "dtype", str, f"{' or '.join(DTYPES)} compute (default fp32)"),
    ("--metrics", "runtime", "metrics", str, "write one JSON line per step to this file"),
    ("--log-every", "runtime", "log_every", int,
     "progress line every N steps when output is not a terminal (default 10)"),
    ("--save", "checkpoint", "save", str,
     "write sharded checkpoints under this directory (step-NNNNNNNN/ each)"),
    ("--save-every", "checkpoint", "save_every", int,
     "checkpoint every N steps, and at the end (default: only at the end)"),
    ("--keep-last", "checkpoint", "keep_last", int,
     "keep only the newest K checkpoints in --save (default: keep all)"),
    ("--resume", "checkpoint", "resume", str,
     "continue from a checkpoint, or a --save directory's newest one; 'auto': the newest "
     "in --save if there is one, else start fresh. Any layout can resume any other"),
    ("--max-restarts", "checkpoint", "max_restarts", int,
     "when a rank dies, restart the job from the newest checkpoint up to N times "
     "(default 0)"),
]


class ConfigError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshwise", description="3D-parallel training for PyTorch (data, tensor, pipeline).")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a GPT across local ranks (or join a torchrun launch)",
        description="Train a GPT. With no flags on a CPU machine: the tiny preset on 2 "
                    "data-parallel ranks over the Python standard library's sources.")
    for flag, _, field, kind, help_text in TRAIN_FLAGS:
        train.add_argument(flag, dest=field, type=kind, default=argparse.SUPPRESS, help=help_text)
    train.add_argument("--config", dest="config_file", default=argparse.SUPPRESS,
                       help="TOML file with the same keys; flags given here override it")
    train.add_argument("-q", "--quiet", action="store_true", help="only warnings and the summary")
    from meshwise.pipeline.schedule_cmd import add_schedule_arguments

    schedule = sub.add_parser("schedule", help="print or plot a pipeline schedule and its bubble")
    add_schedule_arguments(schedule)
    from meshwise.export import add_export_arguments
    from meshwise.generate import add_generate_arguments

    export = sub.add_parser("export", help="write a checkpoint as one unsharded model",
                            description="Write a checkpoint's model, unsharded, in a format "
                                        "readable without meshwise.")
    add_export_arguments(export)
    generate = sub.add_parser("generate", help="sample text from a checkpoint (one process)",
                              description="Continue a prompt with a checkpoint's model on one "
                                          "process, using a KV cache.")
    add_generate_arguments(generate)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the TOML file, then the flags given; validated."""
    cfg = TrainConfig()
    values = {}
    if getattr(args, "config_file", None):
        values.update(_read_toml(args.config_file))
    given = {field: getattr(args, field) for _, _, field, _, _ in TRAIN_FLAGS if hasattr(args, field)}
    by_field = {field: (section, kind) for _, section, field, kind, _ in TRAIN_FLAGS}
    for field, value in {**values, **given}.items():
        section, kind = by_field[field]
        try:
            value = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{field} {value!r} is not a valid {kind.__name__}") from None
        setattr(getattr(cfg, section), field, value)
    if "dp" not in values and "dp" not in given and _demo_defaults(cfg):
        cfg.parallel.dp = 2
    return cfg.validate()


def _demo_defaults(cfg: TrainConfig) -> bool:
    """The no-flag demo runs on 2 data-parallel ranks when nothing else is laid out."""
    p = cfg.parallel
    return p.tp == 1 and p.pp == 1 and cfg.data.batch_size % (2 * cfg.data.grad_accum) == 0


def _read_toml(path: str) -> dict:
    """Flat or sectioned keys of a TOML file, each checked for its section and type."""
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config {path}: not a readable TOML file ({exc})") from None
    sections = sorted({section for _, section, _, _, _ in TRAIN_FLAGS})
    flat = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in sections:
                raise ConfigError(f"--config {path}: unknown section [{key}]; valid: "
                                  f"{', '.join(sections)}")
            items = [(name, item, key) for name, item in value.items()]
        else:
            items = [(key, value, None)]
        for name, item, section in items:
            field, kind = _toml_key(path, name, section)
            flat[field] = _typed(path, name, item, kind)
    return flat


def _toml_key(path: str, name: str, section: str | None) -> tuple[str, type]:
    by_name = {}
    for flag, flag_section, field, kind, _ in TRAIN_FLAGS:
        by_name[flag.lstrip("-")] = by_name[field] = (flag_section, field, kind)
    if name not in by_name:
        raise ConfigError(f"--config {path}: unknown key {name!r}; valid keys are the flag "
                          "names, e.g. batch-size, dp, lr")
    want, field, kind = by_name[name]
    if section is not None and section != want:
        raise ConfigError(f"--config {path}: {name!r} belongs under [{want}], not [{section}]")
    return field, kind


def _typed(path: str, name: str, value, kind: type):
    """``value`` as ``kind``, refusing conversions that would change it (2.7 -> 2, true -> 1)."""
    ok = {int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str)}[kind]
    if not ok:
        wanted = {int: "an integer", float: "a number", str: "a string"}[kind]
        raise ConfigError(f"--config {path}: {name} = {value!r} is not {wanted}")
    return kind(value)


def _run_offline(args) -> int:
    """``export`` and ``generate``: one process, bad input exits 2 with one line."""
    try:
        if args.command == "export":
            from meshwise.export import run_export

            print(f"wrote {run_export(args)}")
        else:
            from meshwise.generate import printable, run_generate

            print(printable(args.prompt + run_generate(args)))
    except ValueError as exc:
        print(f"meshwise {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "schedule":
        from meshwise.pipeline.schedule_cmd import run_schedule

        return run_schedule(args)
    if args.command in ("export", "generate"):
        return _run_offline(args)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(message)s")
    from meshwise.launch import RankFailed, Stopped
    from meshwise.train.run import prepare, train

    try:
        cfg = config_from_args(args)
        cfg.runtime.quiet = args.quiet
        data_path = prepare(cfg)
    except ValueError as exc:
        print(f"meshwise train: error: {exc}", file=sys.stderr)
        return 2
    try:
        train(cfg, data_path)
    except RankFailed as exc:
        print(f"meshwise train: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
