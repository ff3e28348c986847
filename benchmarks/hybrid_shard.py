"""Hybrid sharding across two emulated nodes: ``--dp 4 --zero Z`` against ``--dp 4
--dp-shard 2 --zero Z`` (two ranks per node, a throttled link between the nodes;
``benchmarks/two_nodes.py``).

Per layout: the median step time, the bytes the link carried per step (read from the
veth interface's counters from outside the ranks, the difference of a long and a short
run so start-up traffic cancels) and the peak RSS of the largest rank (``peak_rss_bytes``,
with ``MALLOC_MMAP_THRESHOLD_`` so freed buffers go back to the kernel). Each hybrid layout
also runs with its 4 ranks on this machine alone, and its two-node losses are compared
with that run's. Needs root.

    python benchmarks/hybrid_shard.py --rate 200mbit --delay 1ms --zero 3

``--cross-replica`` adds a hybrid row per flag set for the sum across the replicas,
e.g. ``--cross-replica "--compress fp16" "--allreduce ring"``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_nodes import TwoNodes, unavailable  # noqa: E402

MODEL = ["--model", "small", "--n-layer", "4", "--d-model", "256", "--n-head", "4"]
DATA = ["--seq-len", "64", "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "1"]


def train_argv(layout: list[str], steps: int, metrics: Path) -> list[str]:
    """``meshwise train``'s arguments for ``layout`` on the benchmark's model and data."""
    return ["train", *layout, *MODEL, *DATA, "--steps", str(steps), "--metrics", str(metrics)]


def link_bytes(nodes: TwoNodes) -> int:
    """Bytes node 0's end of the link has sent and received so far (its counters)."""
    ns, dev, _ = nodes.hosts[0]
    total = 0
    for way in ("tx_bytes", "rx_bytes"):
        path = f"/sys/class/net/{dev}/statistics/{way}"
        done = subprocess.run(["ip", "netns", "exec", ns, "cat", path], capture_output=True)
        total += int(done.stdout)
    return total


def run(nodes: TwoNodes, layout: list[str], steps: int, workdir: Path) -> dict:
    """One run of ``steps`` steps: its metrics lines and the link's bytes."""
    metrics = workdir / f"m{abs(hash((tuple(layout), steps)))}.jsonl"
    argv = train_argv(layout, steps, metrics)
    before = link_bytes(nodes)
    results = nodes.run(argv, nproc_per_node=2, timeout_s=900, cwd=workdir)
    moved = link_bytes(nodes) - before
    for node, result in enumerate(results):
        if result.returncode:
            raise SystemExit(f"node {node}: {' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"records": records, "link_bytes": moved}


def one_node_losses(layout: list[str], steps: int, workdir: Path) -> list[float]:
    """The same run's losses with every rank on this machine (no namespaces, no link)."""
    metrics = workdir / f"one-node{abs(hash(tuple(layout)))}.jsonl"
    argv = train_argv(layout, steps, metrics)
    done = subprocess.run([sys.executable, "-m", "meshwise", *argv, "-q"], cwd=workdir)
    if done.returncode:
        raise SystemExit(f"one node: {' '.join(argv)} failed")
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def largest_gap(want: list[float], got: list[float]) -> float:
    """The largest relative difference between two runs' losses, step by step."""
    return max(abs(a - b) / abs(a) for a, b in zip(want, got, strict=True))


def measure(nodes: TwoNodes, layout: list[str], short: int, long: int, workdir: Path) -> dict:
    first, second = (run(nodes, layout, n, workdir) for n in (short, long))
    records = second["records"]
    return {
        "layout": " ".join(layout),
        "step_time_s": statistics.median(r["step_time_s"] for r in records[2:]),
        "link_bytes_per_step": (second["link_bytes"] - first["link_bytes"]) / (long - short),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in records),
        "model_state_bytes": records[-1]["model_state_bytes"],
        "losses": [r["loss"] for r in records],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="200mbit", help="link rate each way (tc syntax)")
    parser.add_argument("--delay", default="1ms", help="added one-way delay (netem)")
    parser.add_argument("--zero", type=int, nargs="+", default=[3])
    parser.add_argument("--steps", type=int, nargs=2, default=[3, 8], metavar=("SHORT", "LONG"))
    parser.add_argument(
        "--cross-replica",
        nargs="*",
        default=[],
        metavar="FLAGS",
        help='more --dp-shard 2 rows, each with these flags (e.g. "--compress fp16")',
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"hybrid_shard: cannot emulate two nodes here: {reason}", file=sys.stderr)
        return 2
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, TwoNodes(args.rate, args.delay) as nodes:
        os.environ.setdefault("MESHWISE_CACHE", str(Path(tmp) / "cache"))
        print(f"two nodes of 2 ranks; link: {nodes.shaping}")
        hybrids = [["--dp-shard", "2", *flags.split()] for flags in ["", *args.cross_replica]]
        for zero in args.zero:
            for extra in [[], *hybrids]:
                layout = ["--dp", "4", "--zero", str(zero), *extra]
                rows.append(measure(nodes, layout, *args.steps, Path(tmp)))
                row = rows[-1]
                if extra:  # the two-node run against all its ranks on one machine
                    local = one_node_losses(layout, args.steps[1], Path(tmp))
                    row["one_node_gap"] = largest_gap(local, row["losses"])
                print(
                    f"{row['layout']:<48} step {row['step_time_s'] * 1e3:8.1f} ms  "
                    f"link {row['link_bytes_per_step'] / 2**20:8.2f} MiB/step  "
                    f"peak RSS {row['peak_rss_bytes'] / 2**20:7.1f} MiB  "
                    f"model state {row['model_state_bytes'] / 2**20:6.2f} MiB",
                    flush=True,
                )
    per_zero = 1 + len(hybrids)
    for at in range(0, len(rows), per_zero):
        full = rows[at]
        for hybrid in rows[at + 1 : at + per_zero]:
            gap = largest_gap(full["losses"], hybrid["losses"])
            print(
                f"{hybrid['layout']} / full ZeRO: link bytes "
                f"{hybrid['link_bytes_per_step'] / full['link_bytes_per_step']:.2f}x, step time "
                f"{hybrid['step_time_s'] / full['step_time_s']:.2f}x; losses within {gap:.1e}; "
                f"two nodes vs one node: losses within {hybrid['one_node_gap']:.1e}"
            )
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
