"""Tensor-parallel step time: meshwise vs PyTorch's DTensor tensor parallel.

Two gloo ranks on CPU (one thread each) train the same stack of pre-norm MLP
blocks (LayerNorm -> Linear d->4d -> GELU -> Linear 4d->d, residual), split the
Megatron way (Shoeybi et al. 2019, section 3: first GEMM by columns, second by
rows, one all-reduce forward and one backward per block):

* meshwise: ``ColumnParallelLinear`` + ``RowParallelLinear`` (``from_linear``);
* torch: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``
  on a ``DeviceMesh`` over the gloo world.

Both start from identical full weights and use ``torch.optim.AdamW``. Steps
(forward + backward + optimizer step) alternate between the two so that drift
in the machine's speed hits both alike; each step time is the slowest rank's,
and the median after warm-up is reported. For scale, the unsharded model's step
time in one process is reported as ``single_step_s``. The last line printed is
one JSON object.

    python benchmarks/tensor_parallel.py [--d-model 512 --n-layer 4 --tokens 1024 --steps 20]

The PyTorch side calls ``torch.distributed`` directly (a benchmark, not the library).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# Run from a checkout without installing: the repository root holds ``meshwise``.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median, print_json, rel_diff, run_rounds, slowest, spawn  # noqa: E402

WORLD_SIZE = 2


class Block(nn.Module):
    """Pre-norm MLP block; ``fc1`` / ``fc2`` are whatever linear layers are passed in."""

    def __init__(self, d_model: int, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def build_reference(args) -> nn.Sequential:
    """The unsharded model every variant copies its weights from (same on every rank)."""
    torch.manual_seed(0)
    d, h = args.d_model, 4 * args.d_model
    return nn.Sequential(*[Block(d, nn.Linear(d, h), nn.Linear(h, d)) for _ in range(args.n_layer)])


def build_meshwise(args, reference: nn.Sequential, tp_group) -> nn.Sequential:
    """Each block's linears turned parallel by ``from_linear`` (it keeps this rank's slice)."""
    import copy

    from meshwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    model = copy.deepcopy(reference)
    for block in model:
        block.fc1 = ColumnParallelLinear.from_linear(block.fc1, tp_group)
        block.fc2 = RowParallelLinear.from_linear(block.fc2, tp_group)
    return model


def build_torch_tp(args, reference: nn.Sequential):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    model = copy.deepcopy(reference)
    for block in model:
        parallelize_module(block, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model


def make_step(model: nn.Module, lr: float = 1e-4):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(x, target) -> float:
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def timed(step, x, target) -> tuple[float, float]:
    dist.barrier()  # both ranks start together: the step is bounded by the slower one
    start = time.perf_counter()
    loss = step(x, target)
    return time.perf_counter() - start, loss


def single_process_median(args, reference, x, target) -> float:
    import copy

    step = make_step(copy.deepcopy(reference))
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        step(x, target)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return median(times)


def worker(rank: int, args) -> dict:
    from meshwise.mesh import Mesh, ParallelDims

    mesh = Mesh.build(ParallelDims(tp=WORLD_SIZE))
    reference = build_reference(args)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.d_model, generator=gen)
    target = torch.randn(args.tokens, args.d_model, generator=gen)
    steps = {
        "meshwise": make_step(build_meshwise(args, reference, mesh.tp_group)),
        "torch_tp": make_step(build_torch_tp(args, reference)),
    }
    times = {name: [] for name in steps}
    losses = {name: [] for name in steps}

    def one_step(name: str, r: int, _) -> None:
        dt, loss = timed(steps[name], x, target)
        losses[name].append(loss)
        if r >= args.warmup:
            times[name].append(dt)

    # One step of each per round, who goes first alternating; the first rounds warm up.
    run_rounds(steps, args.warmup + args.steps, 1, one_step)
    single = single_process_median(args, reference, x, target) if rank == 0 else None
    dist.barrier()
    drift = max(map(rel_diff, losses["meshwise"], losses["torch_tp"]))
    return {"times": times, "single": single, "loss_rel_diff": drift}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="rows of the input batch")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 1 or args.d_model % WORLD_SIZE:
        parser.error("--steps must be >= 1 and --d-model divisible by 2")

    per_rank = spawn(worker, WORLD_SIZE, args)
    res = per_rank[0]
    med = {name: median(slowest([r["times"][name] for r in per_rank])) for name in res["times"]}
    print(
        f"d_model={args.d_model} n_layer={args.n_layer} tokens={args.tokens} "
        f"steps={args.steps}: meshwise {med['meshwise'] * 1e3:.1f} ms, "
        f"torch TP {med['torch_tp'] * 1e3:.1f} ms, one process {res['single'] * 1e3:.1f} ms; "
        f"max relative loss difference {res['loss_rel_diff']:.2e}"
    )
    print_json(
        {
            "meshwise_step_s": med["meshwise"],
            "torch_tp_step_s": med["torch_tp"],
            "ratio": med["meshwise"] / med["torch_tp"],
            "single_step_s": res["single"],
            "loss_rel_diff": res["loss_rel_diff"],
            "world_size": WORLD_SIZE,
            "d_model": args.d_model,
            "n_layer": args.n_layer,
            "tokens": args.tokens,
            "steps": args.steps,
        }
    )


if __name__ == "__main__":
    main()
