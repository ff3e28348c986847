"""The planner's --dp-shard: which values it tries, the memory and inter-node traffic it
predicts for them (16/N bytes per parameter at ZeRO-3; 1/N of the gradient across
nodes), and the line that says why."""

import pytest

from meshwise.planner.hybrid import cross_replica_bytes, shard_options, why
from meshwise.planner.layout import Layout
from meshwise.planner.request import plan_request
from meshwise.planner.search import Space
from tests.unit.test_planner import SMALL, config


def test_shard_values_tried_are_replicas_inside_a_node_when_dp_crosses_nodes():
    assert shard_options(Layout(dp=16, zero=3), 8) == [1, 2, 4, 8]
    assert shard_options(Layout(dp=8, tp=2, zero=2), 8) == [1, 2, 4]
    assert shard_options(Layout(dp=8, zero=3), 8) == []  # dp inside one node
    assert shard_options(Layout(dp=16, zero=0), 8) == []  # nothing sharded
    assert shard_options(Layout(dp=16, zero=3, ep=2), 8) == []  # not composed yet
    assert shard_options(Layout(dp=16, zero=3), 0) == []  # one node


def test_the_shard_crosses_nodes_not_the_gradient():
    layout = Layout(dp=8, zero=3, dp_shard=2)
    assert (layout.shard_size, layout.replicas) == (2, 4)
    assert cross_replica_bytes(layout, 800.0) == 400.0
    assert cross_replica_bytes(Layout(dp=8, zero=1, dp_shard=2), 800.0) == 800.0
    assert cross_replica_bytes(Layout(dp=8, zero=3), 800.0) == 0.0
    assert "16/N B/param at ZeRO-3 (N = 2, not 8)" in why(layout)
    assert Layout.parse(layout.flags()) == layout


def test_memory_is_16_over_n_and_the_slow_link_favours_hybrid_sharding():
    request = plan_request(config(*SMALL), 8, "h100", Space(), nodes=4)
    full = request.predict(Layout(dp=8, zero=3))
    hybrid = request.predict(Layout(dp=8, zero=3, dp_shard=2))
    assert full.memory.model_state == pytest.approx(16 * full.memory.params / 8)
    assert hybrid.memory.model_state == pytest.approx(16 * hybrid.memory.params / 2)
    assert hybrid.time.dp < full.time.dp  # the gathers stay inside the node


def test_the_plan_searches_dp_shard_and_says_why():
    from meshwise.planner.report import table

    request = plan_request(config(*SMALL), 8, "h100", Space(zero=(3,)), nodes=4)
    results = request.run()
    flags = [p.layout.flags() for p in results]
    assert "--dp 8 --tp 1 --pp 1 --zero 3 --dp-shard 2" in flags
    assert "--dp 8 --tp 1 --pp 1 --zero 3" in flags
    # over the inter-node link the hybrid layout is predicted faster than full ZeRO-3
    hybrid, full = (
        flags.index(f)
        for f in ("--dp 8 --tp 1 --pp 1 --zero 3 --dp-shard 2", "--dp 8 --tp 1 --pp 1 --zero 3")
    )
    assert hybrid < full
    text = table(request, results, 3)
    assert results[0].layout.replicas > 1  # the best, on 4 nodes of 2
    assert "hybrid sharding, --dp-shard 2: ZeRO over N = 2 ranks in a node" in text
