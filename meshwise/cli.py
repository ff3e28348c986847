"""``meshwise`` command line: ``train``, ``schedule``, ``export``, ``generate``, ``data``, ``bench``.

The entry point only parses, validates and hands over: configuration errors exit
with status 2 and one line before any rank starts; training itself lives in
``meshwise.train``.
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("meshwise")

from meshwise.train.config import TrainConfig
from meshwise.train.flags import add_train_arguments, config_from_args

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshwise", description="3D-parallel training for PyTorch (data, tensor, pipeline).")
    parser.add_argument("--version", action="version", version=f"meshwise {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a GPT or a Llama across local ranks (or join a torchrun launch)",
        description="Train a GPT or a Llama (--model, --init-from). With no flags on a CPU "
                    "machine: the tiny GPT preset on 2 data-parallel ranks over the Python "
                    "standard library's sources.")
    add_train_arguments(train)
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
    from meshwise.data_cmd import add_data_arguments

    data = sub.add_parser("data", help="text to token files; train a tokenizer",
                          description="Prepare token files for --data and train tokenizers "
                                      "for --tokenizer.")
    add_data_arguments(data)
    from meshwise.comm.bench import add_bench_comm_arguments

    bench = sub.add_parser("bench", help="benchmarks: comm (all-reduce algorithms)")
    bench_comm = bench.add_subparsers(dest="bench", required=True).add_parser(
        "comm", help="bandwidth and latency per all-reduce algorithm and size",
        description="Time each all-reduce algorithm against the native collective, on local "
                    "ranks or under torchrun.")
    add_bench_comm_arguments(bench_comm)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshwise")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def train_config(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, str]]:
    """The validated configuration of ``meshwise train`` and where each value came from."""
    from meshwise.train.init_from import apply_init_from
    from meshwise.train.run import apply_launch_defaults

    cfg, origins = config_from_args(args)
    cfg.runtime.quiet = args.quiet
    apply_init_from(cfg, origins)
    apply_launch_defaults(cfg, origins)
    return cfg.validate(), origins


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
    if args.command == "bench":
        from meshwise.comm.bench import run_bench_comm

        return run_bench_comm(args)
    if args.command in ("export", "generate"):
        return _run_offline(args)
    if args.command == "data":
        from meshwise.data_cmd import run_data

        return run_data(args)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(message)s")
    from meshwise.launch import RankFailed, Stopped
    from meshwise.train.flags import noop_warnings
    from meshwise.train.run import prepare, record_config, train

    try:
        cfg, origins = train_config(args)
        for warning in noop_warnings(cfg, origins):
            log.warning("warning: %s", warning)
        data_path = prepare(cfg)
        record_config(cfg, origins)
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
