"""Peak process memory and step time of ZeRO 0-3: meshwise beside DDP, FSDP2 and DeepSpeed.

Every variant runs as its own job: fresh gloo ranks on this machine (one thread
each), so no variant's allocations can hide in another's. Each rank reads its
RSS once its imports are done and the process group is up, before the model is
built (the baseline), and resets its high-water mark there; after the last step
it reads ``VmHWM`` from ``/proc/self/status``. Reported per variant: the peak
above the baseline (the worst rank's), the same per parameter, and the median
step time (each step's slowest rank, after ``--warmup`` steps), beside the ZeRO
formula's model-state bytes per parameter for fp32 AdamW (16, 8 + 8/N,
4 + 12/N, 16/N; Rajbhandari et al. 2019, section 5).

- ``zero0``-``zero3``: meshwise, built as ``meshwise train --zero K`` builds it
  (its flags parsed by meshwise's own parser into a ``TrainConfig``, then
  ``Trainer`` and ``train_step`` inside the rank);
- ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)`` + ``torch.optim.AdamW``;
- ``fsdp2``: ``fully_shard`` on each transformer block, then the root;
- ``deepspeed1``-``deepspeed3``: ``deepspeed.initialize`` with ZeRO stage K
  (``DS_ACCELERATOR=cpu``, gloo), skipped with the reason when it cannot run.

The peers train the same meshwise GPT (same initial weights) on the same global
batches of the same token file with the same AdamW, learning-rate schedule,
weight-decay split, clipping and bucket size; ``--dtype bf16`` is meshwise's
mixed precision (bf16 parameters, fp32 master weights), DDP under autocast, FSDP2 with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and DeepSpeed's
``bf16`` config. ``--allocator mmap`` (the default) runs every job with
``MALLOC_MMAP_THRESHOLD_=65536``, so that glibc returns freed buffers and RSS
follows live memory; ``default`` leaves glibc as it is. The last line printed is
one JSON object: per variant numbers, ratios meshwise / peer at each stage, and
each meshwise stage's bytes per parameter minus ZeRO-0's.

DeepSpeed is an optional dependency of the benchmarks only:

    DS_BUILD_OPS=0 pip install -e ".[bench]"
    python benchmarks/memory.py [--variants zero3,fsdp2,deepspeed3] [--dtype bf16]
                                [--activation-checkpointing] [--allocator default]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

# Runnable from a checkout without installing (spawned ranks re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_gpt_args, print_json, rel_diff, slowest, spawn  # noqa: E402
from benchmarks.memory_runners import DEEPSPEED, rank_main  # noqa: E402
from benchmarks.zero_memory import zero_formula_bytes  # noqa: E402

# Run in this order: each meshwise stage, then its peers.
VARIANTS = (
    "zero0",
    "ddp",
    "zero1",
    "deepspeed1",
    "zero2",
    "deepspeed2",
    "zero3",
    "fsdp2",
    "deepspeed3",
)
STAGE_OF = {
    "zero0": 0,
    "zero1": 1,
    "zero2": 2,
    "zero3": 3,
    "ddp": 0,
    "fsdp2": 3,
    "deepspeed1": 1,
    "deepspeed2": 2,
    "deepspeed3": 3,
}
COMPARISONS = (
    ("zero0", "ddp"),
    ("zero1", "deepspeed1"),
    ("zero2", "deepspeed2"),
    ("zero3", "deepspeed3"),
    ("zero3", "fsdp2"),
)
MMAP_THRESHOLD = "65536"


# ---------------------------------------------------------------- configuration
def meshwise_command(args, data_path: Path) -> list[str]:
    """The ``meshwise train`` flags every variant shares (``--zero`` is added per stage)."""
    flags = [
        "--dp",
        args.world_size,
        "--n-layer",
        args.n_layer,
        "--n-head",
        args.n_head,
        "--d-model",
        args.d_model,
        "--block-size",
        args.seq_len,
        "--seq-len",
        args.seq_len,
        "--batch-size",
        args.batch_size,
        "--steps",
        args.steps,
        "--lr",
        args.lr,
        "--warmup-steps",
        0,
        "--clip",
        args.clip,
        "--bucket-mb",
        args.bucket_mb,
        "--dtype",
        args.dtype,
        "--activation-checkpointing",
        "full" if args.activation_checkpointing else "none",
        "--device",
        "cpu",
        "--data",
        data_path,
        "--quiet",
    ]
    return [str(f) for f in flags]


def train_config(flags: list[str], stage: int):
    """The validated ``TrainConfig`` that ``meshwise train <flags> --zero stage`` runs."""
    from meshwise.cli.main import build_parser
    from meshwise.cli.train import train_config as cli_train_config

    return cli_train_config(build_parser().parse_args(["train", *flags, "--zero", str(stage)]))[0]


# ---------------------------------------------------------------- jobs
def run_job(variant: str, cfg, data_path: Path) -> list[dict]:
    """``variant`` on fresh ranks; what each rank measured."""
    return spawn(
        rank_main,
        cfg.parallel.dims.world_size,
        variant,
        cfg,
        str(data_path),
        timeout_s=cfg.comm.timeout_s,
        ignore_warnings=[FutureWarning, UserWarning, DeprecationWarning],
    )


def failure_reason(exc: Exception) -> str:
    """The last line of a rank's traceback (``Type: message``)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def summarize(per_rank: list[dict], warmup: int, world_size: int, stage: int) -> dict:
    """Worst rank's peak above its baseline; median over steps of the slowest rank."""
    n = per_rank[0]["num_params"]
    peak = max(r["hwm"] - r["baseline_rss"] for r in per_rank)
    built = max(r["built_rss"] - r["baseline_rss"] for r in per_rank)
    steps = slowest([r["step_s"] for r in per_rank])[warmup:]
    return {
        "stage": stage,
        "step_s": statistics.median(steps),
        "peak_bytes": peak,
        "built_bytes": built,
        "bytes_per_param": peak / n,
        "num_params": n,
        "formula_bytes_per_param": zero_formula_bytes(stage, n, world_size) / n,
        "losses": per_rank[0]["losses"],
        "peak_was_reset": all(r["peak_was_reset"] for r in per_rank),
    }


# ---------------------------------------------------------------- report
def report(args, results: dict[str, dict], skipped: dict[str, str]) -> dict:
    mib = 2**20
    ref_name = next((v for v in ("zero0", "zero1", "zero2", "zero3") if v in results), None)
    print(
        f"{'variant':12}{'stage':>6}{'step s':>9}{'peak MiB':>10}{'built MiB':>11}"
        f"{'B/param':>9}{'formula':>9}{'dloss':>9}"
    )
    for name, r in results.items():
        dloss = (
            max(map(rel_diff, r["losses"], results[ref_name]["losses"]))
            if ref_name
            else float("nan")
        )
        print(
            f"{name:12}{r['stage']:6d}{r['step_s']:9.3f}{r['peak_bytes'] / mib:10.1f}"
            f"{r['built_bytes'] / mib:11.1f}{r['bytes_per_param']:9.2f}"
            f"{r['formula_bytes_per_param']:9.2f}{dloss:9.1e}"
        )
    print(
        f"(step s: median over {args.steps - args.warmup} steps after {args.warmup} warm-up, "
        f"slowest rank; peak / built: VmHWM at the end / RSS after building, above the RSS "
        f"after imports, worst rank; formula: fp32 AdamW model state; dloss: largest "
        f"relative difference of a step's loss from {ref_name}'s)"
    )
    for name, reason in skipped.items():
        print(f"{name}: skipped: {reason}")
    if any(not r["peak_was_reset"] for r in results.values()):
        print("note: /proc/self/clear_refs was not writable; peaks include import transients")
    summary = {
        "allocator": args.allocator,
        "dtype": args.dtype,
        "activation_checkpointing": args.activation_checkpointing,
        "world_size": args.world_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "num_params": next(iter(results.values()))["num_params"] if results else 0,
        "variants": results,
        "skipped": skipped,
    }
    if results:
        print(f"{'meshwise / peer':24}{'memory':>8}{'time':>8}")
    for ours, peer in COMPARISONS:
        if ours in results and peer in results:
            mem = results[ours]["peak_bytes"] / results[peer]["peak_bytes"]
            step = results[ours]["step_s"] / results[peer]["step_s"]
            print(f"{ours + ' / ' + peer:24}{mem:8.3f}{step:8.3f}")
            summary[f"{ours}_vs_{peer}_mem"], summary[f"{ours}_vs_{peer}_time"] = mem, step
    if "zero0" in results:
        for stage in (1, 2, 3):
            if f"zero{stage}" in results:
                summary[f"zero{stage}_minus_zero0_bytes_per_param"] = (
                    results[f"zero{stage}"]["bytes_per_param"] - results["zero0"]["bytes_per_param"]
                )
    return summary


# ---------------------------------------------------------------- entry
def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    add_gpt_args(p, n_layer=8, n_head=12, d_model=768, batch_size=4, lr=3e-4, seq_len=64)
    p.add_argument("--steps", type=int, default=5, help="steps per variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (default 1)")
    p.add_argument(
        "--clip",
        type=float,
        default=1.0,
        help="max global gradient norm, every variant; 0: off (default 1.0)",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="gradient bucket size: meshwise, DDP, DeepSpeed's reduce and "
        "all-gather buckets (default 25)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="text file, folder or token .bin (default: the standard library's "
        "sources, as meshwise train)",
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each transformer block in backward, every variant",
    )
    p.add_argument(
        "--allocator",
        choices=("mmap", "default"),
        default="mmap",
        help=f"mmap: MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} in every job, so RSS "
        "follows live memory; default: glibc as it is (default mmap)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset (default all: {','.join(VARIANTS)})",
    )
    args = p.parse_args(argv)
    given = args.variants.split(",")
    unknown = [v for v in given if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: not valid: {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v in given]
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be >= 0 and below --steps {args.steps}")
    return args


def main(argv=None) -> None:
    start = time.perf_counter()
    args = parse_args(argv)
    from meshwise.data.dataset import resolve_data

    data_path = resolve_data(args.data)
    flags = meshwise_command(args, data_path)
    configs = {v: train_config(flags, STAGE_OF[v]) for v in args.variants}  # fails early
    if args.allocator == "mmap":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # read by each job at its start
    os.environ["DS_ACCELERATOR"] = "cpu"
    n = configs[args.variants[0]].model.resolved()
    print(
        f"GPT n_layer {n.n_layer}, n_head {n.n_head}, d_model {n.d_model}, vocab 256; global "
        f"batch {args.batch_size} x {args.seq_len}; {args.world_size} gloo ranks, 1 thread "
        f"each; dtype {args.dtype}; activation checkpointing "
        f"{'full' if args.activation_checkpointing else 'none'}; allocator {args.allocator}"
    )
    print(f"meshwise: meshwise train {' '.join(flags)} --zero K", flush=True)
    results, skipped = {}, {}
    for variant in args.variants:
        if variant in DEEPSPEED and importlib.util.find_spec("deepspeed") is None:
            skipped[variant] = (
                'deepspeed is not installed (DS_BUILD_OPS=0 pip install -e ".[bench]")'
            )
            continue
        job_start = time.perf_counter()
        try:
            per_rank = run_job(variant, configs[variant], data_path)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported
            skipped[variant] = failure_reason(exc)
            print(f"{variant}: failed: {skipped[variant]}", file=sys.stderr, flush=True)
            continue
        results[variant] = summarize(per_rank, args.warmup, args.world_size, STAGE_OF[variant])
        print(f"{variant}: done in {time.perf_counter() - job_start:.0f} s", flush=True)
    summary = report(args, results, skipped)
    summary["wall_s"] = time.perf_counter() - start
    print_json(summary)


if __name__ == "__main__":
    main()
