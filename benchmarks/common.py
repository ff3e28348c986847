"""What every benchmark script shares: gloo ranks, alternating rounds, medians, the JSON line.

Each script compares meshwise with a PyTorch peer the same way:

- ``spawn`` runs a function on N gloo ranks of this machine, one thread each, and
  returns what each rank returned;
- ``run_rounds`` takes the steps of every variant in rounds, the order reversed
  every other round, so that drift in the machine's speed hits all alike;
- ``slowest`` keeps each step's slowest rank (the step is bounded by it), and
  ``median`` / ``medians`` reduce the steps;
- ``print_json`` prints the summary as the last line.

``timed_step`` times one training step by phase. The GPT benchmarks also share
their flags, their ``GPTConfig``, their AdamW setup and how the model is built,
so that both sides of a comparison start from the same weights and use the same
hyperparameters, weight-decay split and loss:

- ``meshwise_gpt`` lays the GPT out as ``meshwise train`` does (built on the meta
  device, ``parallelize``d, the engine materialising what the rank keeps from
  the layout-independent initial values);
- ``reference_gpt`` is the whole model holding those same values, for the peers;
- ``token_loss_sum`` is the summed token loss computed from its logits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from meshwise.apply.parallelize import ParallelModel, parallelize
from meshwise.cli.launch import free_port
from meshwise.comm import ops
from meshwise.models.gpt import GPT, GPTConfig, gpt_init, gpt_plan
from meshwise.sharding.adamw import AdamWConfig, decays

median = statistics.median


# ---------------------------------------------------------------- ranks
def spawn(
    fn: Callable,
    world_size: int,
    *args,
    timeout_s: float = 300.0,
    ignore_warnings: Sequence[type[Warning]] = (),
) -> list:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks; every rank's return value, by rank.

    Each rank is a fresh process ("spawn": ``fn`` must be defined at module level,
    its arguments and return value picklable) with one thread and the default
    process group initialised before ``fn`` runs. A rank's exception is raised here
    (``torch.multiprocessing.ProcessRaisedException``, with the rank's traceback).
    """
    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(
        _rank_entry,
        args=(fn, world_size, free_port(), queue, timeout_s, tuple(ignore_warnings), args),
        nprocs=world_size,
        start_method="spawn",
        join=False,
    )
    results, done = {}, False
    while not done:
        done = procs.join(timeout=0.1)
        # Drain while ranks run: a result larger than the pipe's buffer blocks its put.
        while not queue.empty():
            rank, value = queue.get()
            results[rank] = value
    return [results[rank] for rank in range(world_size)]


def _rank_entry(
    rank: int,
    fn: Callable,
    world_size: int,
    port: int,
    queue,
    timeout_s: float,
    ignore_warnings: tuple,
    args: tuple,
) -> None:
    for category in ignore_warnings:
        warnings.filterwarnings("ignore", category=category)
    torch.set_num_threads(1)  # one core per rank; more would oversubscribe the machine
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )  # as torchrun sets them
    ops.init_process_group("gloo", timeout_s=timeout_s)
    queue.put((rank, fn(rank, *args)))
    ops.destroy_process_group()


# ---------------------------------------------------------------- timing
def run_rounds(
    names: Sequence[str],
    num_rounds: int,
    steps_per_round: int,
    step: Callable[[str, int, int], None],
    *,
    alternate: bool = True,
    before_block: Callable[[str], None] | None = None,
) -> None:
    """``step(name, round, i)`` for ``i < steps_per_round``, every variant, every round.

    With ``alternate`` the order of the variants is reversed every other round, so
    that drift in the machine's speed hits all alike (warm-ups pass ``False``).
    ``before_block(name)`` runs before each variant's steps in a round, e.g. a
    barrier so that the ranks start them together.
    """
    names = list(names)
    for r in range(num_rounds):
        for name in names[::-1] if alternate and r % 2 else names:
            if before_block is not None:
                before_block(name)
            for i in range(steps_per_round):
                step(name, r, i)


def timed_step(
    zero_grad: Callable,
    forward_backward: Callable,
    finish_sync: Callable | None,
    optimizer_step: Callable,
) -> tuple[object, dict[str, float]]:
    """One training step timed by phase; ``forward_backward()`` returns the loss.

    ``finish_sync`` waits for the gradient communication that backward did not hide
    (meshwise ``finish_grad_sync``: the exposed communication); torch's wrappers sync
    inside backward, so theirs is ``None`` and their ``sync`` time 0.
    """
    start = time.perf_counter()
    zero_grad()
    loss = forward_backward()
    sync_start = optim_start = time.perf_counter()
    if finish_sync is not None:
        finish_sync()
        optim_start = time.perf_counter()
    optimizer_step()
    end = time.perf_counter()
    return loss, {
        "step": end - start,
        "fwd_bwd": sync_start - start,
        "sync": optim_start - sync_start,
        "optim": end - optim_start,
    }


def new_timings(names: Iterable[str], keys: Iterable[str]) -> dict[str, dict[str, list]]:
    keys = list(keys)
    return {name: {key: [] for key in keys} for name in names}


def record(timings: dict[str, list], times: dict[str, float]) -> None:
    """Append one step's ``times`` (seconds by key) to a variant's ``timings``."""
    for key, value in times.items():
        timings[key].append(value)


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each step's time on the slowest rank (``per_rank[r][i]``: step i on rank r)."""
    return [max(values) for values in zip(*per_rank)]


def slowest_timings(per_rank: Sequence[dict[str, list]]) -> dict[str, list[float]]:
    """``slowest`` for every key of one variant's per-rank timings."""
    return {key: slowest([t[key] for t in per_rank]) for key in per_rank[0]}


def medians(timings: dict[str, dict[str, list]]) -> dict[str, dict[str, float]]:
    """Median of every list in ``{variant: {key: [seconds, ...]}}``."""
    return {name: {key: median(v) for key, v in t.items()} for name, t in timings.items()}


def quartiles(values: Sequence[float]) -> list[float]:
    """q1, median, q3 (a single value three times)."""
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------- setup and output
def add_round_args(p: argparse.ArgumentParser, *, warmup: int, rounds: int, steps: int) -> None:
    p.add_argument(
        "--warmup", type=int, default=warmup, help=f"untimed steps each (default {warmup})"
    )
    p.add_argument(
        "--rounds", type=int, default=rounds, help=f"alternating rounds (default {rounds})"
    )
    p.add_argument(
        "--steps", type=int, default=steps, help=f"timed steps per round (default {steps})"
    )


def add_gpt_args(
    p: argparse.ArgumentParser,
    *,
    n_layer: int,
    n_head: int,
    d_model: int,
    batch_size: int,
    lr: float,
    seq_len: int = 128,
) -> None:
    p.add_argument("--n-layer", type=int, default=n_layer, help=f"GPT blocks (default {n_layer})")
    p.add_argument("--n-head", type=int, default=n_head, help=f"attention heads (default {n_head})")
    p.add_argument("--d-model", type=int, default=d_model, help=f"model width (default {d_model})")
    p.add_argument(
        "--seq-len", type=int, default=seq_len, help=f"tokens per sequence (default {seq_len})"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        help=f"global sequences per step (default {batch_size})",
    )
    lr_text = f"{lr:.0e}".replace("e-0", "e-")  # 1e-4, not 0.0001
    p.add_argument("--lr", type=float, default=lr, help=f"AdamW learning rate (default {lr_text})")


def gpt_config(args, vocab_size: int = 256) -> GPTConfig:
    return GPTConfig(
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        block_size=args.seq_len,
        vocab_size=vocab_size,
    )


def meshwise_gpt(cfg: GPTConfig, seed: int = 0, **layout) -> tuple[ParallelModel, Callable]:
    """This rank's ``ParallelModel`` of the GPT, on the meta device, and the values
    function an engine fills it from (``values=``): the trainer's path.

    ``layout``: ``parallelize``'s ``tp_group``, ``pp_rank``, ``pp_size``,
    ``virtual_stages``. Pass the chunks to ``ZeroOptimizer(modules=...)`` (their
    meta parameters are replaced by ones in the buckets) or the chunk to
    ``ZeroStage3``.
    """
    with torch.device("meta"):
        model = GPT(cfg)
    pm = parallelize(model, gpt_plan(cfg), **layout)
    return pm, pm.init_values(lambda name: gpt_init(cfg, name), seed)


def reference_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The whole GPT in this process with ``meshwise_gpt``'s initial values."""
    return GPT(cfg).init_weights(seed)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies of logits (B, T, V) against targets (B, T), in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def adamw_config(args) -> AdamWConfig:
    return AdamWConfig(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def torch_param_groups(named_parameters: Iterable, cfg: AdamWConfig) -> list[dict]:
    """The same weight-decay split as meshwise (``decays``: matrices only)."""
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]


def print_json(summary: dict) -> None:
    """The last line every script prints: one JSON object."""
    print(json.dumps(summary), flush=True)
