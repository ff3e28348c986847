import pytest

from meshwise.mesh import AXES, ParallelDims


def factorisations(n):
    for dp in range(1, n + 1):
        for tp in range(1, n + 1):
            for pp in range(1, n + 1):
                if dp * tp * pp == n:
                    yield dp, tp, pp


@pytest.mark.parametrize("world_size", range(1, 9))
def test_every_factorisation_partitions_the_world(world_size):
    for dp, tp, pp in factorisations(world_size):
        dims = ParallelDims(dp=dp, tp=tp, pp=pp)
        assert dims.world_size == world_size
        seen = set()
        for rank in range(world_size):
            c = dims.coords(rank)
            assert dims.rank_of(c["dp"], c["pp"], c["tp"]) == rank
            seen.add((c["dp"], c["pp"], c["tp"]))
        assert len(seen) == world_size
        sizes = {"dp": dp, "pp": pp, "tp": tp}
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


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_invalid_sizes_name_the_value(bad):
    with pytest.raises(ValueError, match="dp must be a positive integer"):
        ParallelDims(dp=bad)


def test_unknown_axis():
    with pytest.raises(ValueError, match="valid: dp, pp, tp"):
        ParallelDims().axis_groups("ep")
