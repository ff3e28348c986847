"""``meshwise plot RUN.jsonl [RUN2.jsonl ...] --out curves.png``: metrics files as curves."""

from __future__ import annotations

import sys
from pathlib import Path

from meshwise.train.plot import X_AXES, plot_runs, read_run


def add_plot_arguments(parser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN.jsonl",
        help="metrics files written by meshwise train --metrics, overlaid",
    )
    parser.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    parser.add_argument(
        "--x",
        choices=tuple(X_AXES),
        default="step",
        help="the horizontal axis: step, tokens seen or training time (default step)",
    )


def run_plot(args) -> int:
    """``meshwise plot``; bad input exits 2 with one line."""
    try:
        import matplotlib  # noqa: F401 - only whether it is installed
    except ImportError:
        print(
            "meshwise plot: error: plotting needs matplotlib: pip install 'meshwise[plot]'",
            file=sys.stderr,
        )
        return 2
    try:
        runs = {}
        for path in args.runs:
            name = Path(path).stem
            runs[name if name not in runs else path] = read_run(path)
        print(f"wrote {plot_runs(runs, args.out, args.x)}")
    except ValueError as exc:
        print(f"meshwise plot: error: {exc}", file=sys.stderr)
        return 2
    return 0
