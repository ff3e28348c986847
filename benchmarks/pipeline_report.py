"""The report of ``benchmarks/pipeline.py``: step times, bubbles, noise gauges, losses.

A step's time is the slower rank's (each rank's: its wall time from a barrier to
the end of the step), and the median over steps is reported. The measured
bubble of rank r is ``1 - compute_s / pipeline_s``: ``compute_s`` the seconds
rank r spent in F and B actions (meshwise: ``PipelineRuntime.compute_s``; torch:
timers around the stage's ``forward_one_chunk`` / ``backward_one_chunk`` and the
loss function), ``pipeline_s`` the slower rank's time in the schedule alone
(optimizer excluded), median over steps. Beside it: the simulator's bubble for
the same schedule, S, M, V (``simulate(build_schedule(...))``, F, B, W costs 1,
1, 1), the simulator again with the measured F, B and W costs and a p2p latency
from an idle ping-pong of one activation, and the formula (S-1)/(V*M + S-1) or, for
the split-backward schedules, the paper's figure (``reference_bubble``).

Noise: other processes on a 2-core machine take cores from the ranks. The report
gives the CPU share of the compute timers (thread CPU time / wall time in F and
B; meshwise: over the whole schedule: 1.00 when the core was the rank's alone),
the bubble over the steps in which both ranks had at least 90% of their core, and
a ratio of paired steps (the same round) beside the ratio of medians.
"""

from __future__ import annotations

from statistics import mean

from benchmarks.common import median, quartiles, rel_diff, slowest
from meshwise.pipeline.schedules import build_schedule
from meshwise.pipeline.simulator import reference_bubble, simulate

# The benchmark's schedule keys and meshwise's schedule kinds.
SCHEDULE_OF = {
    "1f1b": "1f1b",
    "interleaved": "interleaved-1f1b",
    "zb-h1": "zb-h1",
    "zbv": "zbv",
    "dualpipev": "dualpipev",
}
# Timed in this order (reversed every other round); each meshwise schedule then its peer.
VARIANTS = tuple(f"{side}_{key}" for key in SCHEDULE_OF for side in ("meshwise", "torch"))
PEER_OF = {f"meshwise_{key}": f"torch_{key}" for key in SCHEDULE_OF}
KEY_OF = {f"meshwise_{key}": key for key in SCHEDULE_OF}
QUIET_CPU_SHARE = 0.9  # a step is quiet if both ranks had this share of their core in F and B


def virtual_stages(name: str) -> int:
    """Chunks per rank of a variant (``meshwise_zbv``) or schedule key (``zbv``)."""
    return 1 if name.split("_")[-1] in ("1f1b", "zb-h1") else 2


def simulated(
    key: str,
    S: int,
    M: int,
    fwd: float = 1.0,
    bwd: float = 1.0,
    wgt: float = 1.0,
    latency: float = 0.0,
) -> tuple[float, list]:
    """The simulator's bubble (mean over ranks) and each rank's idle fraction.
    ``bwd``, ``wgt``: a rank's input and weight backward per micro-batch (a schedule
    without W actions runs both as one backward)."""
    kind, V = SCHEDULE_OF[key], virtual_stages(key)
    tl = simulate(
        build_schedule(kind, S, M, V),
        forward_cost=fwd,
        backward_cost=bwd,
        weight_cost=wgt,
        p2p_latency=latency,
    )
    per_rank = [1 - sum(e - s for s, e, _ in row) / tl.step_time for row in tl.rows]
    return tl.bubble_fraction, per_rank


def summarize(name: str, per_rank: list[dict]) -> dict | None:
    """Medians over steps of the slower rank's times, and per-rank measured bubbles."""
    t = [r["timings"][name] for r in per_rank]
    if not t[0]["step"]:
        return None
    steps = slowest([x["step"] for x in t])
    pipes = slowest([x["pipeline"] for x in t])
    bubbles = [[1 - c / p for c, p in zip(x["compute"], pipes)] for x in t]
    q = quartiles(steps)
    # Steps in which both ranks had their core to themselves while computing (thread CPU
    # time >= QUIET_CPU_SHARE of wall time in F and B): the bubble without outside noise.
    quiet = [
        i
        for i in range(len(steps))
        if all(x["compute_cpu"][i] >= QUIET_CPU_SHARE * x["compute"][i] for x in t)
    ]
    return {
        "quiet_steps": len(quiet),
        "bubble_quiet": [median(b[i] for i in quiet) if quiet else None for b in bubbles],
        "step": median(steps),
        "step_q1": q[0],
        "step_q3": q[2],
        "step_min": min(steps),
        "step_max": max(steps),
        "pipeline": median(pipes),
        "optim": median(slowest([x["optim"] for x in t])),
        "bubble": [median(b) for b in bubbles],
        "bubble_q": [quartiles(b) for b in bubbles],
        # CPU share of the compute timers, over all steps (1.0 = the core was ours alone).
        "cpu_share": [sum(x["compute_cpu"]) / sum(x["compute"]) for x in t],
        "fwd": [median(x["fwd"]) for x in t],
        "bwd": [median(x["bwd"]) for x in t],
        "wgt": [median(x["wgt"]) for x in t],
        "steps": len(steps),
        "step_list": steps,
    }


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def print_steps(args, names: list[str], stats: dict, errors: dict, num_params: int) -> None:
    """The model line, the variants that failed, and the table of step times."""
    tokens = args.batch_size * args.seq_len
    print(
        f"model: GPT n_layer {args.n_layer}, n_head {args.n_head}, d_model {args.d_model}, "
        f"vocab {args.vocab_size}, {num_params / 1e6:.2f}M params over 2 pipeline ranks "
        f"(every stage the same number of blocks; the embedding and head ride on top); "
        f"global batch {args.batch_size} x {args.seq_len} = {tokens} tokens in M = "
        f"{args.micro_batches} micro-batches; gloo, 1 thread per rank; {args.rounds} rounds x "
        f"{args.steps} steps after {args.warmup} warm-up steps each"
    )
    for name in names:
        if name in errors:
            print(f"{name} did not run on CPU/gloo: {errors[name]}")
            tb = errors.get(name + "_traceback")
            if tb and args.verbose:
                print(tb)
    print(
        f"\n{'variant':22}{'step ms':>9}{'q1..q3':>15}{'pipeline':>10}{'optim':>8}"
        f"{'F ms r0/r1':>14}{'B ms r0/r1':>14}{'W ms r0/r1':>14}{'steps':>7}"
    )
    for name in names:
        s = stats[name]
        if s is None:
            print(f"{name:22}{'(did not run)':>9}")
            continue
        print(
            f"{name:22}{ms(s['step']):>9}{ms(s['step_q1']) + '..' + ms(s['step_q3']):>15}"
            f"{ms(s['pipeline']):>10}{ms(s['optim']):>8}"
            f"{ms(s['fwd'][0]) + '/' + ms(s['fwd'][1]):>14}"
            f"{ms(s['bwd'][0]) + '/' + ms(s['bwd'][1]):>14}"
            f"{ms(s['wgt'][0]) + '/' + ms(s['wgt'][1]):>14}{s['steps']:>7}"
        )


def step_ratios(stats: dict) -> dict:
    """meshwise / torch step times per schedule: ratio of medians, pipeline only, paired."""
    summary = {}
    print(
        f"\n{'meshwise / torch (median step times)':42}{'step time':>10}{'pipeline only':>15}"
        f"{'paired steps':>15}"
    )
    for ours, peer in PEER_OF.items():
        key = KEY_OF[ours]
        a, b = stats.get(ours), stats.get(peer)
        summary[f"meshwise_{key}_step_s"] = a["step"] if a else None
        summary[f"torch_{key}_step_s"] = b["step"] if b else None
        ratio = a["step"] / b["step"] if a and b else None
        pipe_ratio = a["pipeline"] / b["pipeline"] if a and b else None
        # Step i of both ran in the same round: the median of these ratios resists drift in
        # the load from other processes better than the ratio of medians.
        paired = median(x / y for x, y in zip(a["step_list"], b["step_list"])) if a and b else None
        summary[f"ratio_{key}"] = ratio
        summary[f"ratio_{key}_pipeline_only"] = pipe_ratio
        summary[f"ratio_{key}_paired"] = paired
        shown = (
            f"{ratio:10.3f}{pipe_ratio:15.3f}{paired:15.3f}"
            if ratio
            else f"{'-':>10}{'-':>15}{'-':>15}"
        )
        print(f"{ours + ' / ' + peer:42}{shown}")
    return summary


def bubbles(M: int, names: list[str], stats: dict, latency: float, S: int = 2) -> dict:
    """Measured bubble per rank beside the simulator's and the formula's."""
    print(
        f"\nbubble = 1 - compute_s / pipeline_s per rank, median over steps (q1..q3); "
        f"S = {S}, M = {M}.\nsimulated: F, B, W costs 1, 1, 1 (a whole backward 2); "
        f"sim+lat: the simulator with this variant's measured F, B and W costs and a p2p "
        f"latency of {1e3 * latency:.2f} ms (one activation message, ranks idle); "
        f"reference: the formula or the paper's figure"
    )
    print(
        f"{'variant':22}{'rank 0':>22}{'rank 1':>22}{'simulated':>11}{'sim r0/r1':>13}"
        f"{'sim+lat':>9}{'reference':>10}"
    )
    summary = {}
    for name in names:
        key, s = name.split("_", 1)[1], stats[name]
        if s is None:
            continue
        sim, sim_ranks = simulated(key, S, M)
        # Per micro-batch costs of a rank's whole share (the simulator splits them over V).
        f_cost, b_cost, w_cost = (mean(s[k]) / M for k in ("fwd", "bwd", "wgt"))
        sim_lat, _ = simulated(key, S, M, f_cost, b_cost, w_cost, latency)
        formula = reference_bubble(SCHEDULE_OF[key], S, M, virtual_stages(key))[0]
        cells = [f"{b:.3f} ({q[0]:.3f}..{q[2]:.3f})" for b, q in zip(s["bubble"], s["bubble_q"])]
        print(
            f"{name:22}{cells[0]:>22}{cells[1]:>22}{sim:11.3f}"
            f"{sim_ranks[0]:7.3f}/{sim_ranks[1]:.3f}{sim_lat:9.3f}{formula:10.3f}"
        )
        if name.startswith("meshwise"):
            summary[f"bubble_measured_{key}"] = s["bubble"]
            summary[f"bubble_simulated_{key}"] = sim
            summary[f"bubble_formula_{key}"] = formula
            summary[f"bubble_simulated_with_latency_{key}"] = sim_lat
            summary[f"bubble_measured_quiet_{key}"] = s["bubble_quiet"]
            summary[f"quiet_steps_{key}"] = s["quiet_steps"]
            summary[f"backward_over_forward_{key}"] = (b_cost + w_cost) / f_cost
        else:
            summary[f"torch_bubble_measured_{key}"] = s["bubble"]
            summary[f"torch_bubble_measured_quiet_{key}"] = s["bubble_quiet"]
        summary[f"cpu_share_of_compute_{name}"] = s["cpu_share"]
    return summary


def print_noise(stats: dict) -> None:
    print(
        f"quiet steps only (CPU share >= {QUIET_CPU_SHARE} on both ranks): "
        + "; ".join(
            f"{n} "
            + (
                f"{s['bubble_quiet'][0]:.3f}/{s['bubble_quiet'][1]:.3f} "
                if s["quiet_steps"]
                else ""
            )
            + f"({s['quiet_steps']} steps)"
            for n, s in stats.items()
            if s
        )
    )
    print(
        "noise gauge: CPU share of compute (thread CPU time / wall time inside F and B; "
        "1.00 = the core was the rank's alone): "
        + ", ".join(
            f"{n} {s['cpu_share'][0]:.2f}/{s['cpu_share'][1]:.2f}" for n, s in stats.items() if s
        )
    )


def loss_diffs(losses: dict) -> dict:
    """Relative loss differences meshwise vs torch, at the first and the last common step."""
    summary = {}
    print("\nloss (sum CE / global tokens) at the first step, and at the last step both ran:")
    for ours, peer in PEER_OF.items():
        a, b = losses.get(ours, []), losses.get(peer, [])
        key = KEY_OF[ours]
        if not a:
            continue
        if not b:
            print(f"  {ours}: first {a[0]:.6f} (torch peer did not run)")
            summary[f"loss_rel_diff_first_{key}"] = None
            continue
        first = rel_diff(a[0], b[0])
        n = min(len(a), len(b)) - 1
        last = rel_diff(a[n], b[n])
        print(
            f"  {ours} {a[0]:.6f} vs {peer} {b[0]:.6f}: relative difference {first:.2e}; "
            f"step {n + 1}: {a[n]:.6f} vs {b[n]:.6f} ({last:.2e})"
        )
        summary[f"loss_rel_diff_first_{key}"] = first
        summary[f"loss_rel_diff_step{n + 1}_{key}"] = last
    return summary


def report(args, per_rank: list[dict]) -> dict:
    """Print the tables; the summary for the JSON line (``per_rank`` in rank order)."""
    errors = {}
    for r in per_rank:
        for k, v in r["errors"].items():
            errors.setdefault(k, v)
    names = [n for n in VARIANTS if n in per_rank[0]["timings"]]
    stats = {n: summarize(n, per_rank) for n in names}
    losses = {n: next((r["losses"][n] for r in per_rank if any(r["losses"][n])), []) for n in names}
    print_steps(args, names, stats, errors, sum(r["num_params"] for r in per_rank))
    summary = step_ratios(stats)
    latency = median(r["p2p_latency_s"] for r in per_rank)
    summary.update(bubbles(args.micro_batches, names, stats, latency))
    summary["p2p_latency_s"] = latency
    print_noise(stats)
    for key in SCHEDULE_OF:
        for field in ("bubble_measured", "bubble_simulated", "bubble_formula"):
            summary.setdefault(f"{field}_{key}", None)
    summary.update(loss_diffs(losses))
    summary["torch_errors"] = {k: v for k, v in errors.items() if not k.endswith("_traceback")}
    summary.update(
        num_stages=2, num_micro_batches=args.micro_batches, steps_each=args.rounds * args.steps
    )
    return summary
