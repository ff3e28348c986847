"""Pipeline x ZeRO-2/3 on dp 2 x pp 2 gloo ranks against one process, in float64.

Every rank builds the whole stack (an input layer, LayerNorm + Linear blocks, a
head) from one seed and runs its chunks under a schedule, its dp slice of each
micro-batch, with a ZeRO-2 ``ZeroOptimizer`` (gradients reduce-scattered once per
step) or a ``PipelineZeroStage3`` (units gathered once per step, or per
micro-batch with ``reshard_after_forward``, or kept from each forward to its
backward with ``reshard="after-backward"``). After three AdamW steps every
parameter must equal the stack trained in one process by ``torch.optim.AdamW``.
The blocks mix a norm (its gradient comes in B) with linear layers (theirs, under
a split backward, in W), so a unit's gradient arrives in two parts.
"""

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
from meshwise.comm import ops
from meshwise.mesh import Mesh, ParallelDims
from meshwise.pipeline.runtime import PipelineRuntime
from meshwise.pipeline.schedules import build_schedule
from meshwise.sharding.adamw import AdamWConfig, decays
from meshwise.sharding.buckets import ZeroOptimizer
from meshwise.sharding.flat import Precision
from meshwise.sharding.zero3 import PipelineZeroStage3, ZeroStage3

DT = torch.float64
CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
D_IN, D, NUM_CLASSES, T = 5, 8, 7, 3
ROWS = 4  # sequences per micro-batch, over dp
STEPS = 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D, dtype=DT)
        self.fc = nn.Linear(D, D, dtype=DT)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


def _stages(num_logical: int, checkpointing) -> list[nn.Sequential]:
    torch.manual_seed(0)
    stages = []
    for s in range(num_logical):
        blocks = [Block(), Block()]
        if checkpointing:  # True: "full"
            apply_activation_checkpointing(blocks, "full" if checkpointing is True
                                           else checkpointing)
        layers = ([("inp", nn.Linear(D_IN, D, dtype=DT))] if s == 0 else []) + \
            [(f"block{2 * s + i}", block) for i, block in enumerate(blocks)]
        if s == num_logical - 1:
            layers.append(("head", nn.Linear(D, NUM_CLASSES, dtype=DT)))
        stages.append(nn.Sequential(OrderedDict(layers)))  # names unique over the stack
    return stages


def _loss(logits, targets):  # the SUM of token losses
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def _batch(step: int, num_micro_batches: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(num_micro_batches * ROWS, T, D_IN, generator=g, dtype=DT)
    y = torch.randint(0, NUM_CLASSES, (num_micro_batches * ROWS, T), generator=g)
    return list(zip(x.chunk(num_micro_batches), y.chunk(num_micro_batches)))


def _reference(stages, num_micro_batches: int) -> dict[tuple[int, str], torch.Tensor]:
    params = [p for stage in stages for p in stage.parameters()]
    named = [(n, p) for stage in stages for n, p in stage.named_parameters()]
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": CFG.weight_decay},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, foreach=False)
    scale = 1.0 / (num_micro_batches * ROWS * T)
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in _batch(step, num_micro_batches):
            for stage in stages:
                x = stage(x)
            (_loss(x, y) * scale).backward()
        opt.step()
    assert all(p.grad is not None for p in params)
    return {(s, n): p.detach() for s, stage in enumerate(stages)
            for n, p in stage.named_parameters()}


def _engine(kind: str, chunks, mesh: Mesh, reshard: bool):
    precision = Precision.of(DT)
    if kind == "zero2":
        named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
        return ZeroOptimizer(named, mesh.dp_group, 2, CFG, bucket_cap_mb=300 / 2**20,
                             precision=precision, modules=chunks, reduce_once=True)
    units = [[m for m in chunk if next(m.parameters(), None) is not None] for chunk in chunks]
    if isinstance(reshard, str):  # a policy by name
        return ZeroStage3(chunks, mesh.dp_group, CFG, units, reshard=reshard, precision=precision)
    return PipelineZeroStage3(chunks, mesh.dp_group, CFG, units, reshard_after_forward=reshard,
                              precision=precision)


def _full_params(engine, chunks, group) -> dict[str, torch.Tensor]:
    """ZeRO-2: the chunks' parameters once published; ZeRO-3: the shards gathered."""
    if isinstance(engine, ZeroOptimizer):
        engine.wait_params()
        return {n: p.detach() for chunk in chunks for n, p in chunk.named_parameters()}
    out = {}
    for flat in engine.flats:
        full = torch.empty(flat.plan.padded_numel, dtype=flat.master.dtype)
        ops.all_gather(full, flat.master, group, category="param")
        out.update({s.name: full[s.offset:s.offset + s.numel].view(s.shape) for s in flat.slots})
    return out


def _train_and_compare(engine_kind, schedule_kind, num_virtual, num_micro_batches,
                       reshard=False, checkpointing=False):
    mesh = Mesh.build(ParallelDims(dp=2, pp=2))
    schedule = build_schedule(schedule_kind, 2, num_micro_batches, num_virtual)
    stages = _stages(2 * num_virtual, checkpointing)
    mine = [schedule.stage_of(mesh.pp_rank, v) for v in range(num_virtual)]
    chunks = [stages[s] for s in mine]
    engine = _engine(engine_kind, chunks, mesh, reshard)
    runtime = PipelineRuntime(chunks, schedule, mesh.pp_group, engine, loss_fn=_loss)
    rows = slice(mesh.dp_rank * ROWS // 2, (mesh.dp_rank + 1) * ROWS // 2)
    scale = 1.0 / (num_micro_batches * ROWS * T)
    for step in range(STEPS):
        engine.zero_grad()
        runtime.run([(x[rows], y[rows]) for x, y in _batch(step, num_micro_batches)], scale)
        engine.finish_grad_sync()
        engine.step(CFG.lr)
    expected = _reference(_stages(2 * num_virtual, False), num_micro_batches)
    got = _full_params(engine, chunks, mesh.dp_group)
    worst = 0.0
    for s in mine:
        for name, _ in _stages(2 * num_virtual, False)[s].named_parameters():
            worst = max(worst, (got[name] - expected[(s, name)]).abs().max().item())
    freed = engine_kind == "zero2" or all(u.gathered_bytes() == 0 for u in engine.units)
    return worst, freed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine_kind, schedule_kind, num_virtual, num_micro_batches, reshard, "
                         "checkpointing", [
                             ("zero2", "1f1b", 1, 4, False, False),
                             ("zero2", "zbv", 2, 4, False, False),
                             ("zero3", "1f1b", 1, 4, False, False),
                             ("zero3", "zb-h1", 1, 4, True, False),
                             ("zero3", "zbv", 2, 4, False, True),
                             ("zero3", "dualpipev", 2, 4, True, True),
                             ("zero3", "interleaved-1f1b", 2, 4, False, "selective"),
                             ("zero3", "zbv", 2, 4, "after-backward", "selective"),
                             ("zero3", "zb-h1", 1, 4, "after-backward", False),
                         ])
def test_pipeline_zero_matches_one_process(dist_pools, engine_kind, schedule_kind, num_virtual,
                                           num_micro_batches, reshard, checkpointing):
    results = dist_pools.run(4, _train_and_compare, engine_kind, schedule_kind, num_virtual,
                             num_micro_batches, reshard, checkpointing)
    for worst, freed in results:
        assert worst < 1e-10
        assert freed
