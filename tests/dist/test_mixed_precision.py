"""bf16 compute with fp32 master weights: what is kept in which dtype, and why it matters."""

import pytest
import torch
from torch import nn

from meshwise.comm import ops
from meshwise.sharding.adamw import AdamWConfig
from meshwise.sharding.buckets import ZeroOptimizer
from meshwise.sharding.flat import Precision
from meshwise.sharding.zero3 import ZeroStage3

BF16 = Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# Adam's first steps move a weight by about lr: far below bf16's spacing near 1.0
# (2**-7), so only an fp32 master copy can accumulate them.
LR = 1e-4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        with torch.no_grad():
            for block in self.blocks:
                block.weight.fill_(1.0)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _train(stage: int, steps: int):
    group = ops.world_group()
    model = Net()
    adamw = AdamWConfig(lr=LR, weight_decay=0.0)
    if stage == 3:
        engine = ZeroStage3(model, group, adamw, precision=BF16)
    else:
        engine = ZeroOptimizer(model.named_parameters(), group, stage, adamw, precision=BF16,
                               modules=[model])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(group.rank))
    initial = [flat.master.clone() for flat in engine.flats]
    out_dtypes = set()
    for _ in range(steps):
        engine.zero_grad()
        y = model(x.to(torch.bfloat16))
        out_dtypes.add(y.dtype)
        y.float().square().sum().backward()
        engine.finish_grad_sync()
        engine.step(LR)
    engine.wait_params()
    flat = engine.flats[0]
    kept = {t.dtype for t in (flat.master, flat.exp_avg, flat.exp_avg_sq)}
    grad = flat.grad if stage < 2 else flat.grad_shard
    compute = flat.params.dtype if flat.params is not None else None
    moved = max(float((f.master - start).abs().max()) for f, start in zip(engine.flats, initial))
    weights_in_bf16 = None if stage == 3 else {float(v) for v in model.blocks[0].weight.flatten()}
    return {"kept": kept, "grad": grad.dtype, "compute": compute, "out": out_dtypes,
            "moved": moved, "weights_in_bf16": weights_in_bf16}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_computes_and_the_fp32_master_keeps_small_updates(dist_pools, stage):
    for res in dist_pools.run(2, _train, stage, 3):
        assert res["kept"] == {torch.float32} and res["grad"] == torch.float32
        assert res["out"] == {torch.bfloat16}
        assert res["compute"] == (None if stage == 3 else torch.bfloat16)
        # Three steps of about lr each: kept in the fp32 master, lost in bf16 (the
        # weights the model computes with are still exactly their initial 1.0).
        assert 1e-4 < res["moved"] < 2**-8, res["moved"]
        assert res["weights_in_bf16"] in (None, {1.0})


def _gathered_bytes(precision):
    group = ops.world_group()
    model = Net()
    engine = ZeroStage3(model, group, AdamWConfig(), precision=precision)
    model(torch.ones(2, 8, dtype=precision.param_dtype))
    return group.counters.bytes_sent["param"]


@pytest.mark.timeout(60)
def test_zero3_gathers_bf16_half_the_bytes(dist_pools):
    fp32 = dist_pools.run(2, _gathered_bytes, Precision())[0]
    bf16 = dist_pools.run(2, _gathered_bytes, BF16)[0]
    assert bf16 == fp32 / 2
