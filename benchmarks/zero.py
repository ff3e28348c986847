"""ZeRO stages 0-3: meshwise vs DDP, ZeroRedundancyOptimizer and FSDP2, side by side.

Spawns 2 gloo ranks on this machine (one thread each). Every variant trains its
own copy of the same GPT (``meshwise.models.gpt``, identical initial weights) on
the same global batches, each rank taking a contiguous half; the summed token
loss is divided by the global token count. AdamW everywhere with the same
hyperparameters and the same weight-decay split (matrices only):

- ``zero0`` meshwise ``ZeroOptimizer(stage=0)``  vs ``ddp``: ``DistributedDataParallel``
  + ``torch.optim.AdamW``;
- ``zero1`` meshwise ``ZeroOptimizer(stage=1)``  vs ``zero_redundancy``:
  ``ZeroRedundancyOptimizer(optimizer_class=AdamW)`` around DDP;
- ``zero2`` meshwise ``ZeroOptimizer(stage=2)`` (no torch peer);
- ``zero3`` meshwise ``ZeroStage3`` vs ``fsdp2``: ``fully_shard`` on each
  transformer block then the root, over a gloo ``DeviceMesh`` on CPU (FSDP1 if
  FSDP2 fails to run; the error is printed).

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
import gc
import json
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# Runnable from a checkout without installing (spawned ranks re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshwise.comm import ops  # noqa: E402
from meshwise.data import rank_slice  # noqa: E402
from meshwise.models.gpt import GPT, GPTConfig  # noqa: E402
from meshwise.optim import AdamWConfig, decays  # noqa: E402
from meshwise.zero.optimizer import ZeroOptimizer  # noqa: E402
from meshwise.zero.params import ZeroStage3  # noqa: E402

# Timed in this order (reversed every other round); each meshwise stage then its peer.
VARIANTS = ("zero0", "ddp", "zero1", "zero_redundancy", "zero2", "zero3", "fsdp2")
PEER_OF = {"zero0": "ddp", "zero1": "zero_redundancy", "zero3": "fsdp2"}
STAGE_OF = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}
SMALL_PRESET = GPTConfig(n_layer=6, n_head=6, d_model=384, block_size=512, vocab_size=256)


def zero_formula_bytes(stage: int, num_params: int, world_size: int) -> float:
    """Model-state bytes per rank for fp32 AdamW (ZeRO paper, section 5, K = 12)."""
    psi, n = num_params, world_size
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n,
            3: 16 * psi / n}[stage]


# ---------------------------------------------------------------- setup
def gpt_config(args) -> GPTConfig:
    return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                     block_size=args.seq_len, vocab_size=256)


def local_batches(args, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` global batches (the same for every variant); this rank's contiguous slice."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(count):
        batch = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=gen)
        local = rank_slice(batch, rank, args.world_size)  # (B / N, T + 1)
        out.append((local[:, :-1].contiguous(), local[:, 1:].contiguous()))
    return out


def adamw_config(args) -> AdamWConfig:
    return AdamWConfig(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def torch_param_groups(model: nn.Module, cfg: AdamWConfig) -> list[dict]:
    """The same weight-decay split as meshwise (``decays``: matrices only)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if decays(n, p)], "weight_decay": cfg.weight_decay},
            {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    storages.pop(0, None)  # empty storages may share the null pointer
    return sum(storages.values())


def torch_state_bytes(model: nn.Module, opt) -> int:
    tensors = []
    for p in model.parameters():
        tensors += [p, p.grad]
    optimizers = [opt] + ([opt.optim] if hasattr(opt, "optim") else [])  # ZeRO's local AdamW
    for o in optimizers:
        for state in o.state.values():
            tensors += list(state.values())
    return held_bytes(tensors)


# ---------------------------------------------------------------- runners
class MeshwiseRunner:
    """zero_grad, forward + backward, finish_grad_sync, AdamW step on a meshwise engine."""

    def __init__(self, model, engine, global_tokens: int, lr: float):
        self.model, self.engine, self.global_tokens, self.lr = model, engine, global_tokens, lr

    def step(self, x, y) -> tuple[float, dict]:
        start = time.perf_counter()
        self.engine.zero_grad()
        loss = self.model(x, y) / self.global_tokens
        loss.backward()
        sync_start = time.perf_counter()
        self.engine.finish_grad_sync()
        optim_start = time.perf_counter()
        self.engine.step(self.lr)
        end = time.perf_counter()
        return loss.item(), {"step": end - start, "fwd_bwd": sync_start - start,
                             "sync": optim_start - sync_start, "optim": end - optim_start}

    def state_bytes(self) -> int:
        return self.engine.state_bytes()


class TorchRunner:
    """zero_grad, forward + backward (the wrapper syncs inside), ``opt.step()``.

    DDP and FSDP average gradients over ranks where meshwise sums them, so the
    loss backpropagated here is scaled by the world size: both then apply the
    gradient of the global mean loss (the same AdamW steps, not just nearly the
    same: Adam is scale-invariant only up to ``eps``).
    """

    def __init__(self, model, opt, global_tokens: int):
        self.model, self.opt, self.global_tokens = model, opt, global_tokens
        self.world_size = dist.get_world_size()

    def step(self, x, y) -> tuple[float, dict]:
        start = time.perf_counter()
        self.opt.zero_grad()
        loss = self.model(x, y) / self.global_tokens
        (loss * self.world_size).backward()
        optim_start = time.perf_counter()
        self.opt.step()
        end = time.perf_counter()
        return loss.item(), {"step": end - start, "fwd_bwd": optim_start - start, "sync": 0.0,
                             "optim": end - optim_start}

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self.opt)


def build_runner(name: str, args, group, mesh):
    """The model + engine / wrapper + optimizer of variant ``name``."""
    model, cfg = GPT(gpt_config(args)), adamw_config(args)
    tokens = args.batch_size * args.seq_len
    if name in ("zero0", "zero1", "zero2"):
        engine = ZeroOptimizer(model.named_parameters(), group, stage=STAGE_OF[name],
                               adamw=cfg, bucket_cap_mb=args.bucket_mb)
        return MeshwiseRunner(model, engine, tokens, args.lr)
    if name == "zero3":
        return MeshwiseRunner(model, ZeroStage3(model, group, cfg), tokens, args.lr)
    kwargs = dict(lr=args.lr, betas=cfg.betas, eps=cfg.eps)
    if name in ("ddp", "zero_redundancy"):
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb,
                                                  gradient_as_bucket_view=True)
        groups = torch_param_groups(ddp.module, cfg)
        if name == "ddp":
            return TorchRunner(ddp, torch.optim.AdamW(groups, **kwargs), tokens)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW,
                                      parameters_as_bucket_view=args.zro_bucket_view, **kwargs)
        return TorchRunner(ddp, opt, tokens)
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, ModuleWrapPolicy
        from meshwise.models.gpt import Block
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         use_orig_params=True)
    else:
        raise ValueError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}, fsdp1")
    return TorchRunner(model, torch.optim.AdamW(torch_param_groups(model, cfg), **kwargs), tokens)


def build_all(args, group, mesh, first_batch) -> tuple[dict, dict, dict]:
    """Every variant, FSDP1 standing in for FSDP2 if FSDP2 fails (its error returned).

    FSDP2 takes its first warm-up step here, so that it fails before the timing;
    the losses of steps already taken are returned too.
    """
    runners, errors, losses = {}, {}, {}
    for name in args.variants:
        try:
            runners[name] = build_runner(name, args, group, mesh)
            losses[name] = [runners[name].step(*first_batch)[0]] if name == "fsdp2" else []
        except Exception as exc:  # noqa: BLE001 - reported, then the nearest peer runs
            if name != "fsdp2":
                raise
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            runners.pop(name, None)
            runners["fsdp1"], losses["fsdp1"] = build_runner("fsdp1", args, group, mesh), []
    return runners, errors, losses


# ---------------------------------------------------------------- timing
def rank_main(rank: int, args, port: int, results) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(rank))
    ops.init_process_group("gloo", timeout_s=300)
    group = ops.world_group()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (args.world_size,), mesh_dim_names=("dp",))
    data = local_batches(args, rank, args.warmup + args.rounds * args.steps)
    runners, errors, losses = build_all(args, group, mesh, data[0])
    names = list(runners)
    timings = {n: {k: [] for k in ("step", "fwd_bwd", "sync", "optim")} for n in names}
    for name in names:  # warm-up, after the steps build_all already took
        for x, y in data[len(losses[name]):args.warmup]:
            losses[name].append(runners[name].step(x, y)[0])
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            ops.barrier(group)
            for i in range(args.steps):
                x, y = data[args.warmup + r * args.steps + i]
                loss, t = runners[name].step(x, y)
                losses[name].append(loss)
                for k, v in t.items():
                    timings[name][k].append(v)
    state = {n: runner.state_bytes() for n, runner in runners.items()}
    peak = runners["zero3"].engine.peak_gathered_bytes if "zero3" in runners else 0
    if args.profile:
        profile_variant(runners[args.profile], data[:args.steps], args, rank)
    results.put({"rank": rank, "timings": timings, "losses": losses, "state_bytes": state,
                 "peak_gathered_bytes": peak, "errors": errors,
                 "num_params": sum(p.numel() for p in GPT(gpt_config(args)).parameters())})
    ops.destroy_process_group()


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
    first = per_rank[0]
    timings = {n: {k: [max(vals) for vals in zip(*(r["timings"][n][k] for r in per_rank))]
                   for k in t} for n, t in first["timings"].items()}
    state = {n: max(r["state_bytes"][n] for r in per_rank) for n in first["state_bytes"]}
    peak = max(r["peak_gathered_bytes"] for r in per_rank)
    rank0 = next(r for r in per_rank if r["rank"] == 0)
    return {"timings": timings, "state_bytes": state, "peak_gathered_bytes": peak,
            "losses": rank0["losses"], "errors": first["errors"],
            "num_params": first["num_params"]}


def report(args, res) -> dict:
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in res["timings"].items()}
    names, state, n = list(med), res["state_bytes"], res["num_params"]
    peers = {m: ("fsdp1" if p == "fsdp2" and "fsdp1" in med else p) for m, p in PEER_OF.items()}
    peers = {m: p for m, p in peers.items() if m in med and p in med}
    ref_name = "zero0" if "zero0" in med else names[0]
    ref = res["losses"][ref_name]
    print(f"model: GPT n_layer {args.n_layer}, n_head {args.n_head}, d_model {args.d_model}, "
          f"{n / 1e6:.2f}M params; global batch {args.batch_size} x {args.seq_len} tokens; "
          f"{args.world_size} gloo ranks, 1 thread each; bucket_cap_mb {args.bucket_mb}")
    for name, err in res["errors"].items():
        print(f"{name} failed on CPU/gloo, compared against fsdp1 instead: {err}")
    print(f"{'variant':17}{'step ms':>9}{'fwd+bwd':>9}{'sync':>8}{'optim':>8}"
          f"{'state MiB':>11}{'formula':>9}{'max rel dloss':>15}")
    for name in names:
        stage = STAGE_OF.get(name, {"ddp": 0, "zero_redundancy": 1}.get(name, 3))
        dloss = max(abs(a - b) / abs(b) for a, b in zip(res["losses"][name], ref))
        m = med[name]
        print(f"{name:17}{1e3 * m['step']:9.1f}{1e3 * m['fwd_bwd']:9.1f}{1e3 * m['sync']:8.1f}"
              f"{1e3 * m['optim']:8.1f}{state[name] / 2**20:11.2f}"
              f"{zero_formula_bytes(stage, n, args.world_size) / 2**20:9.2f}{dloss:15.1e}")
    print(f"(ms: medians over {args.rounds * args.steps} steps, slowest rank; state: bytes per "
          f"rank after a step; dloss: per-step loss vs {ref_name}'s)")
    if "zero3" in med:
        print(f"zero3 peak gathered parameters: {res['peak_gathered_bytes'] / 2**20:.2f} MiB")
    if peers:
        print(f"{'meshwise / peer':30}{'step time':>10}{'state bytes':>13}")
    summary = {}
    for ours, peer in peers.items():
        time_ratio, bytes_ratio = med[ours]["step"] / med[peer]["step"], state[ours] / state[peer]
        print(f"{ours + ' / ' + peer:30}{time_ratio:10.3f}{bytes_ratio:13.3f}")
        key = {"zero0": "zero0_vs_ddp", "zero1": "zero1_vs_zero_redundancy",
               "zero3": "zero3_vs_fsdp2"}[ours]
        summary[f"{key}_ratio"] = time_ratio
        summary[f"{key}_bytes_ratio"] = bytes_ratio
    if "zero3" in peers:
        summary["zero3_peer"] = peers["zero3"]
    summary.update({f"{name}_step_s": med[name]["step"] for name in names})
    summary.update({f"{name}_state_bytes": state[name] for name in names})
    summary.update(zero3_peak_gathered_bytes=res["peak_gathered_bytes"], num_params=n,
                   world_size=args.world_size, steps_each=args.rounds * args.steps,
                   errors=res["errors"])
    return summary


# ---------------------------------------------------------------- memory table
def memory_rank_main(rank: int, world_size: int, port: int, results) -> None:
    """One step of each stage on the ``small`` preset; put this rank's bytes."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    ops.init_process_group("gloo", timeout_s=300)
    group = ops.world_group()
    cfg = AdamWConfig(lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (world_size, 17), generator=gen)  # (N, T + 1)
    local = rank_slice(batch, rank, world_size)
    out = {}
    for stage in range(4):
        model = GPT(SMALL_PRESET)
        num_params = sum(p.numel() for p in model.parameters())
        engine = (ZeroStage3(model, group, cfg) if stage == 3 else
                  ZeroOptimizer(model.named_parameters(), group, stage=stage, adamw=cfg))
        runner = MeshwiseRunner(model, engine, batch[:, 1:].numel(), cfg.lr)
        runner.step(local[:, :-1], local[:, 1:])
        out[stage] = (engine.state_bytes(), getattr(engine, "peak_gathered_bytes", 0))
        del model, engine, runner
        gc.collect()
    results.put({"rank": rank, "bytes": out, "num_params": num_params})
    ops.destroy_process_group()


def memory_table(world_sizes: list[int]) -> dict:
    rows = []
    for world_size in world_sizes:
        per_rank = spawn(memory_rank_main, (world_size,), world_size)
        n = per_rank[0]["num_params"]
        for stage in range(4):
            measured = max(r["bytes"][stage][0] for r in per_rank)
            formula = zero_formula_bytes(stage, n, world_size)
            rows.append({"world_size": world_size, "stage": stage, "num_params": n,
                         "measured_bytes": measured, "formula_bytes": formula,
                         "rel_diff": measured / formula - 1,
                         "peak_gathered_bytes": max(r["bytes"][stage][1] for r in per_rank)})
    print(f"model_state_bytes per rank, GPT small preset ({rows[0]['num_params'] / 1e6:.2f}M "
          f"params), fp32 AdamW; formula 16, 8+8/N, 4+12/N, 16/N bytes per parameter")
    print(f"{'N':>3}{'stage':>7}{'measured MiB':>14}{'formula MiB':>13}{'rel diff':>10}"
          f"{'gathered peak MiB':>19}")
    for r in rows:
        peak = f"{r['peak_gathered_bytes'] / 2**20:19.2f}" if r["stage"] == 3 else f"{'-':>19}"
        print(f"{r['world_size']:3d}{r['stage']:7d}{r['measured_bytes'] / 2**20:14.2f}"
              f"{r['formula_bytes'] / 2**20:13.2f}{r['rel_diff']:10.2%}{peak}")
    return {"memory_table": rows,
            "max_abs_rel_diff": max(abs(r["rel_diff"]) for r in rows)}


# ---------------------------------------------------------------- entry
def spawn(fn, fn_args: tuple, nprocs: int) -> list[dict]:
    """Run ``fn(rank, *fn_args, port, queue)`` on ``nprocs`` ranks; every rank's result."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(fn, args=(*fn_args, port, results), nprocs=nprocs)
    return sorted((results.get() for _ in range(nprocs)), key=lambda r: r["rank"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--n-layer", type=int, default=4, help="GPT layers (default 4)")
    p.add_argument("--n-head", type=int, default=6, help="attention heads (default 6)")
    p.add_argument("--d-model", type=int, default=384,
                   help="hidden size (default 384: 7.25M params)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="global sequences per step (default 8)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="bucket_cap_mb for meshwise stages 0-2 and DDP (default 25)")
    p.add_argument("--zro-bucket-view", action="store_true",
                   help="ZeroRedundancyOptimizer(parameters_as_bucket_view=True)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps each (default 2)")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds (default 8)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round (default 3)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset to run (default all: {','.join(VARIANTS)})")
    p.add_argument("--profile", choices=VARIANTS, default=None,
                   help="also run torch.profiler over --steps steps of this variant (rank 0)")
    p.add_argument("--memory-table", action="store_true",
                   help="only the model-state bytes table: GPT small, stages 0-3, N = 2 and 4")
    p.add_argument("--memory-ranks", default="2,4",
                   help="world sizes for --memory-table (default 2,4)")
    args = p.parse_args(argv)
    given = args.variants.split(",")
    unknown = [v for v in given if v not in VARIANTS]
    if unknown or not given:
        p.error(f"--variants {args.variants!r}: not valid: {', '.join(unknown)}; "
                f"valid: {', '.join(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v in given]  # timed in the canonical order
    if args.warmup < 1:  # FSDP2's probe step is its first warm-up step
        p.error(f"--warmup must be >= 1, got {args.warmup}")
    if args.profile and args.profile not in args.variants:
        p.error(f"--profile {args.profile} is not among --variants {','.join(args.variants)}")
    if args.memory_table:
        summary = memory_table([int(n) for n in args.memory_ranks.split(",")])
    else:
        if args.batch_size % args.world_size:
            p.error(f"--batch-size {args.batch_size} is not divisible by --world-size "
                    f"{args.world_size}")
        summary = report(args, merge_ranks(spawn(rank_main, (args,), args.world_size)))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
