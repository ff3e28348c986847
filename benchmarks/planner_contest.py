"""Which of the fastest layouts is fastest: timed again, in turns, several rounds.

One timing per layout decides little among layouts a few percent apart: on this
shared machine a layout's median step time moves by 5-15% from one job to the
next (other work, the ranks drifting). The contest takes the measured fastest
three and the planner's two best, and runs each once per round in a rotating
order, so that every layout meets the machine's slow and quiet spells alike; its
ranking is by the median over the rounds of the step time as on an idle machine
(each job's time less the share of the CPU other processes took meanwhile).
"""

from __future__ import annotations

import os
import statistics

from meshwise.cli.calibrate import train_records
from meshwise.planner.probes import OthersShare

SEQUENCE = ["--seq-len", "256", "--batch-size", "8"]


def job_flags(model_flags: list[str], layout_flags: str, steps: int) -> list[str]:
    """``meshwise train`` flags of one benchmark job."""
    return [
        *model_flags,
        *SEQUENCE,
        *layout_flags.split(),
        "--steps",
        str(steps),
        "--eval-batches",
        "1",
        "--warmup-steps",
        "1",
        "--device",
        "cpu",
        "-q",
    ]


def job_env(cache: str) -> dict:
    env = dict(os.environ, MESHWISE_CACHE=cache)
    env.pop("MESHWISE_COMM_CHECK", None)
    return env


def timed_job(model_flags: list[str], layout_flags: str, steps: int, cache: str) -> dict:
    """One ``meshwise train`` job run as users run it: its step times after the first,
    and the share of the CPU other processes took while it ran."""
    share = OthersShare()
    records = train_records(
        job_flags(model_flags, layout_flags, steps), live_peak=False, env=job_env(cache)
    )
    times = [r["step_time_s"] for r in records[1:]]
    return {
        "step_time_s": statistics.median(times),
        "spread": (max(times) - min(times)) / statistics.median(times),
        "others_cpu_share": share.measured(),
    }


def idle_s(measured: dict) -> float:
    """The step time as on an idle machine: a CPU-bound job with a fraction ``a`` of the
    machine takes ``1 / a`` as long."""
    return measured["step_time_s"] * (1 - measured["others_cpu_share"])


def contestants(
    rows: list[dict], predicted_order: list[str], measured_top: int = 3, predicted_top: int = 2
) -> list[str]:
    """The measured fastest ``measured_top`` layouts and the predicted best ``predicted_top``."""
    fastest = sorted(rows, key=lambda r: idle_s(r["measured"]))[:measured_top]
    return list(dict.fromkeys([r["layout"] for r in fastest] + predicted_order[:predicted_top]))


def run_contest(
    model_flags: list[str],
    layouts: list[str],
    rounds: int,
    steps: int,
    cache: str,
    runs: dict | None = None,
    log=print,
) -> dict[str, list[dict]]:
    """Each layout timed once per round, the order rotating by one each round; ``runs``
    (layout -> earlier rounds' timings) is extended, so an interrupted contest resumes."""
    runs = {layout: list((runs or {}).get(layout, [])) for layout in layouts}
    for round_ in range(min(len(v) for v in runs.values()), rounds):
        k = round_ % len(layouts)
        for layout in layouts[k:] + layouts[:k]:
            if len(runs[layout]) > round_:
                continue
            runs[layout].append(timed_job(model_flags, layout, steps, cache))
            m = runs[layout][-1]
            log(
                f"  contest round {round_ + 1}/{rounds}: {layout:<66} {m['step_time_s']:6.2f} s "
                f"(others {100 * m['others_cpu_share']:.0f}%)",
                flush=True,
            )
    return runs


def ranking(runs: dict[str, list[dict]]) -> list[tuple[str, float, float]]:
    """(layout, median idle-machine step time, its interquartile range over the median),
    fastest first."""
    out = []
    for layout, timings in runs.items():
        times = sorted(idle_s(m) for m in timings)
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        out.append((layout, statistics.median(times), (q[2] - q[0]) / statistics.median(times)))
    return sorted(out, key=lambda x: x[1])
