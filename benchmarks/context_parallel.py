"""Context parallel step time: meshwise's ring attention beside an all-gather of K/V.

Every variant trains the same Llama (``--model llama-small`` by default) from the
same initial values on the same global batches at ``--cp 2``, on gloo ranks of
this machine (one thread each), as ``meshwise train --cp 2`` builds it (its
flags parsed by meshwise's own parser into a ``TrainConfig``, then ``Trainer``
and ``train_step`` inside the rank):

* ``meshwise_ring``: ``meshwise train --cp 2``: keys and values passed around
  the ring, blocks merged by log-sum-exp, load-balanced zigzag chunks;
* ``allgather_kv``: the same trainer with every ring attention replaced by
  the formulation of Llama 3 (Meta 2024, section 3.3.2) and of PyTorch's
  context parallel for flex attention (``flex_cp_allgather``): all-gather the
  keys and values of the whole sequence (a reduce of their gradients
  backward), then attend each of the rank's two zigzag chunks of queries to
  the prefix it may see (SDPA with a causal mask aligned to the chunk);
* ``torch_cp2``: PyTorch's own
  ``torch.distributed.tensor.experimental.context_parallel`` on the same plain
  model and batch, one forward; on a CPU it stops before any step (its SDPA
  dispatcher handles only the CUDA flash, efficient and cuDNN kernels, and the
  CPU's ``_scaled_dot_product_flash_attention_for_cpu`` has no DTensor rule), so
  it is reported with that reason and not timed.

Each variant runs as its own job, ``--rounds`` times in alternating order, so
drift in the machine's speed hits all alike; the first ``--warmup`` steps of
every job are left out and each step counts its slower rank. ``loss_rel_diff``
is the largest relative difference between the two variants' losses step by
step (the same exact attention: round-off only). The last line is one JSON
object; ``ratio`` is meshwise's median step time over the baseline's.

    python benchmarks/context_parallel.py [--seq-len 8192 --batch-size 1 --steps 4]

The baseline calls ``torch.distributed`` directly (a benchmark, not the library).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.common import median, print_json, rel_diff, slowest, spawn  # noqa: E402

CP = 2
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------- the all-gather baseline
class _GatherKV(torch.autograd.Function):
    """(B, G, L, d) per rank -> (cp, B, G, L, d) of every rank; backward: the sum of
    every rank's gradient of the whole, this rank's part (all-reduce: gloo's faster
    formulation of a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank = group, rank
        out = x.new_empty(size * x.numel())  # flat: rank order
        _all_gather_flat(out, x.contiguous().view(-1), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class AllGatherAttention(nn.Module):
    """Causal attention of this rank's zigzag query chunks over all-gathered keys."""

    def __init__(self, group, rank: int, size: int):
        super().__init__()
        self.group, self.rank, self.size = group, rank, size

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        every = _GatherKV.apply(x, self.group, self.rank, self.size)  # (cp, B, G, L, d)
        halves = [part.chunk(2, dim=2) for part in every.unbind(0)]
        # chunk j of 2 cp is rank j's first half (j < cp), else rank 2cp-1-j's second
        return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=2)

    def forward(self, q, k, v, causal: bool = True):
        k, v = self._whole(k), self._whole(v)  # (B, G, T, d)
        chunk = q.shape[2] // 2
        outs = []
        for half, index in ((0, self.rank), (1, 2 * self.size - 1 - self.rank)):
            queries = q[:, :, half * chunk : (half + 1) * chunk]
            seen = (index + 1) * chunk  # keys up to the chunk's end
            rows = torch.arange(index * chunk, seen, device=q.device)[:, None]
            mask = torch.arange(seen, device=q.device)[None, :] <= rows  # (chunk, seen)
            outs.append(
                F.scaled_dot_product_attention(
                    queries,
                    k[:, :, :seen],
                    v[:, :, :seen],
                    attn_mask=mask,
                    enable_gqa=k.shape[1] != q.shape[1],
                )
            )
        return torch.cat(outs, dim=2)  # (B, H, L, d)


def use_allgather(trainer) -> int:
    """Replace every ring attention of the trainer's model; how many there were."""
    from meshwise.context_parallel.ring import RingAttention

    group = trainer.mesh.cp_group
    swapped = 0
    for module in list(trainer.model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, RingAttention):
                setattr(module, name, AllGatherAttention(group.pg, group.rank, group.size))
                swapped += 1
    return swapped


# ---------------------------------------------------------------- ranks
def train_config(args):
    from meshwise.cli.main import build_parser
    from meshwise.cli.train import train_config as parse

    flags = [
        "train",
        "--model",
        args.model,
        "--cp",
        str(CP),
        "--seq-len",
        str(args.seq_len),
        "--block-size",
        str(max(args.seq_len, 512)),
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
    if args.data:
        flags += ["--data", args.data]
    return parse(build_parser().parse_args(flags))[0]


def meshwise_worker(rank: int, args, data: str, variant: str) -> dict:
    from meshwise.train.trainer import Trainer

    trainer = Trainer(train_config(args), data)
    if variant == "allgather_kv":
        assert use_allgather(trainer) == trainer.model_cfg.n_layer
    records = [trainer.train_step(step) for step in range(1, args.warmup + args.steps + 1)]
    trainer.comm_stats.close()
    return {
        "times": [r["step_time_s"] for r in records[args.warmup :]],
        "losses": [r["loss"] for r in records],
    }


def torch_cp_worker(rank: int, args, data: str) -> str:
    """One forward of the plain model under PyTorch's context parallel: what happens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from meshwise.data.dataset import TokenDataset
    from meshwise.models.families import family
    from meshwise.train.config import ModelConfig

    sizes = ModelConfig(preset=args.model, block_size=max(args.seq_len, 512)).sizes(256)
    model = family("llama").create(family("llama").make_config(sizes), seed=0)
    batch = TokenDataset(data, args.seq_len).global_batch(1, args.batch_size, 1234)
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    mesh = init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",))
    try:
        with context_parallel(mesh, buffers=[inputs, targets], buffer_seq_dims=[1, 1]):
            logits = model(inputs)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return "ran"


# ---------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-small", help="a llama preset")
    parser.add_argument(
        "--data", default=None, help="as meshwise train --data (default: its corpus, byte-level)"
    )
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1, help="global sequences per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps per job")
    parser.add_argument("--rounds", type=int, default=3, help="jobs per variant, alternating")
    args = parser.parse_args()
    from meshwise.data.dataset import resolve_data

    data = str(resolve_data(args.data, None, None))
    variants = ("meshwise_ring", "allgather_kv")
    times, losses = {v: [] for v in variants}, {}
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            per_rank = spawn(meshwise_worker, CP, args, data, variant, timeout_s=1800)
            times[variant] += slowest([p["times"] for p in per_rank])
            losses[variant] = per_rank[0]["losses"]
            print(
                f"round {r + 1} {variant}: median {median(times[variant]):.3f} s/step",
                file=sys.stderr,
            )
    torch_cp = spawn(torch_cp_worker, CP, args, data)[0]
    summary = {
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "model": args.model,
        "cp": CP,
        "step_time_s": {v: median(t) for v, t in times.items()},
        "steps_timed": {v: len(t) for v, t in times.items()},
        "ratio": median(times["meshwise_ring"]) / median(times["allgather_kv"]),
        "loss_rel_diff": max(
            rel_diff(a, b) for a, b in zip(losses["meshwise_ring"], losses["allgather_kv"])
        ),
        "torch_cp2": torch_cp if torch_cp == "ran" else f"skipped: {torch_cp}",
    }
    for v in variants:
        print(f"{v}: {summary['step_time_s'][v]:.3f} s/step (median of {len(times[v])})")
    print(f"ring / all-gather: {summary['ratio']:.3f}; torch_cp2: {summary['torch_cp2']}")
    print_json(summary)


if __name__ == "__main__":
    main()
