"""ZeroOptimizer stages 0-2 on 2 and 3 gloo ranks against single-process torch AdamW."""

import contextlib
import math

import pytest
import torch
from torch import nn

from meshwise.comm import ops
from meshwise.sharding.adamw import AdamWConfig, decays
from meshwise.sharding.buckets import ZeroOptimizer
from tests.dist.test_data_parallel import BATCH, Net, batch, loss_of

CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 3  # _uses_extra relies on a step 3
MICRO_STEPS = 2
CLIP = 0.05  # small enough that clipping is active


def lr_of(step: int) -> float:
    return CFG.lr * (1 + step) / 2  # changes every step, as a schedule does


def in_fc(name: str) -> bool:
    return name.startswith("fc")


def clip_scale(sq_norm: float) -> float:
    return min(1.0, CLIP / (math.sqrt(sq_norm) + 1e-6))


def torch_adamw(named):
    """torch's AdamW with meshwise's weight-decay split (matrices only)."""
    return torch.optim.AdamW(
        [{"params": [p for n, p in named if decays(n, p)], "weight_decay": CFG.weight_decay},
         {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}],
        lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, foreach=False)


def reference_run():
    model = Net(with_unused=False).double()
    named = list(model.named_parameters())
    opt = torch_adamw(named)
    norms = []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        x, y = batch(step)
        loss_of(model(x), y).backward()
        sq = sum(float(p.grad.square().sum()) for _, p in named)
        partial = sum(float(p.grad.square().sum()) for n, p in named if in_fc(n))
        norms.append((sq, partial))
        for _, p in named:
            p.grad.mul_(clip_scale(sq))
        for group in opt.param_groups:
            group["lr"] = lr_of(step)
        opt.step()
    return {n: p.detach().clone() for n, p in named}, norms


def _zero_run(stage: int, cap_mb: float):
    group = ops.world_group()
    model = Net(with_unused=False).double()
    opt = ZeroOptimizer(model.named_parameters(), group, stage, CFG, bucket_cap_mb=cap_mb,
                        modules=[model])  # the parameter all-gather waits in forward
    per_rank = BATCH // group.size
    rows = slice(group.rank * per_rank, (group.rank + 1) * per_rank)
    norms, full_grads_between_micro_steps = [], False
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        x, y = batch(step)
        chunks = list(zip(x[rows].chunk(MICRO_STEPS), y[rows].chunk(MICRO_STEPS)))
        for i, (xm, ym) in enumerate(chunks):
            sync = opt.no_sync() if i < len(chunks) - 1 else contextlib.nullcontext()
            with sync:
                loss_of(model(xm), ym).backward()
            if i < len(chunks) - 1:
                full_grads_between_micro_steps |= any(p.grad is not None
                                                      for p in model.parameters())
        opt.finish_grad_sync()
        sq = float(opt.grad_sq_norm())
        norms.append((sq, float(opt.grad_sq_norm(include=in_fc))))
        opt.step(lr_of(step), clip_scale(sq))
    opt.wait_params()  # the last all-gather overlaps nothing: wait before reading
    # Stage 2 keeps only the shard, between steps and between micro-steps.
    grads_dropped = (all(p.grad is None for p in model.parameters())
                     and not full_grads_between_micro_steps)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms, grads_dropped


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("cap_mb", [300 / 2**20, 25.0])
def test_zero_matches_torch_adamw(dist_pools, world, stage, cap_mb):
    ref_params, ref_norms = reference_run()
    assert any(clip_scale(sq) < 1 for sq, _ in ref_norms)
    results = dist_pools.run(world, _zero_run, stage, cap_mb)
    for rank, (params, norms, grads_dropped) in enumerate(results):
        assert grads_dropped == (stage == 2)
        for (sq, partial), (ref_sq, ref_partial) in zip(norms, ref_norms):
            assert sq == pytest.approx(ref_sq, rel=1e-10)
            assert partial == pytest.approx(ref_partial, rel=1e-10)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-9, atol=1e-12,
                                       msg=f"rank {rank}: {name}")
            assert torch.equal(params[name], results[0][0][name])  # replicas agree exactly


class Wide(nn.Module):
    """About 1.6M fp32 parameters, so bucket padding is negligible."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256),
                                    nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(),
                                    nn.Linear(1024, 256), nn.Linear(256, 768))

    def forward(self, x):
        return self.layers(x)


def _state_bytes(stage: int):
    group = ops.world_group()
    model = Wide()
    opt = ZeroOptimizer(model.named_parameters(), group, stage, CFG)
    x = torch.randn(4, 256)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.finish_grad_sync()
        opt.step(1e-3)
    return opt.state_bytes(), sum(p.numel() for p in model.parameters())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_state_bytes_match_the_formula(dist_pools, world):
    formula = {0: lambda psi: 16 * psi, 1: lambda psi: 8 * psi + 8 * psi / world,
               2: lambda psi: 4 * psi + 12 * psi / world}
    measured = []
    for stage in (0, 1, 2):
        results = dist_pools.run(world, _state_bytes, stage)
        for nbytes, psi in results:
            assert nbytes == pytest.approx(formula[stage](psi), rel=0.05)
        measured.append(max(nbytes for nbytes, _ in results))
    assert measured[0] > measured[1] > measured[2]


def _uses_extra(step: int, rank: int) -> bool:
    """``extra``: used everywhere at step 1, by rank 0 only at step 2, by nobody after."""
    return step == 1 or (step == 2 and rank == 0)


def _reference_with_unused(world: int):
    """torch's AdamW skips what has no .grad: ``unused`` always, ``extra`` from step 3."""
    model = Net(with_unused=True).double()
    opt = torch_adamw(list(model.named_parameters()))
    per_rank = BATCH // world
    for step in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        x, y = batch(step)
        for rank in range(world):
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
            loss_of(model(x[rows], use_extra=_uses_extra(step, rank)), y[rows]).backward()
        for group in opt.param_groups:
            group["lr"] = lr_of(step)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unused_run(stage: int):
    from meshwise.sharding.zero3 import ZeroStage3

    group = ops.world_group()
    model = Net(with_unused=True).double()
    engine = (ZeroStage3(model, group, CFG) if stage == 3 else
              ZeroOptimizer(model.named_parameters(), group, stage, CFG))
    per_rank = BATCH // group.size
    rows = slice(group.rank * per_rank, (group.rank + 1) * per_rank)
    for step in range(1, STEPS + 1):
        engine.zero_grad()
        x, y = batch(step)
        loss_of(model(x[rows], use_extra=_uses_extra(step, group.rank)), y[rows]).backward()
        engine.finish_grad_sync()
        engine.step(lr_of(step))
    if stage == 3:
        return engine.full_state_dict()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_without_gradient_is_not_updated(dist_pools, stage):
    """No weight decay and no stale momentum for a parameter no rank gave a gradient."""
    reference = _reference_with_unused(2)
    for params in dist_pools.run(2, _unused_run, stage):
        assert torch.equal(params["unused"], Net(with_unused=True).double().unused)
        for name, ref in reference.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-9, atol=1e-12, msg=name)
