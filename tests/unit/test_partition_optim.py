import itertools

import pytest
import torch

from meshwise.sharding.adamw import AdamWConfig, adamw_update
from meshwise.sharding.plans import ShardPlan
from meshwise.train.lr_schedule import lr_at


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 8, 100, 1023, 4097])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 5, 8])
def test_shard_plan_is_balanced_and_covers_everything(numel, num_shards):
    plan = ShardPlan(numel, num_shards)
    assert plan.padded_numel % num_shards == 0
    assert 0 <= plan.padding < num_shards
    covered = []
    for rank in range(num_shards):
        start, end = plan.shard_range(rank)
        assert end - start == plan.shard_numel
        lo, hi = plan.owned_range(rank)
        assert lo <= hi and hi - lo == max(0, min(end, numel) - start)
        covered.extend(range(lo, hi))
    assert covered == list(range(numel))


def test_shard_plan_rejects_bad_values():
    with pytest.raises(ValueError, match="num_shards"):
        ShardPlan(10, 0)
    with pytest.raises(ValueError, match="rank 3"):
        ShardPlan(10, 3).shard_range(3)


def _torch_adamw(params, cfg, weight_decay):
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=weight_decay, foreach=False
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch_across_steps(dtype, weight_decay):
    """Runs of a flat buffer (odd sizes, at odd offsets) take torch.optim.AdamW's steps,
    bias correction included, to round-off; the learning rate and clipping scale
    change every step (a number, then a 0-dim tensor on the device)."""
    torch.manual_seed(0)
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    cuts = [0, 3, 40, 41, 1000, 1037]
    flat = torch.randn(cuts[-1], dtype=dtype)
    refs = [flat[a:b].clone().requires_grad_() for a, b in itertools.pairwise(cuts)]
    opt = _torch_adamw(refs, cfg, weight_decay)
    m, v, grad = torch.zeros_like(flat), torch.zeros_like(flat), torch.empty_like(flat)
    runs = [(flat[a:b], grad[a:b], m[a:b], v[a:b]) for a, b in itertools.pairwise(cuts)]
    for step in range(1, 7):
        lr, scale = cfg.lr * step / 3, 1.0 / step
        grad.copy_(torch.randn_like(flat))
        for ref, (_, g, _, _) in zip(refs, runs):
            ref.grad = g * scale
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        if step % 2:
            scale = torch.tensor(scale, dtype=torch.float64)
        adamw_update(*(list(t) for t in zip(*runs)), step, lr, cfg, grad_scale=scale)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(flat, torch.cat([r.detach() for r in refs]), rtol=tol, atol=tol)
    state = [opt.state[r] for r in refs]
    torch.testing.assert_close(m, torch.cat([s["exp_avg"] for s in state]), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_gated_step_is_the_plain_one_or_nothing(dtype):
    """Decided on the device: taken, bit for bit the ungated update; skipped, even with
    NaN and infinite gradients, nothing changes (not the moments, not the weights),
    and the next step is the one that would have come."""
    torch.manual_seed(0)
    cfg = AdamWConfig(lr=1e-2, weight_decay=0.1)
    start = [torch.randn(64, dtype=dtype) for _ in range(3)]  # param, exp_avg, exp_avg_sq
    start[2] = start[2].abs()
    grad = torch.randn(64, dtype=dtype)

    def update(state, g, skip=None):
        adamw_update(
            [state[0]],
            [g.clone()],
            [state[1]],
            [state[2]],
            3,
            cfg.lr,
            cfg,
            grad_scale=0.5,
            skip=skip,
        )

    plain = [t.clone() for t in start]
    update(plain, grad)
    taken = [t.clone() for t in start]
    update(taken, grad, torch.tensor(False))
    for a, b in zip(taken, plain):
        assert torch.equal(a, b)
    bad = grad.clone()
    bad[::3], bad[1::3] = float("nan"), float("inf")
    skipped = [t.clone() for t in start]
    update(skipped, bad, torch.tensor(True))
    for a, b in zip(skipped, start):
        assert torch.equal(a, b)
    update(skipped, grad)
    for a, b in zip(skipped, plain):
        assert torch.equal(a, b)


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 1.0, 10, 100) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1)
