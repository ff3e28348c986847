import pytest
import torch
from torch import nn

from meshwise.mesh import Mesh, ParallelDims
from meshwise.tensor_parallel.layers import mark_tp
from meshwise.train.grad_sync import GradSync3D


def _check_replicas(diverge: bool):
    mesh = Mesh.build(ParallelDims(tp=2))
    replicated = nn.Parameter(torch.ones(4))
    sharded = mark_tp(nn.Parameter(torch.ones(4)), sharded=True, dim=0)
    replicated.grad = torch.ones(4) * (1 + mesh.tp_rank if diverge else 1)
    sharded.grad = torch.full((4,), float(mesh.tp_rank))  # shards may differ
    sync = GradSync3D([("ln.weight", replicated), ("fc.weight", sharded)], mesh, engine=None)
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
