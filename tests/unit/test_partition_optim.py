import pytest
import torch

from meshwise.sharding.adamw import AdamWConfig, SkipGate, adamw_update
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


def test_adamw_matches_torch():
    torch.manual_seed(0)
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.randn(50, dtype=torch.float64, requires_grad=True)
    ours = ref.detach().clone()
    opt = torch.optim.AdamW([ref], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=False)
    m, v = torch.zeros_like(ours), torch.zeros_like(ours)
    for step in range(1, 6):
        grad = torch.randn(50, dtype=torch.float64)
        ref.grad = grad.clone()
        opt.step()
        adamw_update(ours, grad, m, v, step, cfg.lr, cfg)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_gated_step_is_the_plain_one_or_nothing(dtype):
    """Decided on the device: taken, bit for bit the ungated update; skipped, even with
    NaN and infinite gradients, nothing changes (not the moments, not the weights)."""
    torch.manual_seed(0)
    cfg = AdamWConfig(lr=1e-2, weight_decay=0.1)
    start = [torch.randn(64, dtype=dtype) for _ in range(3)]  # param, exp_avg, exp_avg_sq
    start[2] = start[2].abs()
    grad = torch.randn(64, dtype=dtype)
    plain = [t.clone() for t in start]
    adamw_update(*plain[:1], grad, *plain[1:], 3, cfg.lr, cfg)
    taken = [t.clone() for t in start]
    adamw_update(*taken[:1], grad, *taken[1:], 3, cfg.lr, cfg, gate=SkipGate(torch.tensor(False)))
    for a, b in zip(taken, plain):
        assert torch.equal(a, b)
    bad = grad.clone()
    bad[::3], bad[1::3] = float("nan"), float("inf")
    skipped = [t.clone() for t in start]
    adamw_update(*skipped[:1], bad, *skipped[1:], 3, cfg.lr, cfg, gate=SkipGate(torch.tensor(True)))
    for a, b in zip(skipped, start):
        assert torch.equal(a, b)


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 1.0, 10, 100) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1)
