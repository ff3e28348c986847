import torch

from meshwise.comm import ops
from meshwise.mesh import Mesh, ParallelDims


def _mesh_and_collectives(dp, tp, pp):
    mesh = Mesh.build(ParallelDims(dp=dp, tp=tp, pp=pp))
    out = {}
    for axis in ("dp", "pp", "tp"):
        group = getattr(mesh, f"{axis}_group")
        t = torch.tensor([float(mesh.rank)])
        ops.all_reduce(t, group)
        out[axis] = t.item()
    g = torch.zeros(mesh.world_group.size)
    ops.all_gather(g, torch.tensor([float(mesh.rank)]), mesh.world_group)
    out["gather"] = g.tolist()
    rs = torch.zeros(1)
    ops.reduce_scatter(rs, torch.arange(mesh.world_group.size, dtype=torch.float32), mesh.world_group)
    out["scatter"] = rs.item()
    out["coords"] = (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank)
    return out


def test_axis_groups_reduce_over_their_axis(dist_pools):
    dims = ParallelDims(dp=2, tp=2, pp=1)
    results = dist_pools.run(4, _mesh_and_collectives, 2, 2, 1)
    for rank, res in enumerate(results):
        for axis in ("dp", "pp", "tp"):
            group = next(g for g in dims.axis_groups(axis) if rank in g)
            assert res[axis] == sum(group)
        assert res["gather"] == [0.0, 1.0, 2.0, 3.0]
        assert res["scatter"] == 4.0 * rank
        assert res["coords"] == tuple(dims.coords(rank)[a] for a in ("dp", "pp", "tp"))


def _one_rank_stays_away(timeout_s: float):
    import time

    import torch

    from meshwise.comm import ops

    mesh = Mesh.build(ParallelDims(dp=2), timeout_s=timeout_s)
    if mesh.rank == 1:
        return None  # never joins the all-reduce below
    start = time.monotonic()
    try:
        ops.all_reduce(torch.ones(4), mesh.dp_group, category="grad")
    except ops.CollectiveTimeout as exc:
        return str(exc), time.monotonic() - start
    return "no timeout", time.monotonic() - start


def test_subgroups_time_out_as_asked_and_say_where(dist_pools):
    message, waited = dist_pools.run(2, _one_rank_stays_away, 2.0, agree=False)[0]
    assert waited < 15, waited  # gloo's default would be 30 minutes
    assert "all_reduce on group dp (ranks [0, 1]) after 2s timed out" in message, message
