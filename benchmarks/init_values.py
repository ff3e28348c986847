"""Seconds to draw one rank's initial values of llama-1b, as ``meshwise train`` does.

The model is built on the meta device and laid out as ``meshwise.train.build``
lays it out (tensor parallelism through a stand-in group: only its rank and size
are read); every parameter this rank keeps is then filled from
``ParallelModel.init_values`` into one flat buffer, as the ZeRO engines fill
theirs: whole parameters at ZeRO 0-2, or with ``--shards N`` one rank's equal
share of the flattened parameters (ZeRO-3: ranges that cut parameters and
blocks). Time the whole from outside too:

    /usr/bin/time -f "%e s" python benchmarks/init_values.py
    python benchmarks/init_values.py --tp 8 --tp-rank 7 --shards 8 --shard 3
"""

from __future__ import annotations

import argparse
import resource
import time
import types
from functools import partial

import torch

from meshwise.apply.parallelize import parallelize
from meshwise.geometry.init import on_meta
from meshwise.models.families import family
from meshwise.train.model_config import ModelConfig


def laid_out(vocab: int, tp: int, tp_rank: int):
    fam = family("llama")
    cfg = fam.make_config({**ModelConfig(preset="llama-1b").sizes(vocab), "dropout": 0.0})
    with on_meta():
        model = fam.build(cfg)
    group = types.SimpleNamespace(rank=tp_rank, size=tp) if tp > 1 else None
    pm = parallelize(model, fam.plan(cfg), tp_group=group, vocab_size=vocab, check_forward=False)
    return pm, partial(fam.init, cfg)


def fill(pm, init_of, seed: int, shards: int, shard: int, dtype: torch.dtype) -> int:
    """Fill this rank's share of the flattened parameters; the elements filled."""
    named = pm.named_parameters()
    total = sum(p.numel() for _, p in named)
    per = -(-total // shards)
    lo, hi = shard * per, min(total, (shard + 1) * per)
    buffer = torch.empty(max(0, hi - lo), dtype=dtype)
    values = pm.init_values(init_of, seed)
    offset = 0
    for name, param in named:
        a, b = max(lo, offset), min(hi, offset + param.numel())
        if a < b:
            buffer[a - lo : b - lo].copy_(values(name, a - offset, b - offset))
        offset += param.numel()
    return buffer.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="ZeRO-3 ranks over dp")
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    start = time.perf_counter()
    pm, init_of = laid_out(args.vocab, args.tp, args.tp_rank)
    built = time.perf_counter()
    cpu = time.process_time()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    numel = fill(pm, init_of, args.seed, args.shards, args.shard, dtype)
    done = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"llama-1b (vocab {args.vocab}) tp {args.tp} rank {args.tp_rank}, shard "
        f"{args.shard} of {args.shards}: {numel / 1e6:,.1f}M values in "
        f"{done - built:.1f} s ({time.process_time() - cpu:.1f} s of CPU, "
        f"{torch.get_num_threads()} threads); model built in {built - start:.1f} s; "
        f"peak RSS {peak:.2f} GiB"
    )


if __name__ == "__main__":
    main()
