"""Data-parallel buckets (ZeRO stage 0) on 2 gloo ranks against single-process
full-batch gradients (float64)."""

import contextlib
import warnings

import pytest
import torch
from torch import nn

from meshwise.comm import ops
from meshwise.sharding.adamw import AdamWConfig
from meshwise.sharding.buckets import ZeroOptimizer

WORLD = 2
BATCH = 12  # global rows; each rank takes a contiguous slice


def buckets_of(model, group, cap_mb):
    """Stage 0: gradient buckets all-reduced over dp, nothing sharded."""
    return ZeroOptimizer(model.named_parameters(), group, stage=0, adamw=AdamWConfig(),
                         bucket_cap_mb=cap_mb, modules=[model])


class Net(nn.Module):
    """Linear layers, a LayerNorm, a layer some ranks skip and a parameter nobody uses."""

    def __init__(self, with_unused: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        if with_unused:
            self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x, use_extra: bool = True):
        h = torch.tanh(self.norm(self.fc1(x)))
        h = torch.tanh(self.fc2(h))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def batch(step: int = 0):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(BATCH, 3, generator=gen, dtype=torch.float64)
    return x, y


def loss_of(out, y):
    # Sum over rows / global count: the gradient of the global mean whatever the split.
    return ((out - y) ** 2).sum() / (BATCH * 3)


def reference_grads(world: int, extra_on_rank0_only: bool, step: int = 0) -> dict:
    model = Net().double()
    x, y = batch(step)
    per_rank = BATCH // world
    for rank in range(world):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        use_extra = rank == 0 or not extra_on_rank0_only
        loss_of(model(x[rows], use_extra), y[rows]).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
            for n, p in model.named_parameters()}


def _dp_grads(cap_mb: float, micro_steps: int, extra_on_rank0_only: bool,
              drop_grad: str | None = None):
    group = ops.world_group()
    model = Net().double()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    buckets = buckets_of(model, group, cap_mb)
    values_kept = all(torch.equal(p, initial[n]) for n, p in model.named_parameters())
    per_rank = BATCH // group.size
    rows = slice(group.rank * per_rank, (group.rank + 1) * per_rank)
    use_extra = group.rank == 0 or not extra_on_rank0_only
    grads, messages = [], []
    for step in range(2):  # the second step checks zero_grad
        buckets.zero_grad()
        if drop_grad:  # robustness: someone replaced .grad between steps
            dict(model.named_parameters())[drop_grad].grad = None
        x, y = batch(step)
        chunks = list(zip(x[rows].chunk(micro_steps), y[rows].chunk(micro_steps)))
        for i, (xm, ym) in enumerate(chunks):
            sync = buckets.no_sync() if i < len(chunks) - 1 else contextlib.nullcontext()
            with sync:
                loss_of(model(xm, use_extra), ym).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            buckets.finish_grad_sync()
        messages += [str(w.message) for w in caught]
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    in_buckets = all(
        p.grad.untyped_storage().data_ptr() ==
        buckets.flats[buckets.plan.slots[n].bucket].grad.untyped_storage().data_ptr()
        for n, p in model.named_parameters())
    return {"grads": grads, "values_kept": values_kept, "in_buckets": in_buckets,
            "messages": messages, "num_buckets": len(buckets.plan.buckets),
            "padded_numels": [b.padded_numel for b in buckets.plan.buckets],
            "grad_bytes": group.counters.bytes_sent["grad"],
            "grad_calls": group.counters.calls["grad"]}


def _check(results, micro_steps=1, extra_on_rank0_only=False):
    for step in range(2):
        expected = reference_grads(WORLD, extra_on_rank0_only, step)
        for res in results:
            assert res["values_kept"] and res["in_buckets"]
            for name, grad in expected.items():
                torch.testing.assert_close(res["grads"][step][name], grad, rtol=1e-10, atol=1e-12,
                                           msg=f"{name} at step {step}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cap_mb", [1e-6, 600 / 2**20, 25.0])
def test_grads_match_full_batch(dist_pools, cap_mb):
    results = dist_pools.run(WORLD, _dp_grads, cap_mb, 1, False)
    _check(results)
    if cap_mb == 1e-6:
        assert results[0]["num_buckets"] == len(list(Net().parameters()))
    if cap_mb == 25.0:  # one bucket per (dtype, device)
        assert results[0]["num_buckets"] == 1
    else:
        assert results[0]["num_buckets"] > 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cap_mb", [600 / 2**20, 25.0])
def test_accumulation_under_no_sync_matches_full_batch(dist_pools, cap_mb):
    _check(dist_pools.run(WORLD, _dp_grads, cap_mb, 2, False))


@pytest.mark.timeout(60)
def test_parameter_without_gradient_does_not_hang(dist_pools):
    # Rank 1 never uses `extra`: rank 0 launches its bucket during backward, rank 1
    # in finish_grad_sync; nobody uses `unused`, whose gradient stays zero.
    results = dist_pools.run(WORLD, _dp_grads, 600 / 2**20, 2, True)
    _check(results, extra_on_rank0_only=True)
    assert len(results[0]["messages"]) == 1  # warned once, not every step
    assert "unused" in results[0]["messages"][0] and "extra" not in results[0]["messages"][0]
    assert "extra.weight" in results[1]["messages"][0]


@pytest.mark.timeout(60)
def test_replaced_grad_is_copied_back_into_the_bucket(dist_pools):
    _check(dist_pools.run(WORLD, _dp_grads, 600 / 2**20, 2, False, "fc2.weight"))


@pytest.mark.timeout(60)
def test_grad_bytes_follow_the_ring_cost(dist_pools):
    res = dist_pools.run(WORLD, _dp_grads, 600 / 2**20, 1, False)[0]
    per_sync = sum(2 * (WORLD - 1) / WORLD * n * 8 for n in res["padded_numels"])
    assert res["grad_bytes"] == pytest.approx(2 * per_sync)
    assert res["grad_calls"] == 2 * res["num_buckets"]


def _raises_assertion(fn) -> bool:
    try:
        fn()
    except AssertionError:
        return True
    return False


def _nested_no_sync(buckets):
    with buckets.no_sync(), buckets.no_sync():
        pass


def _backward_in_no_sync(buckets, model, x, y):
    with buckets.no_sync():
        loss_of(model(x), y).backward()


def _misuse():
    group = ops.world_group()
    model = Net(with_unused=False).double()
    buckets = buckets_of(model, group, 1e-6)
    x, y = batch()
    caught = [_raises_assertion(buckets.finish_grad_sync),  # no backward yet
              _raises_assertion(lambda: _nested_no_sync(buckets))]
    loss_of(model(x), y).backward()
    # Local accumulation into a bucket whose reduction is in flight.
    caught.append(_raises_assertion(lambda: _backward_in_no_sync(buckets, model, x, y)))
    caught.append(_raises_assertion(buckets.zero_grad))  # sync in progress
    buckets.finish_grad_sync()
    caught.append(_raises_assertion(buckets.finish_grad_sync))  # twice without a backward
    return caught


@pytest.mark.timeout(60)
def test_misuse_is_caught(dist_pools):
    for caught in dist_pools.run(WORLD, _misuse):
        assert caught == [True] * 5


def _launched_during_backward():
    group = ops.world_group()
    model = Net(with_unused=False).double()
    buckets = buckets_of(model, group, 600 / 2**20)
    x, y = batch()
    loss_of(model(x), y).backward()
    launched = buckets._next_launch
    buckets.finish_grad_sync()
    return launched, len(buckets.plan.buckets)


@pytest.mark.timeout(60)
def test_every_bucket_launches_during_backward(dist_pools):
    for launched, num_buckets in dist_pools.run(WORLD, _launched_during_backward):
        assert num_buckets > 1 and launched == num_buckets
