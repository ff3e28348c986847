import types

import pytest
import torch
from torch import nn

from meshwise.geometry.params import mark_tp
from meshwise.mesh import Mesh, ParallelDims
from meshwise.train.grad_sync import GradSync3D


def _check_replicas(diverge: bool):
    mesh = Mesh.build(ParallelDims(tp=2))
    replicated = nn.Parameter(torch.ones(4))
    sharded = mark_tp(nn.Parameter(torch.ones(4)), sharded=True, dim=0)
    replicated.grad = torch.ones(4) * (1 + mesh.tp_rank if diverge else 1)
    sharded.grad = torch.full((4,), float(mesh.tp_rank))  # shards may differ
    named = {"ln.weight": replicated, "fc.weight": sharded}
    engine = types.SimpleNamespace(stage=0, grad_of=lambda name: named[name].grad)
    sync = GradSync3D(list(named.items()), mesh, engine)
    try:
        sync.check_tp_replicas()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_tp_replica_check_names_diverging_parameters(dist_pools):
    assert dist_pools.run(2, _check_replicas, False) == [None, None]
    for message in dist_pools.run(2, _check_replicas, True):
        assert "differ across tp ranks: ln.weight" in message


def _check_replica_values(stage: int, diverge: bool):
    from meshwise.sharding.adamw import AdamWConfig
    from meshwise.sharding.buckets import ZeroOptimizer
    from meshwise.sharding.zero3 import ZeroStage3

    mesh = Mesh.build(ParallelDims(dp=2, tp=2))
    torch.manual_seed(0)  # replicas start equal
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8))
    mark_tp(model[0].weight, sharded=True, dim=0)  # a shard: may differ across tp
    with torch.no_grad():
        model[0].weight.fill_(float(mesh.tp_rank))
        model[1].weight.fill_(1.0 + (0.5 * mesh.tp_rank if diverge else 0.0))
    named = list(model.named_parameters())
    engine = (ZeroStage3(model, mesh.dp_group, AdamWConfig()) if stage == 3 else
              ZeroOptimizer(named, mesh.dp_group, stage, AdamWConfig()))
    sync = GradSync3D(named, mesh, engine)
    try:
        sync.check_replica_values()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_replica_values_are_compared_under_every_stage(dist_pools, stage):
    assert dist_pools.run(4, _check_replica_values, stage, False) == [None] * 4
    messages = dist_pools.run(4, _check_replica_values, stage, True)
    assert all("values of tp-replicated parameters differ across tp ranks: 1.weight" in m
               for m in messages), messages
