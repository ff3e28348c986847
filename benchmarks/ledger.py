"""What the collective ledger costs a training step: ``meshwise train`` with it and without.

The same run (the tiny preset on 2 gloo ranks by default; any ``meshwise train``
flags after ``--``) is started ``--rounds`` times with the ledger on (the
default: every operation recorded, ledgers compared across ranks after every
step) and with ``MESHWISE_LEDGER=0``, alternating so that drift in the
machine's speed hits both alike. Each run's median ``step_time_s`` (from its
metrics, the first ``--warmup`` steps left out) is collected; the last line is
one JSON object with the medians and their ratio.

    python benchmarks/ledger.py [--rounds 5 --steps 60] [-- --dp 2 --zero 3]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.common import print_json  # noqa: E402


def median_step_s(flags: list[str], ledger: bool, steps: int, warmup: int, folder: Path) -> float:
    metrics = folder / f"ledger-{int(ledger)}.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHWISE_LEDGER="1" if ledger else "0")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "meshwise",
            "train",
            "--steps",
            str(steps),
            "--metrics",
            str(metrics),
            "-q",
            *flags,
        ],
        check=True,
        env=env,
        cwd=folder,
    )
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[warmup:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("flags", nargs="*", help="meshwise train flags (after --)")
    args = p.parse_args()
    flags = args.flags or ["--dp", "2"]
    times = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, ledger in (("on", True), ("off", False)):
                times[name].append(median_step_s(flags, ledger, args.steps, args.warmup, Path(tmp)))
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(
        f"median step time: ledger on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms "
        f"({(on / off - 1) * 100:+.1f}%)",
        flush=True,
    )
    print_json(
        {
            "flags": flags,
            "step_time_s": {"on": on, "off": off},
            "rounds": times,
            "on_vs_off": on / off,
        }
    )


if __name__ == "__main__":
    main()
