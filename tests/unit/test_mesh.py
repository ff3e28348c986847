import pytest

from meshwise.mesh import AXES, ParallelDims


def factorisations(n):
    for dp in range(1, n + 1):
        for tp in range(1, n + 1):
            for pp in range(1, n + 1):
                for cp in range(1, n + 1):
                    if dp * tp * pp * cp == n:
                        yield dp, tp, pp, cp


@pytest.mark.parametrize("world_size", range(1, 9))
def test_every_factorisation_partitions_the_world(world_size):
    for dp, tp, pp, cp in factorisations(world_size):
        dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp)
        assert dims.world_size == world_size
        seen = set()
        for rank in range(world_size):
            c = dims.coords(rank)
            assert dims.rank_of(c["dp"], c["pp"], c["cp"], c["tp"]) == rank
            seen.add((c["dp"], c["pp"], c["cp"], c["tp"]))
        assert len(seen) == world_size
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        for axis in AXES:
            groups = dims.axis_groups(axis)
            assert len(groups) == world_size // sizes[axis]
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(world_size)), (axis, groups)
            for g in groups:
                assert len(g) == sizes[axis]
                coords = [dims.coords(r) for r in g]
                # Ranks in one group differ only along that axis, in axis order.
                assert [c[axis] for c in coords] == list(range(sizes[axis]))
                for other in AXES:
                    if other != axis:
                        assert len({c[other] for c in coords}) == 1


def test_tp_is_the_fastest_axis():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert dims.axis_groups("tp")[0] == [0, 1]
    assert dims.axis_groups("pp")[0] == [0, 2]
    assert dims.axis_groups("dp")[0] == [0, 4]


def test_cp_sits_between_tp_and_pp():
    """rank = ((dp * pp_size + pp) * cp_size + cp) * tp_size + tp (docs/layouts.md's order)."""
    dims = ParallelDims(dp=2, tp=2, pp=2, cp=2)
    assert dims.axis_groups("tp")[0] == [0, 1]
    assert dims.axis_groups("cp")[0] == [0, 2]
    assert dims.axis_groups("pp")[0] == [0, 4]
    assert dims.axis_groups("dp")[0] == [0, 8]
    assert dims.coords(11) == {"dp": 1, "pp": 0, "cp": 1, "tp": 1}
    # cp 1 keeps the dp x pp x tp numbering rank for rank
    plain, with_cp1 = ParallelDims(dp=2, tp=2, pp=2), ParallelDims(dp=2, tp=2, pp=2, cp=1)
    assert [plain.coords(r) for r in range(8)] == [with_cp1.coords(r) for r in range(8)]


@pytest.mark.parametrize("dp, cp, tp, pp", [(2, 2, 1, 1), (2, 2, 2, 1), (1, 4, 1, 2), (3, 2, 1, 1)])
def test_dp_cp_groups_hold_the_replicas_of_each_parameter_shard(dp, cp, tp, pp):
    """Gradients are summed over the ranks that differ only in dp and cp, dp-major."""
    dims = ParallelDims(dp=dp, cp=cp, tp=tp, pp=pp)
    groups = dims.axes_groups(("dp", "cp"))
    assert len(groups) == tp * pp
    for group in groups:
        coords = [dims.coords(r) for r in group]
        assert [(c["dp"], c["cp"]) for c in coords] == [
            (d, c) for d in range(dp) for c in range(cp)
        ]
        assert len({(c["pp"], c["tp"]) for c in coords}) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_invalid_sizes_name_the_value(bad):
    with pytest.raises(ValueError, match="dp must be a positive integer"):
        ParallelDims(dp=bad)


def test_unknown_axis():
    with pytest.raises(ValueError, match="valid: dp, pp, cp, tp"):
        ParallelDims().axis_groups("ep")
