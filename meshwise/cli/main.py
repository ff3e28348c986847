"""The ``meshwise`` command: parses and hands over to each subcommand's module; bad input
exits 2 with one line before any rank starts.
"""

from __future__ import annotations

import argparse
import sys

from meshwise.cli.auto_layout import add_layout_argument
from meshwise.cli.bench import add_bench_comm_arguments, run_bench_comm
from meshwise.cli.data import add_data_arguments, run_data
from meshwise.cli.did_you_mean import SuggestingParser
from meshwise.cli.export import add_export_arguments, run_export
from meshwise.cli.generate import add_generate_arguments, run_generate
from meshwise.cli.plan import add_plan_arguments, run_plan
from meshwise.cli.plot import add_plot_arguments, run_plot
from meshwise.cli.schedule import add_schedule_arguments, run_schedule
from meshwise.cli.train import run_train
from meshwise.cli.train_flags import add_train_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="meshwise", description="3D-parallel training for PyTorch (data, tensor, pipeline)."
    )
    parser.add_argument("--version", action="version", version=f"meshwise {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a GPT or a Llama across local ranks (or join a torchrun launch)",
        description="Train a GPT or a Llama (--model, --init-from). With no flags on a CPU "
        "machine: the tiny GPT preset on 2 data-parallel ranks over the Python "
        "standard library's sources.",
    )
    add_train_arguments(train)
    add_layout_argument(train)
    train.add_argument("-q", "--quiet", action="store_true", help="only warnings and the summary")
    schedule = sub.add_parser("schedule", help="print or plot a pipeline schedule and its bubble")
    add_schedule_arguments(schedule)
    export = sub.add_parser(
        "export",
        help="write a checkpoint as one unsharded model",
        description="Write a checkpoint's model, unsharded, in a format readable without meshwise.",
    )
    add_export_arguments(export)
    generate = sub.add_parser(
        "generate",
        help="sample text from a checkpoint (one process)",
        description="Continue a prompt with a checkpoint's model on one process, using a KV cache.",
    )
    add_generate_arguments(generate)
    data = sub.add_parser(
        "data",
        help="text to token files; train a tokenizer",
        description="Prepare token files for --data and train tokenizers for --tokenizer.",
    )
    add_data_arguments(data)
    bench = sub.add_parser("bench", help="benchmarks: comm (all-reduce algorithms)")
    bench_comm = bench.add_subparsers(dest="bench", required=True).add_parser(
        "comm",
        help="bandwidth and latency per all-reduce algorithm and size",
        description="Time each all-reduce algorithm against the native collective, on local "
        "ranks or under torchrun.",
    )
    add_bench_comm_arguments(bench_comm)
    plan = sub.add_parser(
        "plan", help="which layout to run on N devices: memory and step time predicted per layout"
    )
    add_plan_arguments(plan)
    plot = sub.add_parser(
        "plot",
        help="curves of metrics files (loss, throughput, memory, ...)",
        description="Plot one or more --metrics files, overlaid: loss, "
        "gradient norm, tokens/s, peak memory, exposed "
        "communication and MFU.",
    )
    add_plot_arguments(plot)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshwise")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def _run_offline(args) -> int:
    """``export`` and ``generate``: one process, bad input exits 2 with one line."""
    try:
        print(run_export(args) if args.command == "export" else run_generate(args))
    except ValueError as exc:
        print(f"meshwise {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "schedule":
        return run_schedule(args)
    if args.command == "bench":
        return run_bench_comm(args)
    if args.command in ("export", "generate"):
        return _run_offline(args)
    if args.command == "data":
        return run_data(args)
    if args.command == "plot":
        return run_plot(args)
    if args.command == "plan":
        return run_plan(args)
    return run_train(args)


if __name__ == "__main__":
    sys.exit(main())
