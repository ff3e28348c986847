"""``meshwise schedule``: print (or ``--plot``, with matplotlib) a pipeline schedule and its
simulated bubble.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from meshwise.pipeline.schedules import (
    SCHEDULE_KINDS,
    build_schedule,
    group_steps,
    validate_schedule_config,
)
from meshwise.pipeline.simulator import plot_timeline, reference_bubble, render_text, simulate

PROG = "meshwise schedule"


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``meshwise schedule`` flags to ``parser``."""
    parser.description = (
        "Show each pipeline rank's order of forwards (F), backwards (B) and "
        "weight passes (W, schedules with a split backward), a simulated "
        "timeline (costs per rank, communication free; a whole backward "
        "costs B + W) and the bubble fraction (idle time / total time) beside "
        "the formula or the paper's figure for the schedule."
    )
    parser.add_argument(
        "--pp",
        type=int,
        required=True,
        metavar="S",
        help="number of pipeline stages (pipeline-parallel ranks), >= 1",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        required=True,
        metavar="M",
        help="micro-batches per optimizer step, >= 1 "
        "(interleaved-1f1b: a multiple of --pp; dualpipev: >= 2 x --pp)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        metavar="V",
        help="model chunks per rank: 1 for gpipe, 1f1b and zb-h1, >= 2 for "
        "interleaved-1f1b, 2 for zbv and dualpipev (default: 1)",
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        metavar="KIND",
        help=f"one of {', '.join(SCHEDULE_KINDS)} (default: 1f1b); zb-h1, zbv "
        "and dualpipev split the backward into B (input gradient) and W "
        "(weight gradients)",
    )
    parser.add_argument(
        "--costs",
        default="1,1,1",
        metavar="F,B,W",
        help="per-rank cost of a forward, of a backward's input gradient and "
        "of its weight gradients, per micro-batch (default: 1,1,1)",
    )
    parser.add_argument(
        "--comms",
        action="store_true",
        help="also list the sends/receives in each rank's order; [..] marks "
        "those posted together as one batch (SF3>1: send the activation of "
        "micro-batch 3 to rank 1, RB3<1: receive its gradient from rank 1)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (schedule, pp, micro_batches, "
        "virtual_stages, ranks, bubble_fraction, step_time, peak_in_flight, "
        "...) instead of text",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also save a Gantt chart of the timeline to this PNG file (needs matplotlib)",
    )


def parse_costs(text: str) -> tuple[float, float, float]:
    """``"1,1,1"`` -> (F, B, W); ValueError naming the value unless three numbers > 0."""
    parts = text.split(",")
    try:
        costs = tuple(float(p) for p in parts)
    except ValueError:
        costs = ()
    if len(costs) != 3 or not all(0 < c < float("inf") for c in costs):
        raise ValueError(
            f"--costs {text!r} is not valid; valid: three numbers > 0 as F,B,W, "
            "e.g. 1,1,1 or 1,1.2,0.8"
        )
    return costs


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run_schedule(args: argparse.Namespace) -> int:
    """Run the subcommand for parsed ``args``; return the exit status (2 for invalid values)."""
    S, M, V, kind = args.pp, args.micro_batches, args.virtual_stages, args.schedule
    try:
        validate_schedule_config(kind, S, M, V)
        costs = parse_costs(args.costs)
    except ValueError as exc:
        return _error(str(exc))
    schedule = build_schedule(kind, S, M, V)
    timeline = simulate(schedule, *costs)
    strict = simulate(schedule, *costs, blocking_sends=True)
    ideal, source = reference_bubble(kind, S, M, V, costs)
    if args.plot:
        try:
            plot_timeline(timeline, args.plot)
        except ImportError:
            return _error(
                '--plot needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)'
            )
        except OSError as exc:
            return _error(f"cannot write --plot {args.plot!r}: {exc.strerror or exc}")
    compute = [[str(a) for a in schedule.compute_actions(r)] for r in range(S)]
    if args.json:
        print(
            json.dumps(
                {
                    "schedule": kind,
                    "pp": S,
                    "micro_batches": M,
                    "virtual_stages": V,
                    "forward_cost": timeline.forward_cost,
                    "backward_cost": timeline.backward_cost,
                    "weight_cost": timeline.weight_cost,
                    "bubble_fraction": timeline.bubble_fraction,
                    "bubble_fraction_formula": None if math.isnan(ideal) else ideal,
                    "bubble_fraction_source": source,
                    "bubble_fraction_blocking_sends": strict.bubble_fraction,
                    "step_time": timeline.step_time,
                    "peak_in_flight": timeline.peak_in_flight,
                    "ranks": compute,
                    "ranks_with_comms": [[str(a) for a in actions] for actions in schedule.ranks],
                }
            )
        )
        return 0
    for rank in range(S):
        if args.comms:
            items = [
                f"[{' '.join(map(str, step))}]" if isinstance(step, tuple) else str(step)
                for step in group_steps(schedule.ranks[rank])
            ]
        else:
            items = compute[rank]
        print(f"rank {rank}: {' '.join(items)}")
    print()
    print(render_text(timeline))
    print()
    if kind in ("gpipe", "1f1b", "interleaved-1f1b"):
        reference = f"formula (S-1)/(V*M+S-1) = {S - 1}/{V * M + S - 1} = {ideal:.4f}"
    elif math.isnan(ideal):
        reference = f"reference {source}"
    else:
        reference = f"reference {ideal:.4f}: {source}"
    print(f"bubble fraction: {timeline.bubble_fraction:.4f}   {reference}")
    if abs(strict.bubble_fraction - timeline.bubble_fraction) > 1e-9:
        print(f"  (if every send blocks until received: {strict.bubble_fraction:.4f})")
    print(f"peak activations in flight per rank: {timeline.peak_in_flight}")
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
