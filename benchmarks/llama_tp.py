"""Llama throughput: ``meshwise train`` at dp 2 and tp 2 beside PyTorch's DTensor tensor parallel.

Three variants train the same Llama (``--model llama-small`` by default) from the
same initial values on the same global batches of one token file, on 2 gloo
ranks of this machine (one thread each):

* ``meshwise_dp2``: ``meshwise train --dp 2``;
* ``meshwise_tp2``: ``meshwise train --tp 2`` (Megatron's layout from the Llama
  plan: q/k/v and gate/up column parallel, o and down row parallel, the
  vocabulary split for the embedding, the head and the loss);
* ``torch_tp2``: the same plain model (``meshwise.models.llama.Llama``) laid out
  torchtitan's way by ``torch.distributed.tensor.parallel.parallelize_module``:
  ``ColwiseParallel`` for q/k/v and gate/up, ``RowwiseParallel`` for o and down,
  the embedding split by rows of the vocabulary, the head by columns with its
  loss under ``loss_parallel``; ``torch.optim.AdamW`` with meshwise's learning
  rate schedule, weight-decay split and global gradient clipping.

meshwise's tokens/s are what its metrics report for each step (global tokens
over the step's time); torch's steps are timed the same way (zero_grad to the
end of the optimizer step, the slower rank's). Each variant runs as its own job,
``--rounds`` times in alternating order, so drift in the machine's speed hits
all alike; the first ``--warmup`` steps of every job are left out, and the
medians of the remaining steps are compared. ``loss_rel_diff`` is the largest
relative difference between meshwise's and torch's tp 2 losses step by step
(same model, data and optimizer: round-off only). The last line is one JSON
object.

    python benchmarks/llama_tp.py [--model llama-small --seq-len 128 --batch-size 8 --steps 12]

The PyTorch side calls ``torch.distributed`` directly (a benchmark, not the library).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.common import median, print_json, rel_diff, slowest, spawn  # noqa: E402

WORLD_SIZE = 2
LR, WARMUP_STEPS, CLIP, WEIGHT_DECAY, SEED = 1e-3, 2, 1.0, 0.1, 1234


def _env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
        PYTHONUNBUFFERED="1",
    )


def train_flags(args, data: Path) -> list[str]:
    """What every variant trains: the model, the data, the optimizer (meshwise's flags)."""
    return [
        "--model",
        args.model,
        "--data",
        str(data),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--lr",
        str(LR),
        "--warmup-steps",
        str(WARMUP_STEPS),
        "--clip",
        str(CLIP),
        "--weight-decay",
        str(WEIGHT_DECAY),
        "--seed",
        str(SEED),
    ]


def run_meshwise(args, data: Path, workdir: Path, name: str, layout: list[str]) -> list[dict]:
    metrics = workdir / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "meshwise",
        "train",
        *train_flags(args, data),
        *layout,
        "--metrics",
        str(metrics),
        "-q",
    ]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


# ---------------------------------------------------------------- the PyTorch side
def torch_tp_model(cfg, mesh):
    """The plain Llama with meshwise's initial values, laid out as torchtitan does
    (without sequence parallelism: activations between blocks replicated)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from meshwise.models.families import family

    model = family("llama").create(cfg, seed=SEED)
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(cfg.n_layer):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def clip_global_norm(params, clip: float) -> float:
    """The global gradient norm (sharded gradients summed over tp, replicated ones
    counted once), and every gradient scaled as meshwise clips.

    A gradient's own placements decide: the embedding's comes back replicated
    although its weight is sharded by rows."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    split = [
        isinstance(g, DTensor) and not all(p.is_replicate() for p in g.placements) for g in grads
    ]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]  # views
    sharded = [g for g, s in zip(local, split) if s]
    replicated = [g for g, s in zip(local, split) if not s]
    sq = torch.stack([g.float().pow(2).sum() for g in sharded]).sum()
    dist.all_reduce(sq)
    sq = sq + torch.stack([g.float().pow(2).sum() for g in replicated]).sum()
    norm = math.sqrt(sq.item())
    scale = min(1.0, clip / (norm + 1e-6))
    if scale < 1.0:
        for g in sharded + replicated:
            g.mul_(scale)
    return norm


def torch_worker(rank: int, args, data: str, sizes: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from meshwise.data.dataset import TokenDataset
    from meshwise.models.families import family
    from meshwise.sharding.adamw import decays
    from meshwise.train.lr_schedule import lr_at

    cfg = family("llama").make_config(sizes)
    model = torch_tp_model(cfg, init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",)))
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    dataset = TokenDataset(data, args.seq_len)
    times, losses = [], []
    for step in range(1, args.steps + 1):
        batch = dataset.global_batch(step, args.batch_size, SEED)  # (B, T + 1)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, LR, WARMUP_STEPS, args.steps)
        dist.barrier()  # both ranks start together: the step is bounded by the slower one
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with loss_parallel():
            logits = model(batch[:, :-1])  # (B, T, V), its vocabulary dim sharded
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
        clip_global_norm([p for _, p in named], CLIP)
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return {"times": times, "losses": losses}


def run_torch(args, data: Path, sizes: dict) -> dict:
    per_rank = spawn(torch_worker, WORLD_SIZE, args, str(data), sizes)
    return {"step_time_s": slowest([r["times"] for r in per_rank]), "losses": per_rank[0]["losses"]}


# ---------------------------------------------------------------- driver
def prepare(args) -> tuple[Path, dict]:
    """The token file every variant reads, and the model's sizes."""
    from meshwise.data.dataset import resolve_data
    from meshwise.train.config import ModelConfig

    data = resolve_data(args.data, None, None)
    sizes = ModelConfig(preset=args.model).sizes(vocab_size=256)
    return data, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="llama-small", help="a llama preset (default llama-small)"
    )
    parser.add_argument(
        "--data", default=None, help="as meshwise train --data (default: its corpus, byte-level)"
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="global sequences per step")
    parser.add_argument("--steps", type=int, default=12, help="steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of a job not timed")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per variant, alternating")
    args = parser.parse_args()
    if not args.model.startswith("llama") or args.steps <= args.warmup:
        parser.error("--model must be a llama preset and --steps > --warmup")
    workdir = Path(tempfile.mkdtemp(prefix="llama-tp-"))
    data, sizes = prepare(args)
    variants = {"meshwise_dp2": ["--dp", "2"], "meshwise_tp2": ["--tp", "2"], "torch_tp2": None}
    step_times = {name: [] for name in variants}
    losses = {}
    for r in range(args.rounds):
        for name in list(variants)[::-1] if r % 2 else variants:
            if variants[name] is None:
                run = run_torch(args, data, sizes)
                times, losses[name] = run["step_time_s"], run["losses"]
            else:
                records = run_meshwise(args, data, workdir, name, variants[name])
                times = [rec["step_time_s"] for rec in records]
                losses[name] = [rec["loss"] for rec in records]
            step_times[name] += times[args.warmup :]
    tokens = args.batch_size * args.seq_len
    tps = {name: tokens / median(t) for name, t in step_times.items()}
    drift = max(map(rel_diff, losses["meshwise_tp2"], losses["torch_tp2"]))
    print(
        f"{args.model} seq {args.seq_len} batch {args.batch_size}, {len(step_times['torch_tp2'])}"
        f" timed steps each: meshwise dp2 {tps['meshwise_dp2']:,.0f} tokens/s, meshwise tp2 "
        f"{tps['meshwise_tp2']:,.0f}, torch DTensor tp2 {tps['torch_tp2']:,.0f}; tp2 losses "
        f"differ by at most {drift:.1e} (relative)"
    )
    print_json(
        {
            "model": args.model,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "meshwise_dp2_tokens_per_s": tps["meshwise_dp2"],
            "meshwise_tp2_tokens_per_s": tps["meshwise_tp2"],
            "torch_tp2_tokens_per_s": tps["torch_tp2"],
            "tp2_ratio": tps["meshwise_tp2"] / tps["torch_tp2"],
            "dp2_over_torch_tp2": tps["meshwise_dp2"] / tps["torch_tp2"],
            "loss_rel_diff": drift,
            "timed_steps": len(step_times["torch_tp2"]),
            "world_size": WORLD_SIZE,
        }
    )


if __name__ == "__main__":
    main()
