"""Every engine saves what it holds and loads what another engine saved.

Round trip: train an engine a few steps, save; load that into a fresh engine
of another ZeRO stage, save again; both checkpoints hold the same logical
tensors (parameters and both AdamW moments), bit for bit, and equal to what
the engine holds as full tensors.
"""

import pytest
import torch

from meshwise.checkpoint.state import load, save
from meshwise.checkpoint.store import Checkpoint
from meshwise.comm import ops
from meshwise.geometry.params import logical_piece
from meshwise.sharding.adamw import AdamWConfig
from meshwise.sharding.buckets import ZeroOptimizer
from meshwise.sharding.zero3 import ZeroStage3
from tests.dist.test_data_parallel import BATCH, Net, batch, loss_of

CFG = AdamWConfig(lr=1e-2, weight_decay=0.1)


def _engine(stage: int, group):
    torch.manual_seed(0)
    model = Net(with_unused=False).double()
    named = list(model.named_parameters())
    pieces = {n: logical_piece(n, p, 0, 1) for n, p in named}
    if stage == 3:
        return model, ZeroStage3(model, group, CFG), pieces
    return model, ZeroOptimizer(named, group, stage, CFG, bucket_cap_mb=0.001), pieces


def _train(model, engine, group, steps):
    per_rank = BATCH // group.size
    for step in range(1, steps + 1):
        engine.zero_grad()
        x, y = batch(step)
        rows = slice(group.rank * per_rank, (group.rank + 1) * per_rank)
        loss_of(model(x[rows]), y[rows]).backward()
        engine.finish_grad_sync()
        engine.step(lr=CFG.lr)


def _round_trip(root: str, first: int, second: int):
    group = ops.world_group()
    model, engine, pieces = _engine(first, group)
    _train(model, engine, group, steps=3)
    save(root, 3, engine.checkpoint_runs(), pieces, set(pieces), group, {"step": 3})
    _, fresh, _ = _engine(second, group)
    load(Checkpoint(f"{root}/step-00000003"), fresh.checkpoint_runs(), pieces, group.rank,
         same_layout=False)
    save(root, 4, fresh.checkpoint_runs(), pieces, set(pieces), group, {"step": 4})
    full = engine.full_state_dict() if first == 3 else {
        n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: v.clone() for n, v in full.items()}


@pytest.mark.parametrize("first, second", [(0, 3), (1, 2), (2, 0), (3, 1)])
def test_engines_round_trip_through_each_other(dist_pools, tmp_path, first, second):
    full = dist_pools.run(2, _round_trip, str(tmp_path), first, second)[0]
    a, b = Checkpoint(tmp_path / "step-00000003"), Checkpoint(tmp_path / "step-00000004")
    names = [n for n in a.tensors if not n.startswith("rng.")]
    assert {n.split(".")[0] for n in names} == {"model", "optim"}
    assert len(names) == 3 * len(full)
    for name in names:
        assert torch.equal(a.read(name), b.read(name)), name
    for name, value in full.items():
        assert torch.equal(a.read(f"model.{name}"), value), name
    assert a.read("optim.exp_avg_sq.fc1.weight").abs().sum() > 0
