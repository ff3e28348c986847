"""Checkpoint save and load: meshwise against torch.distributed.checkpoint + FSDP2.

Both sides hold the same GPT after one AdamW step on 2 gloo ranks and write a
full training checkpoint (parameters and both AdamW moments) to local disk:

- meshwise: ``meshwise.checkpoint.state.save`` of the engine (ZeRO 0 or 3):
  per-rank safetensors files, a manifest with SHA-256 of every file, an atomic
  rename; load fills a fresh engine;
- torch: ``fully_shard`` on every block and the root (FSDP2), then
  ``torch.distributed.checkpoint.save`` / ``load`` of
  ``get_state_dict`` / ``set_state_dict`` (model and optimizer).

Times are the slowest rank's, barrier to barrier, median of ``--repeats``;
bytes are what the checkpoint directory holds on disk. The last line holds the
ratios (meshwise / torch; below 1 is faster or smaller).

    python benchmarks/checkpoint.py                 # small and medium presets
    python benchmarks/checkpoint.py --presets small --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

# Runnable from a checkout without installing (spawned ranks re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    median,
    meshwise_gpt,
    print_json,
    reference_gpt,
    spawn,
    token_loss_sum,
    torch_param_groups,
)
from meshwise.checkpoint.state import load, save  # noqa: E402
from meshwise.checkpoint.store import Checkpoint  # noqa: E402
from meshwise.comm import ops  # noqa: E402
from meshwise.models.gpt import GPTConfig  # noqa: E402
from meshwise.sharding.adamw import AdamWConfig  # noqa: E402
from meshwise.sharding.buckets import ZeroOptimizer  # noqa: E402
from meshwise.sharding.zero3 import ZeroStage3  # noqa: E402

PRESETS = {
    "small": GPTConfig(n_layer=6, n_head=6, d_model=384, block_size=128),
    "medium": GPTConfig(n_layer=12, n_head=12, d_model=768, block_size=128),
}
ADAMW = AdamWConfig(lr=1e-4)


def _batch(rank: int, world: int, cfg: GPTConfig):
    tokens = torch.randint(
        0, cfg.vocab_size, (2 * world, 33), generator=torch.Generator().manual_seed(0)
    )  # (B, T + 1)
    local = tokens.chunk(world)[rank]
    return local[:, :-1], local[:, 1:], tokens[:, 1:].numel()


def _timed(group, fn) -> float:
    ops.barrier(group)
    start = time.perf_counter()
    fn()
    ops.barrier(group)
    return time.perf_counter() - start


def _meshwise_engine(cfg: GPTConfig, zero: int, group):
    """The GPT as ``meshwise train`` builds it, its engine and each parameter's piece."""
    pm, values = meshwise_gpt(cfg)
    (model,) = pm.chunks
    named = pm.named_parameters()  # before the engine takes them
    pieces = pm.pieces(named)
    engine = (
        ZeroStage3(model, group, ADAMW, units=pm.layers(), values=values)
        if zero == 3
        else ZeroOptimizer(named, group, zero, ADAMW, modules=pm.chunks, values=values)
    )
    return pm, engine, pieces


def meshwise_rank(rank: int, preset: str, zero: int, root: str, repeats: int) -> dict:
    group, cfg = ops.world_group(), PRESETS[preset]
    pm, engine, pieces = _meshwise_engine(cfg, zero, group)
    x, y, tokens = _batch(rank, group.size, cfg)
    engine.zero_grad()
    (pm.loss(pm.chunks[0](x), y) / tokens).backward()
    engine.finish_grad_sync()
    engine.step(ADAMW.lr)
    _, fresh, _ = _meshwise_engine(cfg, zero, group)
    saves, loads = [], []
    for i in range(repeats):
        # Each lambda runs at once, inside _timed; the defaults bind this round's values.
        saves.append(
            _timed(
                group,
                lambda step=i + 1: save(
                    root, step, engine.checkpoint_runs(), pieces, set(pieces), group, {"step": step}
                ),
            )
        )
        ckpt = Checkpoint(Path(root) / f"step-{i + 1:08d}")
        loads.append(
            _timed(
                group,
                lambda ckpt=ckpt: load(
                    ckpt, fresh.checkpoint_runs(), pieces, rank, same_layout=False
                ),
            )
        )
    return {"save_s": saves, "load_s": loads}


def torch_rank(rank: int, preset: str, root: str, repeats: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    group, cfg = ops.world_group(), PRESETS[preset]

    def build():
        model = reference_gpt(cfg)
        for block in model.blocks.values():
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(
            torch_param_groups(model.named_parameters(), ADAMW),
            lr=ADAMW.lr,
            betas=ADAMW.betas,
            eps=ADAMW.eps,
        )
        return model, opt

    model, opt = build()
    x, y, tokens = _batch(rank, group.size, cfg)
    (token_loss_sum(model(x), y) / tokens).backward()
    opt.step()
    fresh_model, fresh_opt = build()
    # AdamW state exists before it is loaded into
    (token_loss_sum(fresh_model(x), y) / tokens).backward()
    fresh_opt.step()
    saves, loads = [], []
    for i in range(repeats):
        path = os.path.join(root, f"dcp-{i}")

        # Both run at once, inside _timed; the defaults bind this round's path.
        def save_dcp(path=path):
            m, o = get_state_dict(model, opt)
            dcp.save({"model": m, "optim": o}, checkpoint_id=path)

        def load_dcp(path=path):
            m, o = get_state_dict(fresh_model, fresh_opt)
            state = {"model": m, "optim": o}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                fresh_model,
                fresh_opt,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )

        saves.append(_timed(group, save_dcp))
        loads.append(_timed(group, load_dcp))
    return {"save_s": saves, "load_s": loads}


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _summary(results: list[dict], path: Path, repeats: int) -> dict:
    save_s = [max(r["save_s"][i] for r in results) for i in range(repeats)]
    load_s = [max(r["load_s"][i] for r in results) for i in range(repeats)]
    return {
        "save_s": median(save_s),
        "load_s": median(load_s),
        "bytes": _disk_bytes(path) // repeats,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["small", "medium"])
    p.add_argument("--repeats", type=int, default=3, help="saves and loads each (default 3)")
    args = p.parse_args()
    summary = {}
    for preset in args.presets:
        row = {}
        for name, fn, extra in (
            ("meshwise_zero0", meshwise_rank, (0,)),
            ("meshwise_zero3", meshwise_rank, (3,)),
            ("torch_dcp_fsdp2", torch_rank, ()),
        ):
            root = Path(tempfile.mkdtemp(prefix=f"ckpt-{name}-"))
            try:
                results = spawn(fn, 2, preset, *extra, str(root), args.repeats)
                row[name] = _summary(results, root, args.repeats)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(preset, name, row[name], flush=True)
        peer = row["torch_dcp_fsdp2"]
        for stage in ("zero0", "zero3"):
            ours = row[f"meshwise_{stage}"]
            for key in ("save_s", "load_s", "bytes"):
                summary[f"{preset}_{stage}_{key}_ratio"] = round(ours[key] / peer[key], 3)
    print_json(summary)


if __name__ == "__main__":
    main()
