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
    whole = ParallelDims(dp=4)
    assert whole.shard_size == 4 and whole.num_replicas == 1
    assert ParallelDims(dp=8, dp_shard=2).num_replicas == 4


def _cfg(**parallel):
    cfg = TrainConfig()
    cfg.model.preset, cfg.data.batch_size, cfg.data.seq_len = "tiny", 8, 16
    rpn = parallel.pop("ranks_per_node", 0)
    cfg.comm.ranks_per_node = rpn
    for key, value in parallel.items():
        setattr(cfg.comm if key in ("compress", "allreduce") else cfg.parallel, key, value)
    return cfg


@pytest.mark.parametrize(
    "parallel, message",
    [
        (dict(dp=4, dp_shard=3), "--dp-shard 3 does not divide dp = 4 .* valid: 1, 2, 4"),
        (dict(dp=4, dp_shard=2, ranks_per_node=1), "across nodes .* valid: --dp-shard 1"),
        (dict(dp=4, tp=2, dp_shard=2, ranks_per_node=2), "replica of 4 ranks .* --dp-shard 1$"),
        (dict(dp=4, dp_shard=2, compress="fp16"), "--compress fp16 is not supported yet"),
    ],
)
def test_bad_dp_shard_is_refused_in_one_line(parallel, message):
    with pytest.raises(ValueError, match=message) as caught:
        check_layout(_cfg(**parallel))
    assert "\n" not in str(caught.value)


def test_a_replica_filling_a_node_is_accepted():
    check_layout(_cfg(dp=4, tp=2, dp_shard=2, ranks_per_node=4))
    check_layout(_cfg(dp=4, dp_shard=4, ranks_per_node=2))  # all of dp: today's ZeRO
