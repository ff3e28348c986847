"""--dp-shard's groups and the layouts it refuses, without processes."""

import pytest

from meshwise.mesh import ParallelDims
from meshwise.train.config import TrainConfig
from meshwise.train.layout_rules import check_layout


def test_replicas_are_runs_of_consecutive_dp_ranks_and_columns_replicate():
    shard, replicate = ParallelDims(dp=4, dp_shard=2).shard_groups()
    assert shard == [[0, 1], [2, 3]] and replicate == [[0, 2], [1, 3]]
    # with tp 2 a replica is 4 consecutive global ranks; each tp rank has its groups
    shard, replicate = ParallelDims(dp=4, tp=2, dp_shard=2).shard_groups()
    assert shard == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert replicate == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # cp stays inside the shard group: dp-shard splits dp only
    shard, replicate = ParallelDims(dp=4, cp=2, dp_shard=2).shard_groups()
    assert shard == [[0, 1, 2, 3], [4, 5, 6, 7]] and replicate == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # experts: an expert-data-parallel group split as dp is, inside and across replicas
    shard, replicate = ParallelDims(dp=8, dp_shard=4, ep=2).expert_shard_groups()
    assert shard == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert replicate == [[0, 4], [1, 5], [2, 6], [3, 7]]
    shard, replicate = ParallelDims(dp=4, dp_shard=2, ep=2).expert_shard_groups()
    assert shard == [[0], [2], [1], [3]] and replicate == [[0, 2], [1, 3]]
    whole = ParallelDims(dp=4)
    assert whole.shard_size == 4 and whole.num_replicas == 1
    assert ParallelDims(dp=8, dp_shard=2).num_replicas == 4


def _cfg(**parallel):
    cfg = TrainConfig()
    cfg.model.preset, cfg.data.batch_size, cfg.data.seq_len = "tiny", 8, 16
    rpn = parallel.pop("ranks_per_node", 0)
    cfg.comm.ranks_per_node = rpn
    for key, value in parallel.items():
        section = cfg.model if key == "n_experts" else cfg.parallel
        setattr(cfg.comm if key in ("compress", "allreduce") else section, key, value)
    return cfg


@pytest.mark.parametrize(
    "parallel, message",
    [
        (dict(dp=4, dp_shard=3), "--dp-shard 3 does not divide dp = 4 .* valid: 1, 2, 4"),
        (dict(dp=4, dp_shard=2, ranks_per_node=1), "across nodes .* valid: --dp-shard 1"),
        (
            dict(dp=8, dp_shard=2, ep=4, n_experts=4),
            "--ep 4: a replica's 2 dp x cp ranks do not .* valid: --dp-shard 4, 8$",
        ),
        (dict(dp=4, tp=2, dp_shard=2, ranks_per_node=2), "replica of 4 ranks .* --dp-shard 1$"),
        # a replica per node: each replicate group has one rank per node, no two levels
        (
            dict(dp=4, dp_shard=2, allreduce="hierarchical", ranks_per_node=2),
            "hierarchical cannot serve the replicate group of --dp-shard: each rank",
        ),
    ],
)
def test_bad_dp_shard_is_refused_in_one_line(parallel, message):
    with pytest.raises(ValueError, match=message) as caught:
        check_layout(_cfg(**parallel))
    assert "\n" not in str(caught.value)


def test_a_replica_filling_a_node_is_accepted():
    check_layout(_cfg(dp=4, tp=2, dp_shard=2, ranks_per_node=4))
    check_layout(_cfg(dp=4, dp_shard=4, ranks_per_node=2))  # all of dp: today's ZeRO
    # the cross-replica sum through an algorithm and a compressor
    check_layout(_cfg(dp=4, dp_shard=2, allreduce="ring", compress="powersgd:2"))
    check_layout(_cfg(dp=8, dp_shard=1, allreduce="hierarchical", ranks_per_node=2))


def test_powersgd_across_replicas_sees_the_matrices_whole_in_what_crosses():
    """Two 2x4 matrices and a vector of 4 over a replica of 2: shards of 10 elements.
    The first matrix is whole in shard 0, the second is cut by the shards' edge (sent
    as is), the vector is whole in shard 1 at offset 6 of it; at ZeRO-1 the buffer."""
    from types import SimpleNamespace

    import torch

    from meshwise.comm.ops import CommCounters
    from meshwise.sharding.flat import FlatParams, ParamSlot, Precision

    shapes = {"a": (2, 4), "b": (2, 4), "c": (4,)}
    slots, offset = [], 0
    for name, shape in shapes.items():
        numel = int(torch.Size(shape).numel())
        slots.append(ParamSlot(name, torch.Size(shape), offset, numel, True))
        offset += numel

    def layout(stage, rank):
        group = SimpleNamespace(size=2, rank=rank, counters=CommCounters())
        values = lambda name, a, b: torch.zeros(b - a)  # noqa: E731
        return FlatParams(slots, group, stage, Precision(), "cpu", values).replica_layout()

    assert layout(3, 0) == [(0, (2, 4))]
    assert layout(2, 1) == [(6, (4,))]
    assert layout(1, 1) == [(0, (2, 4)), (8, (2, 4)), (16, (4,))]
