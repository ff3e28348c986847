"""``meshwise bench comm``: the flags, the launch (local gloo ranks, or joined to torchrun,
nodes from ``LOCAL_WORLD_SIZE``) and the report of ``meshwise.comm.allreduce.bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from meshwise.cli import launch
from meshwise.comm import ops
from meshwise.comm.allreduce.algorithms import ALGORITHMS, Topology, hierarchical_problem
from meshwise.comm.allreduce.bench import measure

DEFAULT_SIZES = "4K,64K,1M,16M"
UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B") or "0"
    unit = text[-1] if text[-1] in UNITS else ""
    try:
        value = int(float(text[:-1] if unit else text) * UNITS[unit])
    except ValueError:
        value = 0
    if value < 4:
        raise ValueError(f"--sizes: {text!r} is not a size of at least 4 bytes (e.g. 4K, 1M)")
    return value


def add_bench_comm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"message sizes, comma-separated (default: {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--algorithms",
        default=",".join(ALGORITHMS),
        help=f"comma-separated, of {', '.join(ALGORITHMS)} (default: all that can serve the ranks)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=4,
        help="local ranks to spawn (ignored under torchrun; default: 4)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=0,
        help="ranks per (emulated) node; default: torchrun's LOCAL_WORLD_SIZE, "
        "locally half the ranks",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per point")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="plot bus bandwidth per size")


def _settings(args) -> dict:
    """Checked options, before any rank starts (``ValueError`` names the bad value)."""
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    for a in algorithms:
        if a not in ALGORITHMS:
            raise ValueError(f"--algorithms: {a!r} is not valid; valid: {', '.join(ALGORITHMS)}")
    world = launch.torchrun_world_size() if launch.under_torchrun() else args.ranks
    if world < 2:
        raise ValueError(f"--ranks {world}: an all-reduce needs at least 2 ranks")
    per_node = args.ranks_per_node or (
        int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if launch.under_torchrun()
        else max(1, world // 2)
    )
    if per_node < 1 or world % per_node:
        raise ValueError(f"--ranks-per-node {per_node} does not divide the {world} ranks")
    problem = hierarchical_problem(Topology.of(range(world), per_node), range(world))
    if problem and "hierarchical" in algorithms:
        if args.algorithms != ",".join(ALGORITHMS):  # asked for by name
            raise ValueError(
                f"--algorithms hierarchical cannot serve these ranks: {problem}; "
                "valid: native, ring, tree, adaptive, or set --ranks-per-node"
            )
        algorithms.remove("hierarchical")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - only whether it is installed
        except ImportError:
            raise ValueError("--plot needs matplotlib (pip install 'meshwise[plot]')") from None
    return {
        "sizes": sizes,
        "algorithms": algorithms,
        "world": world,
        "per_node": per_node,
        "repeats": args.repeats,
        "json": args.json,
        "plot": args.plot,
        "device": args.device,
    }


def run_bench_comm(args) -> int:
    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"meshwise bench comm: error: {exc}", file=sys.stderr)
        return 2
    try:
        launch.launch(_rank_main, (settings,), settings["world"], args.device, 300.0)
    except launch.RankFailed as exc:
        print(f"meshwise bench comm: {exc}", file=sys.stderr)
        return 1
    return 0


def _rank_main(settings: dict) -> None:
    world = ops.world_group(timeout_s=300.0)
    result = measure(world, settings)
    if world.rank == 0:
        print(json.dumps(result, indent=1) if settings["json"] else format_table(result))
        if settings["plot"]:
            plot(result, settings["plot"])
            print(f"wrote {settings['plot']}")
        sys.stdout.flush()


def _size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def format_table(result: dict) -> str:
    lines = [
        f"all-reduce on {result['world_size']} ranks, {result['nodes']} node(s) of "
        f"{result['ranks_per_node']}, {result['backend']}",
        f"{'size':>10}  {'algorithm':<22} {'time ms':>10} {'busbw GB/s':>11} {'vs native':>10}",
    ]
    for r in sorted(result["results"], key=lambda r: (r["bytes"], r["algorithm"] != "native")):
        name = r["algorithm"] + (f" ({r['picked']})" if "picked" in r else "")
        ratio = f"{r['speedup_vs_native']:.2f}x" if "speedup_vs_native" in r else "-"
        lines.append(
            f"{_size_text(r['bytes']):>10}  {name:<22} {r['time_s'] * 1e3:>10.3f} "
            f"{r['busbw_gbps']:>11.3f} {ratio:>10}"
        )
    smallest = min(r["bytes"] for r in result["results"])
    latency = ", ".join(
        f"{r['algorithm']} {r['time_s'] * 1e6:.0f} us"
        for r in result["results"]
        if r["bytes"] == smallest
    )
    lines.append(f"latency ({_size_text(smallest)}): {latency}")
    if "cost_model" in result:
        lines.append(f"adaptive's probe: {result['cost_model']}")
    lines.append("vs native: native time / this time (above 1: faster than native)")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algorithm in dict.fromkeys(r["algorithm"] for r in result["results"]):
        rows = [r for r in result["results"] if r["algorithm"] == algorithm]
        ax.plot(
            [r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o", label=algorithm
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(
        f"all-reduce, {result['world_size']} ranks on {result['nodes']} node(s), "
        f"{result['backend']}"
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
