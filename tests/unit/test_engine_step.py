"""The engines' optimizer step and gradient buckets in one process (a group of one).

The step is PyTorch's fused AdamW over the flat buffers: one process takes
``torch.optim.AdamW(fused=True)``'s steps bit for bit; a skipped step changes
nothing. Buckets are written by each step's first gradient, never zeroed: what
a parameter got in an earlier step must not leak into a later one. A ZeRO-3
unit of a group of one computes with its shard as it is.
"""

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from meshwise.comm.ops import CommCounters
from meshwise.sharding.adamw import AdamWConfig, decays
from meshwise.sharding.buckets import ZeroOptimizer
from meshwise.sharding.flat import Precision
from meshwise.sharding.zero3 import ZeroStage3

CFG = AdamWConfig(lr=1e-2, weight_decay=0.1)
BF16 = Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _group():
    return SimpleNamespace(size=1, rank=0, counters=CommCounters())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 3)])
        self.side = nn.Linear(5, 3)  # used only where a step asks for it

    def forward(self, x, use_side=True):
        y = self.blocks[1](torch.tanh(self.blocks[0](x)))
        return y + self.side(x) if use_side else y


def _fused_reference(model):
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": CFG.weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, fused=True)


def _engine(model, stage, precision=None, bucket_cap_mb=25.0):
    if stage == 3:
        return ZeroStage3(model, _group(), CFG, precision=precision)
    return ZeroOptimizer(
        model.named_parameters(),
        _group(),
        stage,
        CFG,
        bucket_cap_mb=bucket_cap_mb,
        precision=precision,
        modules=[model],
    )


def _batch(step, dtype=torch.float32):
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(step)).to(dtype)


@pytest.mark.filterwarnings("ignore:parameters got no gradient")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_process_takes_fused_adamws_steps_bit_for_bit(stage):
    """Weight decay on matrices only, bias correction over steps, a learning rate that
    changes every step, a layer unused in the last step (left alone, as torch leaves a
    parameter whose .grad is None; the step count is the engine's, one for all, where
    torch counts per parameter: hence the last)."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    engine, opt = _engine(model, stage), _fused_reference(ref)
    for step in range(1, 5):
        use_side = step != 4
        lr = CFG.lr * step / 2
        engine.zero_grad()
        opt.zero_grad()
        x = _batch(step)
        model(x, use_side).square().sum().backward()
        ref(x, use_side).square().sum().backward()
        engine.finish_grad_sync()
        for group in opt.param_groups:
            group["lr"] = lr
        engine.step(lr)
        opt.step()
    engine.wait_params()
    state = engine.full_state_dict() if stage == 3 else dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(state[name], p), name


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_skipped_step_changes_nothing_and_the_next_is_the_one_due(stage):
    """NaN and infinite gradients with ``skip`` true on the device: parameters and both
    moments stay as they were; after ``unstep()`` the next step is the one a run
    without the bad step takes."""
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    engine, clean = _engine(model, stage), _engine(twin, stage)

    def take(eng, net, step, poison=False):
        eng.zero_grad()
        loss = net(_batch(step)).square().sum()
        (loss * float("nan") if poison else loss).backward()
        eng.finish_grad_sync()
        eng.step(
            CFG.lr, grad_scale=torch.tensor(0.5, dtype=torch.float64), skip=torch.tensor(poison)
        )

    take(engine, model, 1)
    take(clean, twin, 1)
    before = [t.clone() for f in engine.flats for t in (f.master, f.exp_avg, f.exp_avg_sq)]
    take(engine, model, 2, poison=True)
    after = [t for f in engine.flats for t in (f.master, f.exp_avg, f.exp_avg_sq)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    engine.unstep()
    take(engine, model, 3)
    take(clean, twin, 3)
    for a, b in zip(engine.flats, clean.flats):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.filterwarnings("ignore:parameters got no gradient")
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("precision", [None, BF16], ids=["fp32", "bf16"])
def test_buckets_hold_this_steps_gradients_only(stage, precision):
    """Two micro-batches per step, the side layer unused in the second step: each
    step's bucket holds the sum of that step's gradients (fp32 accumulation of bf16
    ones under mixed precision), and zero where a parameter got none, never a value
    left from an earlier step; tiny buckets put the unused layer in buckets of its own."""
    torch.manual_seed(0)
    dtype = torch.float32 if precision is None else torch.bfloat16
    model = Net().to(dtype)
    ref = copy.deepcopy(model)  # the same bf16 gradients, summed here in fp32
    engine = _engine(model, stage, precision, bucket_cap_mb=60 / 2**20)
    for step, use_side in ((1, True), (2, False), (3, True)):
        engine.wait_params()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters()):
                p.copy_(q)
        engine.zero_grad()
        expected = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
        for micro in range(2):
            x = _batch(10 * step + micro, dtype)
            with engine.no_sync() if micro == 0 else contextlib.nullcontext():
                model(x, use_side).float().square().sum().backward()
            ref.zero_grad()
            ref(x, use_side).float().square().sum().backward()
            for name, p in ref.named_parameters():
                if p.grad is not None:
                    expected[name] += p.grad.float()
        engine.finish_grad_sync()
        got = _bucket_grads(engine)
        for name, want in expected.items():
            assert torch.equal(got[name], want), (step, name)
        engine.step(CFG.lr)


def _bucket_grads(engine) -> dict[str, torch.Tensor]:
    """Each parameter's reduced gradient in its bucket (a group of one: the whole)."""
    out = {}
    for flat in engine.flats:
        grad = flat.grad if flat.grad is not None else flat.grad_shard
        out.update({s.name: grad[s.offset : s.offset + s.numel].view(s.shape) for s in flat.slots})
    return out


def test_zero3_in_a_group_of_one_uses_its_shards_as_they_are():
    """fp32 in one process: a unit computes with its fp32 shard itself, gathering and
    copying nothing (no pooled parameter buffer, ever); under bf16 the shard is cast
    into a pooled buffer once per use."""
    torch.manual_seed(0)
    model = Net()
    engine = _engine(model, 3)
    seen = []
    for unit in engine.blocks:
        unit.modules[0].register_forward_pre_hook(
            lambda module, args, unit=unit: seen.append(
                (unit.buffer.data_ptr() == unit.flat.master.data_ptr(), unit.gathered_bytes())
            )
        )
    for step in range(1, 3):
        engine.zero_grad()
        model(_batch(step)).square().sum().backward()
        engine.step(CFG.lr)
    assert seen and all(shared and held == 0 for shared, held in seen)
    assert engine.peak_gathered_bytes == 0

    mixed = _engine(Net().to(torch.bfloat16), 3, BF16)
    mixed.zero_grad()
    mixed.model(_batch(1, torch.bfloat16)).float().square().sum().backward()
    mixed.step(CFG.lr)
    assert mixed.peak_gathered_bytes > 0
