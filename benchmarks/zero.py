"""ZeRO stages 0-3: meshwise vs DDP, ZeroRedundancyOptimizer and FSDP2, side by side.

Spawns 2 gloo ranks on this machine (one thread each). Every variant trains its
own copy of the same GPT (``meshwise.models.gpt``, identical initial weights) on
the same global batches, each rank taking a contiguous half; the summed token
loss is divided by the global token count. AdamW everywhere with the same
hyperparameters and the same weight-decay split (matrices only). The meshwise
variants build the model as ``meshwise train`` does (on the meta device, the
engine materialising what the rank keeps); the torch peers wrap the whole model
holding the same initial values:

- ``zero0`` meshwise ``ZeroOptimizer(stage=0)``  vs ``ddp``: ``DistributedDataParallel``
  + ``torch.optim.AdamW``;
- ``zero1`` meshwise ``ZeroOptimizer(stage=1)``  vs ``zero_redundancy``:
  ``ZeroRedundancyOptimizer(optimizer_class=AdamW)`` around DDP;
- ``zero2`` meshwise ``ZeroOptimizer(stage=2)`` (no torch peer);
- ``zero3`` meshwise ``ZeroStage3`` (one unit per transformer block) vs
  ``fsdp2``: ``fully_shard`` on each transformer block then the root, over a
  gloo ``DeviceMesh`` on CPU (FSDP1 if FSDP2 fails to run; the error is printed).

ZeRO-1/2 leave the parameter all-gather of a step in flight, to be waited for
by the next forward; the last step of each round waits for it inside its own
time, so every timed step pays for one gather.

DDP uses ``gradient_as_bucket_view=True`` (no second gradient copy, the stronger
peer on memory and time). Steps run in alternating rounds after a warm-up (every
variant ``--steps`` steps per round, the order reversed every other round) so
drift in machine speed hits all alike; a step's time is the slowest rank's and
the median is reported. Model-state bytes per rank are measured after the last
step, before the next ``zero_grad``: meshwise from ``engine.state_bytes()``, the
torch peers from the tensors they hold (local shards of parameters, ``.grad``s,
optimizer state; each storage counted once). The last line printed is one JSON
object; ratios are meshwise / peer.

``--memory-table`` instead counts model-state bytes of stages 0-3 on the GPT
``small`` preset for 2 and 4 ranks (one step each) against the ZeRO formula
(fp32 AdamW: 16, 8 + 8/N, 4 + 12/N and 16/N bytes per parameter).

    python benchmarks/zero.py [--rounds 8 --steps 3] [--profile zero3]
    python benchmarks/zero.py --memory-table

The torch peers call ``torch.distributed`` directly (a benchmark, not the library).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Runnable from a checkout without installing (spawned ranks re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_gpt_args,
    add_round_args,
    gpt_config,
    medians,
    new_timings,
    print_json,
    record,
    rel_diff,
    run_rounds,
    slowest_timings,
    spawn,
)
from benchmarks.zero_memory import memory_table, zero_formula_bytes  # noqa: E402
from benchmarks.zero_runners import STAGE_OF, VARIANTS, build_all, local_batches  # noqa: E402
from meshwise.comm import ops  # noqa: E402
from meshwise.models.gpt import GPT  # noqa: E402

# Each meshwise stage beside its torch peer.
PEER_OF = {"zero0": "ddp", "zero1": "zero_redundancy", "zero3": "fsdp2"}


# ---------------------------------------------------------------- timing
def rank_main(rank: int, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    group = ops.world_group()
    mesh = init_device_mesh("cpu", (args.world_size,), mesh_dim_names=("dp",))
    data = local_batches(args, rank, args.warmup + args.rounds * args.steps)
    runners, errors, losses = build_all(args, group, mesh, data[0])
    names = list(runners)
    timings = new_timings(names, ("step", "fwd_bwd", "sync", "optim"))
    for name in names:  # warm-up, after the steps build_all already took
        for x, y in data[len(losses[name]) : args.warmup]:
            losses[name].append(runners[name].step(x, y)[0])

    def one_step(name: str, r: int, i: int) -> None:
        batch = data[args.warmup + r * args.steps + i]
        loss, t = runners[name].step(*batch, settle=i == args.steps - 1)
        losses[name].append(loss)
        record(timings[name], t)

    run_rounds(
        names, args.rounds, args.steps, one_step, before_block=lambda name: ops.barrier(group)
    )
    state = {n: runner.state_bytes() for n, runner in runners.items()}
    peak = runners["zero3"].engine.peak_gathered_bytes if "zero3" in runners else 0
    if args.profile:
        profile_variant(runners[args.profile], data[: args.steps], args, rank)
    return {
        "timings": timings,
        "losses": losses,
        "state_bytes": state,
        "peak_gathered_bytes": peak,
        "errors": errors,
        "num_params": num_params(args),
    }


def num_params(args) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(gpt_config(args)).parameters())


def profile_variant(runner, data, args, rank: int) -> None:
    """torch.profiler over a few more steps of one variant, printed by rank 0
    (every rank runs the steps: they are collectives)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in data:
            runner.step(x, y)
    if rank != 0:
        return
    print(f"--- profile of {args.profile}, rank 0, {len(data)} steps ---", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)


# ---------------------------------------------------------------- report
def merge_ranks(per_rank: list[dict]) -> dict:
    """Step times: the slowest rank's per step; bytes: the largest rank's."""
    first = per_rank[0]  # rank 0
    timings = {n: slowest_timings([r["timings"][n] for r in per_rank]) for n in first["timings"]}
    state = {n: max(r["state_bytes"][n] for r in per_rank) for n in first["state_bytes"]}
    peak = max(r["peak_gathered_bytes"] for r in per_rank)
    return {
        "timings": timings,
        "state_bytes": state,
        "peak_gathered_bytes": peak,
        "losses": first["losses"],
        "errors": first["errors"],
        "num_params": first["num_params"],
    }


def report(args, res) -> dict:
    med = medians(res["timings"])
    names, state, n = list(med), res["state_bytes"], res["num_params"]
    peers = {m: ("fsdp1" if p == "fsdp2" and "fsdp1" in med else p) for m, p in PEER_OF.items()}
    peers = {m: p for m, p in peers.items() if m in med and p in med}
    ref_name = "zero0" if "zero0" in med else names[0]
    ref = res["losses"][ref_name]
    print(
        f"model: GPT n_layer {args.n_layer}, n_head {args.n_head}, d_model {args.d_model}, "
        f"{n / 1e6:.2f}M params; global batch {args.batch_size} x {args.seq_len} tokens; "
        f"{args.world_size} gloo ranks, 1 thread each; bucket_cap_mb {args.bucket_mb}"
    )
    for name, err in res["errors"].items():
        print(f"{name} failed on CPU/gloo, compared against fsdp1 instead: {err}")
    print(
        f"{'variant':17}{'step ms':>9}{'fwd+bwd':>9}{'sync':>8}{'optim':>8}"
        f"{'state MiB':>11}{'formula':>9}{'max rel dloss':>15}"
    )
    for name in names:
        stage = STAGE_OF.get(name, {"ddp": 0, "zero_redundancy": 1}.get(name, 3))
        dloss = max(map(rel_diff, res["losses"][name], ref))
        m = med[name]
        print(
            f"{name:17}{1e3 * m['step']:9.1f}{1e3 * m['fwd_bwd']:9.1f}{1e3 * m['sync']:8.1f}"
            f"{1e3 * m['optim']:8.1f}{state[name] / 2**20:11.2f}"
            f"{zero_formula_bytes(stage, n, args.world_size) / 2**20:9.2f}{dloss:15.1e}"
        )
    print(
        f"(ms: medians over {args.rounds * args.steps} steps, slowest rank; state: bytes per "
        f"rank after a step; dloss: per-step loss vs {ref_name}'s)"
    )
    if "zero3" in med:
        print(f"zero3 peak gathered parameters: {res['peak_gathered_bytes'] / 2**20:.2f} MiB")
    if peers:
        print(f"{'meshwise / peer':30}{'step time':>10}{'state bytes':>13}")
    summary = {}
    for ours, peer in peers.items():
        time_ratio, bytes_ratio = med[ours]["step"] / med[peer]["step"], state[ours] / state[peer]
        print(f"{ours + ' / ' + peer:30}{time_ratio:10.3f}{bytes_ratio:13.3f}")
        key = {
            "zero0": "zero0_vs_ddp",
            "zero1": "zero1_vs_zero_redundancy",
            "zero3": "zero3_vs_fsdp2",
        }[ours]
        summary[f"{key}_ratio"] = time_ratio
        summary[f"{key}_bytes_ratio"] = bytes_ratio
    if "zero3" in peers:
        summary["zero3_peer"] = peers["zero3"]
    summary.update({f"{name}_step_s": med[name]["step"] for name in names})
    summary.update({f"{name}_state_bytes": state[name] for name in names})
    summary.update(
        zero3_peak_gathered_bytes=res["peak_gathered_bytes"],
        num_params=n,
        world_size=args.world_size,
        steps_each=args.rounds * args.steps,
        errors=res["errors"],
    )
    return summary


# ---------------------------------------------------------------- entry
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    add_gpt_args(p, n_layer=4, n_head=6, d_model=384, batch_size=8, lr=1e-4)  # 7.25M params
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="bucket_cap_mb for meshwise stages 0-2 and DDP (default 25)",
    )
    p.add_argument(
        "--zro-bucket-view",
        action="store_true",
        help="ZeroRedundancyOptimizer(parameters_as_bucket_view=True)",
    )
    p.add_argument("--seed", type=int, default=0, help="initial weights (default 0)")
    add_round_args(p, warmup=2, rounds=8, steps=3)
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset to run (default all: {','.join(VARIANTS)})",
    )
    p.add_argument(
        "--profile",
        choices=VARIANTS,
        default=None,
        help="also run torch.profiler over --steps steps of this variant (rank 0)",
    )
    p.add_argument(
        "--memory-table",
        action="store_true",
        help="only the model-state bytes table: GPT small, stages 0-3, N = 2 and 4",
    )
    p.add_argument(
        "--memory-ranks", default="2,4", help="world sizes for --memory-table (default 2,4)"
    )
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    given = args.variants.split(",")
    unknown = [v for v in given if v not in VARIANTS]
    if unknown or not given:
        p.error(
            f"--variants {args.variants!r}: not valid: {', '.join(unknown)}; "
            f"valid: {', '.join(VARIANTS)}"
        )
    args.variants = [v for v in VARIANTS if v in given]  # timed in the canonical order
    if args.warmup < 1:  # FSDP2's probe step is its first warm-up step
        p.error(f"--warmup must be >= 1, got {args.warmup}")
    if args.profile and args.profile not in args.variants:
        p.error(f"--profile {args.profile} is not among --variants {','.join(args.variants)}")
    if args.memory_table:
        summary = memory_table([int(n) for n in args.memory_ranks.split(",")])
    else:
        if args.batch_size % args.world_size:
            p.error(
                f"--batch-size {args.batch_size} is not divisible by --world-size {args.world_size}"
            )
        per_rank = spawn(
            rank_main, args.world_size, args, ignore_warnings=[FutureWarning, UserWarning]
        )
        summary = report(args, merge_ranks(per_rank))
    print_json(summary)


if __name__ == "__main__":
    main()
