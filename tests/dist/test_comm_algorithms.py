"""Our all-reduce algorithms and compressors on gloo groups of 2, 3, 4 and 5 ranks.

One pool of 5 ranks serves every group size (subgroups of its first k ranks),
so the whole file costs one pool start.
"""

import pytest
import torch

from meshwise.comm import ops
from meshwise.comm.allreduce.algorithms import Topology
from meshwise.comm.allreduce.allreducer import AllReducer
from meshwise.comm.allreduce.reducer import GradReducer
from meshwise.comm.compression.compressors import build_compressor

WORLD = 5
SIZES = (1, 4, 7, 100, 1001)  # fewer elements than ranks, uneven chunks, larger
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int32)
_GROUPS: dict = {}


def _group(k: int):
    """This rank's subgroup of the first ``k`` ranks (None outside it); made once per worker."""
    if not _GROUPS:
        counters = ops.CommCounters()
        for size in range(2, WORLD + 1):
            _GROUPS[size] = ops.new_group(list(range(size)), f"first{size}", counters, 60)
    return _GROUPS[k]


def _data(rank: int, numel: int, dtype, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + numel + salt)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=gen).to(dtype)


def _expected(k: int, numel: int, dtype) -> torch.Tensor:
    return sum(_data(r, numel, torch.float64 if dtype.is_floating_point else dtype)
               for r in range(k))


def _topologies(k: int):
    yield "flat", None
    for per_node in (2, 3):
        topo = Topology.of(range(k), per_node)
        if topo.is_hierarchical():
            yield f"{per_node} per node", topo


def _check_algorithms(k: int):
    group = _group(k)
    if group is None:
        return None
    failures = []
    for name, topo in _topologies(k):
        for algorithm in ("ring", "tree", "hierarchical", "adaptive"):
            if algorithm == "hierarchical" and topo is None:
                continue
            reducer = AllReducer(group, algorithm, topo, category="test")
            for dtype in DTYPES:
                for numel in SIZES:
                    t = _data(group.rank, numel, dtype)
                    reducer.all_reduce(t)
                    want = _expected(k, numel, dtype)
                    tol = {torch.bfloat16: 0.1, torch.float32: 1e-5}.get(dtype, 1e-12)
                    if not torch.allclose(t.to(want.dtype), want, atol=tol * k, rtol=tol):
                        failures.append((name, algorithm, str(dtype), numel))
    return failures


def _check_scatter_gather(k: int, algorithm: str):
    group = _group(k)
    if group is None:
        return None
    topo = Topology.of(range(k), 2) if algorithm == "hierarchical" else None
    reducer = AllReducer(group, algorithm, topo, category="test")
    flat = _data(group.rank, 10 * k, torch.float64)
    lo, hi = reducer.reduce_scatter(flat)
    assert (lo, hi) == (10 * group.rank, 10 * (group.rank + 1))
    torch.testing.assert_close(flat[lo:hi], _expected(k, 10 * k, torch.float64)[lo:hi])
    out = torch.empty(3 * k, dtype=torch.int32)
    reducer.all_gather(out, torch.full((3,), group.rank, dtype=torch.int32))
    assert out.tolist() == [r for r in range(k) for _ in range(3)]
    sends = [torch.full((2,), 10 * group.rank + j) for j in range(k)]
    recvs = [torch.empty(2, dtype=sends[0].dtype) for _ in range(k)]
    reducer.all_to_all(sends, recvs)
    assert [r.tolist() for r in recvs] == [[10 * i + group.rank] * 2 for i in range(k)]
    return dict(reducer.calls)


def _native_reference(k: int, numel: int):
    group = _group(k)
    if group is None:
        return None
    t = _data(group.rank, numel, torch.float32)
    ops.all_reduce(t, group, category="test")
    mine = _data(group.rank, numel, torch.float32)
    AllReducer(group, "ring", category="test").all_reduce(mine)
    return (t - mine).abs().max().item()


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_algorithms_sum_like_all_reduce(dist_pools, k):
    results = dist_pools.run(WORLD, _check_algorithms, k)
    assert all(r == [] for r in results[:k]), results[:k]


@pytest.mark.parametrize("k", [2, 3, 5])
def test_ring_matches_native_all_reduce(dist_pools, k):
    diffs = dist_pools.run(WORLD, _native_reference, k, 4097)
    assert max(diffs[:k]) < 1e-5


@pytest.mark.parametrize("k,algorithm", [(2, "ring"), (3, "native"), (5, "ring"),
                                         (5, "hierarchical"), (4, "tree")])
def test_reduce_scatter_all_gather_all_to_all(dist_pools, k, algorithm):
    calls = dist_pools.run(WORLD, _check_scatter_gather, k, algorithm)
    assert calls[0]["p2p"] == 1


def _hierarchical_refuses_flat(k: int):
    group = _group(k)
    if group is None:
        return None
    for topo in (Topology.of(range(k), k), Topology.of(range(k), 1)):
        try:
            AllReducer(group, "hierarchical", topo)
        except ValueError as exc:
            assert "cannot serve" in str(exc)
        else:
            raise AssertionError("hierarchical accepted a one-level topology")
    return True


def test_hierarchical_refuses_a_one_level_group(dist_pools):
    assert dist_pools.run(WORLD, _hierarchical_refuses_flat, 3)[:3] == [True] * 3


# ------------------------------------------------------------------ compressors
LAYOUT = [(0, (40, 30)), (1200, (30,)), (1230, (20, 20))]
NUMEL = 1680  # a multiple of 2, 3, 4, 5 (buckets are padded to the dp size)


def _compress(k: int, spec: str, algorithm: str, scatter: bool, steps: int = 3):
    """Per step: the decompressed result, this rank's input; at the end its held errors."""
    group = _group(k)
    if group is None:
        return None
    compressor = build_compressor(spec, warmup_steps=1, topk_ramp_steps=0)
    reducer = GradReducer(group, compressor, algorithm, overlap=True)
    reducer.set_layouts({"b": LAYOUT})
    outs, ins = [], []
    for step in range(steps):
        g = _data(group.rank, NUMEL, torch.float32, salt=step)
        flat = g.clone()
        size = NUMEL // k
        shard = (group.rank * size, (group.rank + 1) * size) if scatter else None
        reducer.start("b", flat, shard).wait()
        compressor.end_step()
        outs.append(flat[shard[0]:shard[1]] if scatter else flat)
        ins.append(g)
    held = torch.zeros(NUMEL)
    if "b" in compressor.errors:
        held += compressor.errors["b"]
    owner = getattr(compressor, "owner_errors", {}).get("b")
    if owner is not None:
        size = NUMEL // k
        held[group.rank * size:(group.rank + 1) * size] += owner
    reducer.close()
    return outs, ins, held, reducer.sent_bytes, reducer.raw_bytes


SPECS = ["fp16", "bf16", "int8", "topk:0.05", "powersgd:2"]


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("spec", SPECS)
def test_compressed_all_reduce_is_identical_everywhere_and_loses_nothing(dist_pools, k, spec):
    results = dist_pools.run(WORLD, _compress, k, spec, "ring", False)[:k]
    for step in range(3):
        for outs, *_ in results[1:]:
            assert torch.equal(outs[step], results[0][0][step]), "ranks disagree"
    total_in = sum(sum(ins) for _, ins, _, _, _ in results)
    total_out = sum(results[0][0])
    held = sum(h for _, _, h, _, _ in results)
    tol = 0.05 * k if spec in ("fp16", "bf16") else 1e-3  # casts carry no error feedback
    torch.testing.assert_close(total_out + held, total_in, atol=tol, rtol=0)
    sent, raw = results[0][3], results[0][4]
    ratio = raw / sent
    expect = {"fp16": 2, "bf16": 2, "int8": 3.9}
    if spec in expect:
        assert ratio > expect[spec] * 0.97, ratio


@pytest.mark.parametrize("k,algorithm", [(2, "native"), (3, "ring"), (4, "tree")])
@pytest.mark.parametrize("spec", SPECS)
def test_compressed_reduce_scatter_owner_gets_its_chunk(dist_pools, k, algorithm, spec):
    results = dist_pools.run(WORLD, _compress, k, spec, algorithm, True)[:k]
    size = NUMEL // k
    total_in = sum(sum(ins) for _, ins, _, _, _ in results)
    held = sum(h for _, _, h, _, _ in results)
    tol = 0.05 * k if spec in ("fp16", "bf16") else 1e-3
    for rank, (outs, *_rest) in enumerate(results):
        chunk = slice(rank * size, (rank + 1) * size)
        torch.testing.assert_close(sum(outs) + held[chunk], total_in[chunk], atol=tol, rtol=0)


# ------------------------------------------------------------------ the planner's probe
def _drift(k: int):
    from meshwise.planner.probes import rank_drift

    group = _group(k)
    return None if group is None else rank_drift(group, repeats=6)


def test_the_drift_probe_agrees_on_every_rank(dist_pools):
    # what --calibrate stores: one value per group, the slowest rank's, the same everywhere
    drifts = dist_pools.run(WORLD, _drift, 3)[:3]
    assert len(set(drifts)) == 1 and 0 <= drifts[0] < 1.0, drifts
