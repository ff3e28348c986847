"""meshwise's MoE layer at --ep 1 and --ep 2 (2 gloo ranks) beside two references on the
same shapes and weights: a plain per-expert loop in PyTorch, and transformers'
``Qwen3MoeSparseMoeBlock``. Forward and backward of one layer, tokens/s from the median
step of the slowest rank over alternating rounds, and at --ep 2 the all-to-all bytes
meshwise's comm counters count (category "moe") beside the formula

    4 x tokens x top_k x d_model x 4 B x (ep - 1) / ep   per MoE layer and step

(dispatch and combine, forward and backward; each rank keeps 1/ep of its token copies).
Counted, not measured: the counters add the rows each all-to-all sends away.

    python benchmarks/moe.py [--tokens 2048 --d-model 256 --ffn 512 --experts 8 --top-k 2]

deepspeed.moe and torchtitan are not installed here; deepspeed.moe's gate is also
capacity-bound (it drops tokens), a different computation from dropless routing.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.common import median, print_json, run_rounds, slowest, spawn  # noqa: E402
from meshwise.apply.experts import ExpertParallelExperts  # noqa: E402
from meshwise.comm import ops  # noqa: E402
from meshwise.mesh import Mesh, ParallelDims  # noqa: E402
from meshwise.models.llama import LlamaConfig  # noqa: E402
from meshwise.models.moe import MoE  # noqa: E402

CATEGORY = "moe"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank and step")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="each expert's SwiGLU width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    return p.parse_args(argv)


def moe_layer(args) -> MoE:
    """meshwise's MoE layer with weights drawn from seed 0 (the same on every rank)."""
    cfg = LlamaConfig(
        n_layer=1,
        d_model=args.d_model,
        n_head=4,
        n_kv_head=4,
        ffn_hidden_size=args.ffn,
        n_experts=args.experts,
        experts_per_token=args.top_k,
    )
    torch.manual_seed(0)
    layer = MoE(cfg, 0)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.05)
    return layer


def loop_forward(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The reference: softmax top-k routing, renormalised, then each expert's SwiGLU on the
    tokens routed to it, one expert at a time (N, D) -> (N, D)."""
    probs = F.softmax(F.linear(x, layer.gate.weight).float(), dim=-1)  # (N, E)
    weights, chosen = probs.topk(layer.top_k, dim=-1)  # (N, k)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    e = layer.experts
    for j in range(layer.num_experts):
        token, slot = torch.where(chosen == j)
        h = F.silu(F.linear(x[token], e.gate_proj[j])) * F.linear(x[token], e.up_proj[j])
        y = F.linear(h, e.down_proj[j]) * weights[token, slot, None]
        out = out.index_add(0, token, y)
    return out


def transformers_block(layer: MoE, args):
    """transformers' Qwen3-MoE block holding ``layer``'s weights (gate rows, then up rows,
    in its fused ``gate_up_proj``)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=args.d_model,
        moe_intermediate_size=args.ffn,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    e = layer.experts
    with torch.no_grad():
        block.gate.weight.copy_(layer.gate.weight)
        block.experts.gate_up_proj.copy_(torch.cat([e.gate_proj, e.up_proj], dim=1))
        block.experts.down_proj.copy_(e.down_proj)
    return block


def expert_parallel(layer: MoE, group) -> MoE:
    """A copy of ``layer`` whose experts are this rank's ``E / ep`` of them."""
    split = copy.deepcopy(layer)
    whole = layer.experts
    split.experts = ExpertParallelExperts(whole, group)
    local, rank = split.experts.local, group.rank
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(split.experts, name).copy_(
                getattr(whole, name)[rank * local : (rank + 1) * local]
            )
    return split


def step_fn(forward, x: torch.Tensor):
    """One forward and backward of a layer on ``x`` (the loss: the outputs' sum)."""

    def step():
        x.grad = None
        forward(x).sum().backward()

    return step


def run_rank(rank: int, args) -> dict:
    mesh = Mesh.build(ParallelDims(dp=2, ep=2))
    group = mesh.ep_group
    layer = moe_layer(args)
    split = expert_parallel(layer, group)
    torch.manual_seed(1 + rank)  # each rank routes its own tokens
    x = torch.randn(args.tokens, args.d_model, requires_grad=True)
    with torch.no_grad():
        diff = (split(x[None])[0] - layer(x[None])[0]).abs().max().item()
    variants = {
        "meshwise ep2": step_fn(lambda t: split(t[None])[0], x),
        "meshwise ep1 (experts on every rank)": step_fn(lambda t: layer(t[None])[0], x),
        "per-expert loop (experts on every rank)": step_fn(lambda t: loop_forward(layer, t), x),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    counted: list[float] = []

    def one(name: str, r: int, i: int) -> None:
        before = group.counters.bytes_sent[CATEGORY]
        t0 = time.perf_counter()  # the CPU's clock: the step ends when backward returns
        variants[name]()
        times[name].append(time.perf_counter() - t0)
        if name == "meshwise ep2":
            counted.append(group.counters.bytes_sent[CATEGORY] - before)

    run_rounds(list(variants), 1, 1, one, alternate=False)  # warm-up
    for values in times.values():
        values.clear()
    counted.clear()
    barrier = mesh.dp_cp_group
    run_rounds(
        list(variants), args.rounds, args.steps, one, before_block=lambda n: ops.barrier(barrier)
    )
    return {"times": times, "counted": counted, "diff": diff}


def one_process(args) -> dict:
    """ep 1 in one process: meshwise's layer, the loop, transformers' block."""
    torch.set_num_threads(1)
    layer = moe_layer(args)
    block = transformers_block(layer, args)
    torch.manual_seed(1)
    x = torch.randn(args.tokens, args.d_model, requires_grad=True)
    with torch.no_grad():
        ours = layer(x[None])[0]
        diffs = {
            "per-expert loop": (loop_forward(layer, x) - ours).abs().max().item(),
            "transformers Qwen3MoeSparseMoeBlock": (block(x[None])[0] - ours).abs().max().item(),
        }
    variants = {
        "meshwise ep1": step_fn(lambda t: layer(t[None])[0], x),
        "per-expert loop": step_fn(lambda t: loop_forward(layer, t), x),
        "transformers Qwen3MoeSparseMoeBlock": step_fn(lambda t: block(t[None])[0], x),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}

    def one(name: str, r: int, i: int) -> None:
        t0 = time.perf_counter()
        variants[name]()
        times[name].append(time.perf_counter() - t0)

    run_rounds(list(variants), 1, 1, one, alternate=False)  # warm-up
    for values in times.values():
        values.clear()
    run_rounds(list(variants), args.rounds, args.steps, one)
    return {"times": times, "diffs": diffs}


def main(argv=None) -> None:
    args = parse_args(argv)
    n, k, d = args.tokens, args.top_k, args.d_model
    print(
        f"MoE layer: {n} tokens per rank, d_model {d}, {args.experts} experts of width "
        f"{args.ffn}, top-{k}, fp32, forward + backward; {args.rounds} rounds x {args.steps} steps"
    )
    single = one_process(args)
    summary: dict = {"one_process": {}, "two_ranks": {}}
    base = median(single["times"]["meshwise ep1"])
    print(f"\n{'1 process (ep 1)':<42} step ms   tokens/s   vs meshwise  max |out - meshwise|")
    for name, values in single["times"].items():
        step = median(values)
        diff = single["diffs"].get(name, 0.0)
        print(f"  {name:<40} {1e3 * step:7.1f} {n / step:10,.0f} {base / step:11.2f}x  {diff:.1e}")
        summary["one_process"][name] = {"step_s": step, "tokens_per_s": n / step}
    ranks = spawn(run_rank, 2, args)
    per_rank = {name: [r["times"][name] for r in ranks] for name in ranks[0]["times"]}
    ep2 = median(slowest(per_rank["meshwise ep2"]))
    print(f"\n{'2 gloo ranks (each its own tokens)':<42} step ms   tokens/s   vs ep2")
    for name, values in per_rank.items():
        step = median(slowest(values))
        print(f"  {name:<40} {1e3 * step:7.1f} {2 * n / step:10,.0f} {ep2 / step:7.2f}x")
        summary["two_ranks"][name] = {"step_s": step, "tokens_per_s": 2 * n / step}
    formula = 4 * n * k * d * 4 * (2 - 1) / 2
    for rank, r in enumerate(ranks):
        counted = median(r["counted"])
        print(
            f"  rank {rank}: all-to-all {counted / 2**20:.3f} MiB counted per step, formula "
            f"{formula / 2**20:.3f} MiB (ratio {counted / formula:.3f}); ep2 vs ep1 output "
            f"max diff {r['diff']:.1e}"
        )
        summary["two_ranks"][f"rank{rank}_all_to_all_bytes"] = {
            "counted": counted,
            "formula": formula,
        }
    print_json(summary)


if __name__ == "__main__":
    main()
