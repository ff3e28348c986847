"""Step time with and without ``--compile`` on llama-small, on one process and at --dp 2,
beside a plain PyTorch loop of the same model compiled the same way (each decoder
layer ``torch.compile(fullgraph=True)``; at dp 2 under ``DistributedDataParallel``).

    python benchmarks/compile.py [--model llama-small --seq-len 512 --batch-size 4]

Each variant is a fresh job of ``--warmup`` untimed steps (the first pays the compile)
and ``--steps`` timed ones; the slowest rank's step times, medians over ``--rounds``
rounds in alternating order. The compile seconds are meshwise's first-step breakdown.
Set TORCHINDUCTOR_CACHE_DIR to keep the compiled kernels between runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.common import median, print_json, rel_diff, slowest, spawn  # noqa: E402

VARIANTS = ("meshwise_eager", "meshwise_compiled", "torch_eager", "torch_compiled")


def train_config(args, dp: int, compiled: bool):
    from meshwise.cli.main import build_parser
    from meshwise.cli.train import train_config as parse

    flags = [
        "train",
        "--model",
        args.model,
        "--dp",
        str(dp),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.warmup + args.steps),
        "--warmup-steps",
        "1",
        "--device",
        "cpu",
        "-q",
    ]
    flags += ["--compile"] if compiled else []
    return parse(build_parser().parse_args(flags))[0]


def meshwise_worker(rank: int, args, data: str, compiled: bool) -> dict:
    from meshwise.train.trainer import Trainer

    trainer = Trainer(train_config(args, args.world, compiled), data)
    records = [trainer.train_step(step) for step in range(1, args.warmup + args.steps + 1)]
    trainer.comm_stats.close()
    return {
        "times": [r["step_time_s"] for r in records[args.warmup :]],
        "losses": [r["loss"] for r in records],
        "compile_s": records[0]["time_breakdown"].get("compile", 0.0),
    }


def torch_worker(rank: int, args, data: str, compiled: bool) -> dict:
    """The plain loop: the whole model, AdamW (foreach), summed token loss over the global
    tokens, each rank its slice of the global batch, DDP's all-reduce at dp 2."""
    import torch.distributed as dist

    from meshwise.data.dataset import TokenDataset
    from meshwise.models.families import family
    from meshwise.train.config import ModelConfig

    fam = family("llama")
    model = fam.create(fam.make_config(ModelConfig(preset=args.model).sizes(256)), seed=0)
    if compiled:
        for layer in model.layers.values():
            layer.compile(fullgraph=True)
    if args.world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    dataset = TokenDataset(data, args.seq_len)
    per_rank = args.batch_size // args.world
    times, losses = [], []
    for step in range(1, args.warmup + args.steps + 1):
        start = time.perf_counter()
        batch = dataset.global_batch(step, args.batch_size, 1234)[rank * per_rank :][:per_rank]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
        )
        (loss / batch[:, 1:].numel() / args.world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.world > 1:
            dist.all_reduce(loss := loss.detach())
        losses.append(loss.item() / args.batch_size / args.seq_len)
        times.append(time.perf_counter() - start)
    return {"times": times[args.warmup :], "losses": losses, "compile_s": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-small", help="a llama preset")
    parser.add_argument("--data", default=None, help="as meshwise train --data")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4, help="global sequences per step")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps per job")
    parser.add_argument("--rounds", type=int, default=1, help="jobs per variant, alternating")
    parser.add_argument("--worlds", default="1,2", help="dp sizes to run")
    args = parser.parse_args()
    from meshwise.data.dataset import resolve_data

    data = str(resolve_data(args.data, None, None))
    summary: dict = {"model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size}
    for world in (int(w) for w in args.worlds.split(",")):
        args.world = world
        times, losses, compile_s = {v: [] for v in VARIANTS}, {}, {}
        for r in range(args.rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                worker = meshwise_worker if variant.startswith("meshwise") else torch_worker
                per_rank = spawn(
                    worker, world, args, data, variant.endswith("compiled"), timeout_s=1800
                )
                times[variant] += slowest([p["times"] for p in per_rank])
                losses[variant], compile_s[variant] = (
                    per_rank[0]["losses"],
                    per_rank[0]["compile_s"],
                )
                print(
                    f"dp {world} round {r + 1} {variant}: median "
                    f"{median(times[variant]):.3f} s/step",
                    file=sys.stderr,
                )
        step = {v: median(t) for v, t in times.items()}
        summary[f"dp{world}"] = {
            "step_time_s": step,
            "compiled_over_eager": step["meshwise_compiled"] / step["meshwise_eager"],
            "compiled_over_torch_compiled": step["meshwise_compiled"] / step["torch_compiled"],
            "torch_compiled_over_eager": step["torch_compiled"] / step["torch_eager"],
            "first_step_compile_s": compile_s["meshwise_compiled"],
            "loss_rel_diff_compiled_eager": max(
                rel_diff(a, b)
                for a, b in zip(losses["meshwise_compiled"], losses["meshwise_eager"])
            ),
        }
        for v in VARIANTS:
            print(f"dp {world} {v}: {step[v]:.3f} s/step (median of {len(times[v])})")
    print_json(summary)


if __name__ == "__main__":
    main()
