"""Model-state bytes of meshwise ZeRO stages 0-3 against the ZeRO formula.

Run through ``python benchmarks/zero.py --memory-table``: for each world size N,
N gloo ranks take one step of each stage on the GPT ``small`` preset, then count
``engine.state_bytes()`` (the largest rank's is kept) beside fp32 AdamW's 16,
8 + 8/N, 4 + 12/N and 16/N bytes per parameter (Rajbhandari et al. 2019, ZeRO,
section 5, K = 12).
"""

from __future__ import annotations

import gc

import torch

from benchmarks.common import meshwise_gpt, spawn, timed_step
from meshwise.comm import ops
from meshwise.data.dataset import rank_slice
from meshwise.models.gpt import GPTConfig
from meshwise.sharding.adamw import AdamWConfig
from meshwise.sharding.buckets import ZeroOptimizer
from meshwise.sharding.zero3 import ZeroStage3

SMALL_PRESET = GPTConfig(n_layer=6, n_head=6, d_model=384, block_size=512, vocab_size=256)


def zero_formula_bytes(stage: int, num_params: int, world_size: int) -> float:
    """Model-state bytes per rank for fp32 AdamW (ZeRO paper, section 5, K = 12)."""
    psi, n = num_params, world_size
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[
        stage
    ]


def _stage_bytes(
    stage: int, group, cfg: AdamWConfig, local: torch.Tensor, global_tokens: int
) -> tuple[int, int, int]:
    """One step of ``stage`` on a fresh model: (state bytes, peak gathered bytes,
    parameter count); the model and engine are freed when this returns."""
    pm, values = meshwise_gpt(SMALL_PRESET)
    (model,) = pm.chunks
    num_params = sum(p.numel() for _, p in pm.named_parameters())
    engine = (
        ZeroStage3(model, group, cfg, units=pm.layers(), values=values)
        if stage == 3
        else ZeroOptimizer(
            pm.named_parameters(), group, stage=stage, adamw=cfg, modules=pm.chunks, values=values
        )
    )

    def forward_backward():
        loss = pm.loss(model(local[:, :-1]), local[:, 1:]) / global_tokens
        loss.backward()
        return loss

    timed_step(
        engine.zero_grad, forward_backward, engine.finish_grad_sync, lambda: engine.step(cfg.lr)
    )
    engine.wait_params()
    return engine.state_bytes(), getattr(engine, "peak_gathered_bytes", 0), num_params


def memory_rank_main(rank: int, world_size: int) -> dict:
    """One step of each stage on the ``small`` preset, built as ``meshwise train``
    builds it (meta device, the engine materialising its share); this rank's bytes."""
    group = ops.world_group()
    cfg = AdamWConfig(lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (world_size, 17), generator=gen)  # (N, T + 1)
    local = rank_slice(batch, rank, world_size)
    global_tokens = batch[:, 1:].numel()
    out = {}
    for stage in range(4):
        state_bytes, peak_gathered, num_params = _stage_bytes(
            stage, group, cfg, local, global_tokens
        )
        out[stage] = (state_bytes, peak_gathered)
        gc.collect()  # the previous stage's model and engine, before the next is built
    return {"bytes": out, "num_params": num_params}


def memory_table(world_sizes: list[int]) -> dict:
    rows = []
    for world_size in world_sizes:
        per_rank = spawn(memory_rank_main, world_size, world_size, ignore_warnings=[Warning])
        n = per_rank[0]["num_params"]
        for stage in range(4):
            measured = max(r["bytes"][stage][0] for r in per_rank)
            formula = zero_formula_bytes(stage, n, world_size)
            rows.append(
                {
                    "world_size": world_size,
                    "stage": stage,
                    "num_params": n,
                    "measured_bytes": measured,
                    "formula_bytes": formula,
                    "rel_diff": measured / formula - 1,
                    "peak_gathered_bytes": max(r["bytes"][stage][1] for r in per_rank),
                }
            )
    print(
        f"model_state_bytes per rank, GPT small preset ({rows[0]['num_params'] / 1e6:.2f}M "
        f"params), fp32 AdamW; formula 16, 8+8/N, 4+12/N, 16/N bytes per parameter"
    )
    print(
        f"{'N':>3}{'stage':>7}{'measured MiB':>14}{'formula MiB':>13}{'rel diff':>10}"
        f"{'gathered peak MiB':>19}"
    )
    for r in rows:
        peak = f"{r['peak_gathered_bytes'] / 2**20:19.2f}" if r["stage"] == 3 else f"{'-':>19}"
        print(
            f"{r['world_size']:3d}{r['stage']:7d}{r['measured_bytes'] / 2**20:14.2f}"
            f"{r['formula_bytes'] / 2**20:13.2f}{r['rel_diff']:10.2%}{peak}"
        )
    return {"memory_table": rows, "max_abs_rel_diff": max(abs(r["rel_diff"]) for r in rows)}
