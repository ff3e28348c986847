"""ZeRO-3 on gloo ranks against a single-process torch.optim.AdamW reference."""

import contextlib
import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
from meshwise.mesh import Mesh, ParallelDims
from meshwise.sharding.adamw import AdamWConfig, decays
from meshwise.sharding.zero3 import ZeroStage3

CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GLOBAL_BATCH = 12


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Input projection, ``blocks``, final norm and head: the GPT's shape without tokens."""

    def __init__(self, d: int = 8, num_blocks: int = 3, d_in: int = 5, d_out: int = 3):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(num_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _flat_net():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _build(model_fn, dtype=torch.float64, **zero_kwargs):
    """Same init on every rank; returns (mesh, zero, reference model, reference AdamW)."""
    mesh = Mesh.build(ParallelDims(dp=torch.distributed.get_world_size()))
    torch.manual_seed(0)
    model = model_fn().to(dtype)
    ref = copy.deepcopy(model)
    zero = ZeroStage3(model, mesh.dp_group, CFG, **zero_kwargs)
    named = list(ref.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": CFG.weight_decay},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, foreach=False)
    return mesh, zero, ref, opt


def _batch(step: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(GLOBAL_BATCH, 5, generator=gen, dtype=dtype),
            torch.randn(GLOBAL_BATCH, 3, generator=gen, dtype=dtype))


def _loss(model, x, y):
    # Sum over the slice / global count: gradients of the global mean SUM over ranks.
    return ((model(x) - y) ** 2).sum() / GLOBAL_BATCH


def _train_and_compare(model_fn, num_steps=4, micro_steps=1, clip=None,
                       activation_checkpointing="none", **zero_kwargs):
    mesh, zero, ref, opt = _build(model_fn, **zero_kwargs)
    apply_activation_checkpointing(zero.model.blocks if hasattr(zero.model, "blocks") else [],
                                   activation_checkpointing)
    runs = [0]  # block forwards, recomputes included
    for block in getattr(zero.model, "blocks", []):
        block.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    n, r = mesh.dims.dp, mesh.dp_rank
    per_rank = GLOBAL_BATCH // n
    out = {"norm_diff": 0.0, "partial_norm_diff": 0.0, "clipped": False}
    for step in range(num_steps):
        x, y = _batch(step)
        xs, ys = x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]
        zero.zero_grad()
        for i, (xm, ym) in enumerate(zip(xs.chunk(micro_steps), ys.chunk(micro_steps))):
            if i < micro_steps - 1:
                with zero.no_sync():  # the trainer's protocol; stage 3 still reduces
                    _loss(zero, xm, ym).backward()
            else:
                _loss(zero, xm, ym).backward()
        zero.finish_grad_sync()
        opt.zero_grad()
        _loss(ref, x, y).backward()
        scale = 1.0
        if clip is not None:
            norm = zero.grad_sq_norm().sqrt()
            partial = zero.grad_sq_norm(include=lambda name: name.startswith("blocks.1"))
            ref_partial = sum(p.grad.pow(2).sum() for name, p in ref.named_parameters()
                              if name.startswith("blocks.1"))
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip, foreach=False)
            out["norm_diff"] = max(out["norm_diff"], abs(norm - ref_norm).item())
            out["partial_norm_diff"] = max(out["partial_norm_diff"],
                                           abs(partial - ref_partial).item())
            scale = min(1.0, clip / (norm.item() + 1e-6))
            out["clipped"] |= scale < 1.0
        zero.step(CFG.lr, grad_scale=scale)
        opt.step()
    full = zero.full_state_dict()
    ref_params = dict(ref.named_parameters())
    assert list(full) == list(ref_params)
    out["param_diff"] = max((full[k] - ref_params[k]).abs().max().item() for k in full)
    out["block_forwards"] = runs[0]
    out["all_freed"] = all(u.gathered_bytes() == 0 for u in zero.units)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("micro_steps,clip", [(1, None), (2, None), (1, 0.05)])
def test_matches_single_process_adamw(dist_pools, world_size, micro_steps, clip):
    results = dist_pools.run(world_size, _train_and_compare, Net, 4, micro_steps, clip)
    for res in results:
        assert res["param_diff"] < 1e-10
        assert res["norm_diff"] < 1e-10
        assert res["partial_norm_diff"] < 1e-10
        assert res["clipped"] == (clip is not None)


@pytest.mark.parametrize("micro_steps, mode, reshard", [
    (1, "full", "after-forward"), (2, "full", "after-forward"),
    (2, "selective", "after-forward"), (2, "selective", "after-backward"),
    (1, "selective", "after-step")])
def test_activation_checkpointing_recomputes_gathered_units(dist_pools, micro_steps, mode,
                                                            reshard):
    """Each block runs again inside backward, on parameters gathered for it there (or kept);
    selective checkpointing's replay meets none of the engine's own operations."""
    results = dist_pools.run(2, _train_and_compare, Net, 3, micro_steps, 0.05,
                             activation_checkpointing=mode, reshard=reshard)
    for res in results:
        assert res["param_diff"] < 1e-10 and res["norm_diff"] < 1e-10
        assert res["block_forwards"] == 3 * micro_steps * 3 * 2  # steps x micro x blocks x 2
        assert res["all_freed"]


def _freed_between_uses():
    mesh, zero, _, _ = _build(Net)
    blocks, checks = zero.blocks, []

    def after_forward(i, module, args, output):
        # Our own hook ran first: this block and every earlier one are freed.
        checks.append(all(b.gathered_bytes() == 0 for b in blocks[:i + 1]))
        output.register_hook(lambda grad: checks.append(  # after our pre-backward hook
            blocks[i].gathered_bytes() > 0
            and all(b.gathered_bytes() == 0 for b in blocks[i + 1:])))

    for i, block in enumerate(zero.model.blocks):
        block.register_forward_hook(lambda m, a, o, i=i: after_forward(i, m, a, o))
    x, y = _batch(0)
    loss = _loss(zero, x, y)
    root_kept = zero.root.gathered_bytes() > 0
    loss.backward()
    zero.finish_grad_sync()
    all_freed = all(u.gathered_bytes() == 0 for u in zero.units)
    return checks, root_kept, all_freed


def test_full_buffers_freed_after_forward_and_backward(dist_pools):
    for checks, root_kept, all_freed in dist_pools.run(2, _freed_between_uses):
        assert len(checks) == 6 and all(checks)
        assert root_kept  # the root stays gathered from forward until its backward
        assert all_freed


def _events(prefetch):
    _, zero, _, _ = _build(lambda: Net(num_blocks=4), prefetch=prefetch)
    x, y = _batch(0)
    _loss(zero, x, y).backward()
    return zero.events


def test_prefetch_issues_next_gather_before_compute(dist_pools):
    names = [f"blocks.{i}" for i in range(4)]
    for events in dist_pools.run(2, _events, True):
        first_bwd = events.index(("backward", "root"))
        fwd, bwd = events[:first_bwd], events[first_bwd:]
        for cur, nxt in zip(names, names[1:]):
            assert fwd.index(("gather_start", nxt)) < fwd.index(("forward", cur))
        for cur, prev in zip(names[1:], names):
            assert bwd.index(("gather_start", prev)) < bwd.index(("backward", cur))
        # Each block's gradient is reduced before the block two earlier is gathered.
        for i in range(2, 4):
            reduced = bwd.index(("reduce_scatter", names[i]))
            assert reduced < bwd.index(("gather_start", names[i - 2]))
    for events in dist_pools.run(2, _events, False):
        for cur, nxt in zip(names, names[1:]):
            assert events.index(("gather_start", nxt)) > events.index(("forward", cur))


def _no_blocks():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = _train_and_compare(_flat_net, num_steps=3)
    res["warnings"] = [str(w.message) for w in caught]
    return res


def test_model_without_blocks_is_one_unit(dist_pools):
    for res in dist_pools.run(2, _no_blocks):
        assert any("one unit" in w for w in res["warnings"])
        assert res["param_diff"] < 1e-10


def _originals_released():
    """After sharding, nothing may keep the model's original full parameters alive."""
    mesh = Mesh.build(ParallelDims(dp=torch.distributed.get_world_size()))
    model = Net()
    originals = [weakref.ref(p) for p in model.parameters()]
    zero = ZeroStage3(model, mesh.dp_group, CFG)
    x, y = _batch(1, torch.float32)
    _loss(zero, x, y).backward()
    zero.step(CFG.lr)
    gc.collect()
    return [name for ref, name in zip(originals, zero.param_names) if ref() is not None]


def test_the_original_parameters_are_released(dist_pools):
    assert dist_pools.run(2, _originals_released) == [[], []]


def _state_bytes():
    mesh, zero, ref, _ = _build(lambda: Net(d=64, num_blocks=2), dtype=torch.float32)
    psi = sum(p.numel() for p in ref.parameters())
    before = zero.state_bytes()
    x, y = _batch(0, torch.float32)
    zero.zero_grad()
    _loss(zero, x, y).backward()
    zero.step(CFG.lr)
    return psi, mesh.dims.dp, before, zero.state_bytes()


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_bytes_is_16_psi_over_n(dist_pools, world_size):
    for psi, n, before, after in dist_pools.run(world_size, _state_bytes):
        expected = 16 * psi / n
        assert abs(before - expected) / expected < 0.05
        assert abs(after - expected) / expected < 0.05


def _peak(prefetch):
    _, zero, ref, _ = _build(lambda: Net(d=16, num_blocks=6), prefetch=prefetch)
    x, y = _batch(0)
    zero.zero_grad()
    _loss(zero, x, y).backward()
    zero.step(CFG.lr)
    block = zero.blocks[0].flat.plan.padded_numel * 8
    return zero.peak_gathered_bytes, zero.root.flat.plan.padded_numel * 8, block, \
        sum(p.numel() for p in ref.parameters()) * 8


def test_peak_gathered_bytes_is_about_two_units_plus_root(dist_pools):
    for peak, root, block, whole in dist_pools.run(2, _peak, True):
        assert peak == root + 2 * block
        assert peak < 0.5 * whole
    for peak, root, block, whole in dist_pools.run(2, _peak, False):
        assert peak == root + block


def _policy_events(reshard: str, micro_steps: int):
    mesh, zero, _, _ = _build(lambda: Net(num_blocks=3), reshard=reshard)
    x, y = _batch(0)
    xs, ys = x.chunk(2 * micro_steps)[mesh.dp_rank::2], y.chunk(2 * micro_steps)[mesh.dp_rank::2]
    events = []
    zero.zero_grad()
    for i, (xm, ym) in enumerate(zip(xs, ys)):
        with zero.no_sync() if i < micro_steps - 1 else contextlib.nullcontext():
            _loss(zero, xm, ym).backward()
        events += zero.events
    zero.step(CFG.lr)
    whole = sum(u.flat.plan.padded_numel * 8 for u in zero.units)
    return events, zero.peak_gathered_bytes, whole


@pytest.mark.parametrize("reshard", ["after-backward", "after-step"])
def test_a_unit_kept_past_its_forward_is_gathered_once(dist_pools, reshard):
    """after-backward: one all-gather per unit and micro-step, kept from its forward to its
    backward, reduced every micro-step; after-step: one all-gather and one reduction per
    unit and step (the backwards under no_sync add up unsharded). Both hold every unit."""
    results = dist_pools.run(2, _train_and_compare, Net, 3, 2, 0.05, reshard=reshard)
    for res in results:
        assert res["param_diff"] < 1e-10 and res["norm_diff"] < 1e-10 and res["all_freed"]
    names = ["root"] + [f"blocks.{i}" for i in range(3)]
    per_step = {"after-backward": 2, "after-step": 1}[reshard]
    for events, peak, whole in dist_pools.run(2, _policy_events, reshard, 2):
        for name in names:
            assert events.count(("gather_start", name)) == per_step
            assert events.count(("reduce_scatter", name)) == per_step
            forward, backward = events.index(("forward", name)), events.index(("backward", name))
            assert ("free", name) not in events[forward:backward]
        assert peak == whole


def test_an_unknown_reshard_policy_is_refused():
    with pytest.raises(ValueError, match="reshard 'never' is not valid; valid: after-forward, "
                                         "after-backward, after-step"):
        ZeroStage3(Net(), None, CFG, reshard="never")


class _SkipsABlock(nn.Module):
    """Rank 1 skips block 1 in its forward: its units differ from rank 0's."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if not (i == 1 and torch.distributed.get_rank() == 1):
                x = block(x)
        return x.sum()


def _units_differ():
    mesh = Mesh.build(ParallelDims(dp=2))
    torch.manual_seed(0)
    zero = ZeroStage3(_SkipsABlock(), mesh.dp_group, CFG)
    try:
        zero(torch.ones(2, 4)).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
def test_units_used_on_some_ranks_only_fail_fast_and_named(dist_pools):
    for message in dist_pools.run(2, _units_differ, agree=False):
        assert "ZeRO-3 units blocks.1 ran on some dp ranks but not on others" in message
