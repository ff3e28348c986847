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
import torch.distributed as dist
from torch import nn

# Runnable from a checkout without installing (spawned ranks re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    adamw_config,
    add_gpt_args,
    add_round_args,
    gpt_config,
    medians,
    meshwise_gpt,
    new_timings,
    print_json,
    record,
    reference_gpt,
    rel_diff,
    run_rounds,
    slowest_timings,
    spawn,
    timed_step,
    token_loss_sum,
    torch_param_groups,
)
from benchmarks.zero_memory import memory_table, zero_formula_bytes  # noqa: E402
from meshwise.comm import ops  # noqa: E402
from meshwise.data.dataset import rank_slice  # noqa: E402
from meshwise.models.gpt import GPT  # noqa: E402
from meshwise.sharding.buckets import ZeroOptimizer  # noqa: E402
from meshwise.sharding.zero3 import ZeroStage3  # noqa: E402

# Timed in this order (reversed every other round); each meshwise stage then its peer.
VARIANTS = ("zero0", "ddp", "zero1", "zero_redundancy", "zero2", "zero3", "fsdp2")
PEER_OF = {"zero0": "ddp", "zero1": "zero_redundancy", "zero3": "fsdp2"}
STAGE_OF = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}


# ---------------------------------------------------------------- setup
def local_batches(args, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` global batches (the same for every variant); this rank's contiguous slice."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(count):
        batch = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=gen)
        local = rank_slice(batch, rank, args.world_size)  # (B / N, T + 1)
        out.append((local[:, :-1].contiguous(), local[:, 1:].contiguous()))
    return out


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
    """zero_grad, forward + backward, finish_grad_sync, AdamW step on a meshwise engine.

    ``settle`` also waits for the step's parameter all-gather (ZeRO-1/2 leave it
    to the next forward): the last step before other work runs.
    """

    def __init__(self, pm, engine, global_tokens: int, lr: float):
        self.model, self.loss_fn = pm.chunks[0], pm.loss
        self.engine, self.global_tokens, self.lr = engine, global_tokens, lr

    def step(self, x, y, settle: bool = True) -> tuple[float, dict]:
        def forward_backward():
            loss = self.loss_fn(self.model(x), y) / self.global_tokens
            loss.backward()
            return loss

        def optimizer_step():
            self.engine.step(self.lr)
            if settle:
                self.engine.wait_params()

        loss, times = timed_step(
            self.engine.zero_grad, forward_backward, self.engine.finish_grad_sync, optimizer_step
        )
        return loss.item(), times

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

    def step(self, x, y, settle: bool = True) -> tuple[float, dict]:
        # ``settle`` as for meshwise: the wrappers leave nothing in flight after a step.
        def forward_backward():
            loss = token_loss_sum(self.model(x), y) / self.global_tokens
            (loss * self.world_size).backward()
            return loss

        loss, times = timed_step(self.opt.zero_grad, forward_backward, None, self.opt.step)
        return loss.item(), times

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self.opt)


def build_runner(name: str, args, group, mesh):
    """The model + engine / wrapper + optimizer of variant ``name``."""
    cfg, tokens = adamw_config(args), args.batch_size * args.seq_len
    if name in ("zero0", "zero1", "zero2", "zero3"):
        pm, values = meshwise_gpt(gpt_config(args), args.seed)
        if name == "zero3":
            (chunk,) = pm.chunks
            engine = ZeroStage3(chunk, group, cfg, units=pm.layers(), values=values)
        else:
            engine = ZeroOptimizer(
                pm.named_parameters(),
                group,
                stage=STAGE_OF[name],
                adamw=cfg,
                bucket_cap_mb=args.bucket_mb,
                modules=pm.chunks,
                values=values,
            )
        return MeshwiseRunner(pm, engine, tokens, args.lr)
    model = reference_gpt(gpt_config(args), args.seed)
    kwargs = dict(lr=args.lr, betas=cfg.betas, eps=cfg.eps)
    if name in ("ddp", "zero_redundancy"):
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True
        )
        groups = torch_param_groups(ddp.module.named_parameters(), cfg)
        if name == "ddp":
            return TorchRunner(ddp, torch.optim.AdamW(groups, **kwargs), tokens)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            groups,
            optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=args.zro_bucket_view,
            **kwargs,
        )
        return TorchRunner(ddp, opt, tokens)
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, ModuleWrapPolicy

        from meshwise.models.gpt import Block

        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True
        )
    else:
        raise ValueError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}, fsdp1")
    opt = torch.optim.AdamW(torch_param_groups(model.named_parameters(), cfg), **kwargs)
    return TorchRunner(model, opt, tokens)


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
def main(argv=None) -> None:
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
