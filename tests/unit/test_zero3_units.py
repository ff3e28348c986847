"""ZeRO-3 in one process: a size-1 group never reaches torch.distributed."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
from meshwise.comm.ops import CommCounters
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.sharding.adamw import AdamWConfig, decays
from meshwise.sharding.binding import cut_into_units, values_of
from meshwise.sharding.flat import FlatParams, ParamSlot, Precision
from meshwise.sharding.zero3 import ZeroStage3

CFG = AdamWConfig(lr=1e-2, weight_decay=0.1)


def _group(size=1, rank=0):
    return SimpleNamespace(size=size, rank=rank, counters=CommCounters())


def _reference_adamw(model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": CFG.weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]
    # The engines step with PyTorch's fused AdamW kernel: one process takes its steps
    # bit for bit.
    return torch.optim.AdamW(groups, lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, fused=True)


class CheckpointedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _gpt():
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8, vocab_size=32)).double()


def _gpt_selective():
    """Selective checkpointing's replay must meet the model's operations only."""
    model = _gpt()
    apply_activation_checkpointing(model.blocks, "selective")
    return model


def _gpt_frozen():
    """Frozen weights (LoRA's base) in every unit, and a root of frozen ones only."""
    model = _gpt()
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name)
    return model


@pytest.mark.parametrize(
    "make", [_gpt, _gpt_selective, _gpt_frozen, lambda: CheckpointedBlocks().double()]
)
def test_single_rank_matches_adamw(make):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    zero, opt = ZeroStage3(model, _group(), CFG), _reference_adamw(ref)
    gpt = isinstance(model, GPT)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = (
            torch.randint(0, 32, (4, 8), generator=gen)
            if gpt
            else torch.randn(4, 6, generator=gen, dtype=torch.float64)
        )
        losses = []
        for net in (zero, ref):
            loss = (
                F.cross_entropy(net(x).flatten(0, 1), x.flatten(), reduction="sum")
                if gpt
                else net(x).pow(2).sum()
            )
            loss.backward()
            losses.append(loss.item())
        zero.step(CFG.lr)
        opt.step()
        zero.zero_grad()
        opt.zero_grad()
        assert losses[0] == losses[1]
        assert all(u.gathered_bytes() == 0 for u in zero.units)
    full = zero.full_state_dict()
    frozen = zero.full_state_dict(frozen=True)
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(full[name], p, rtol=0, atol=1e-12)
        else:
            assert torch.equal(frozen[name], p)
    # Frozen: sharded storage only, no gradient, no AdamW state, nothing to checkpoint.
    assert len(full) + len(frozen) == len(list(ref.parameters()))
    assert all(u.frozen is None or u.frozen.grad_shard is None for u in zero.units)
    assert sum(len(run.names) for run in zero.checkpoint_runs()) == len(full)


def test_a_frozen_root_is_freed_once_the_head_backward_is_over():
    """Nothing of the root trains and token ids need no gradient: it is freed once the
    gradient reaches the last layer, before the layers' backward, not at the step's end."""
    zero = ZeroStage3(_gpt_frozen(), _group(), CFG)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    zero(x).sum().backward()
    events = zero.events
    assert events.index(("free", "root")) < events.index(("backward", "blocks.0"))
    assert zero.root.gathered_bytes() == 0


def test_a_root_larger_than_a_layer_does_not_size_the_layers_buffers():
    """The root is gathered beside the layers for most of a step: from a pool of its own,
    else every layer's buffer would be the embedding's size."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8, vocab_size=512))
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name)
    zero = ZeroStage3(model.double(), _group(), CFG)
    x = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    zero(x).sum().backward()
    zero.step(CFG.lr)
    layer = max(u.flat.plan.padded_numel + u.frozen.plan.padded_numel for u in zero.blocks)
    assert zero.root.frozen.plan.padded_numel > layer
    pooled = [b.numel() for buffers in zero.pool._free.values() for b in buffers]
    assert pooled and max(pooled) <= layer


def test_tied_embedding_stays_in_root():
    zero = ZeroStage3(_gpt(), _group(), CFG)
    assert [u.name for u in zero.units] == ["root", "blocks.0", "blocks.1"]
    assert "wte.weight" in [s.name for s in zero.root.flat.slots]
    assert zero.param_names[0] == "wte.weight"


def test_excluded_parameters_stay_with_their_module():
    """Another engine's parameters (experts under ep): neither sharded nor unregistered."""
    model = _gpt()
    mlp = model.blocks["0"].mlp
    kept = list(mlp.parameters())
    zero = ZeroStage3(model, _group(), CFG, exclude=kept)
    held = {s.name for u in zero.units for s in u.flat.slots}
    assert list(mlp.parameters()) == kept and not any(".0.mlp." in n for n in held)
    assert len(held) == len(list(_gpt().parameters())) - len(kept)


def test_eval_forward_frees_everything():
    zero = ZeroStage3(_gpt(), _group(), CFG)
    with torch.no_grad():
        zero(torch.zeros(2, 8, dtype=torch.long))
    assert all(u.gathered_bytes() == 0 for u in zero.units)


def test_bad_units_are_rejected_before_touching_the_model():
    model = _gpt()
    with pytest.raises(ValueError, match="disjoint"):
        cut_into_units(model, [model.blocks["0"], model.blocks["0"].mlp])
    with pytest.raises(ValueError, match="not a submodule"):
        cut_into_units(model, [nn.Linear(2, 2)])
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="shared by several units"):
        cut_into_units(tied, [tied[0], tied[1]])
    assert len(list(tied.parameters())) == 3  # nothing unregistered


def _pieces(flat, used=None):
    """``(start, end, decays)`` in buffer elements of each piece AdamW updates."""
    lo, base = flat.update_range[0], flat.master.data_ptr()
    out = []
    for decay, master, grad, exp_avg, exp_avg_sq in flat.update_pieces(used):
        start = lo + (master.data_ptr() - base) // master.element_size()
        assert grad.numel() == exp_avg.numel() == exp_avg_sq.numel() == master.numel()
        out.append((start, start + master.numel(), decay))
    return out


def test_shard_ranges_values_and_decay_pieces():
    """weight (4x3=12) + bias (4) = 16: over 3 ranks padded to 18, shards of 6."""
    lin = nn.Linear(3, 4)
    slots = [
        ParamSlot("weight", lin.weight.shape, 0, 12, True),
        ParamSlot("bias", lin.bias.shape, 12, 4, False),
    ]
    values = values_of(lin.named_parameters())

    def flat(size, rank, stage=3):
        return FlatParams(slots, _group(size, rank), stage, Precision(), "cpu", values)

    middle = flat(3, 1)
    assert middle.plan.shard_numel == 6 and middle.plan.padding == 2
    assert middle.update_range == (6, 12) and middle.params is None
    assert torch.equal(middle.master, lin.weight.detach().reshape(-1)[6:12])
    assert _pieces(middle) == [(6, 12, True)]
    last = flat(3, 2)  # elements 12..16 and two of padding
    assert last.update_range == (12, 16) and last.master.numel() == 6
    assert torch.equal(last.master[:4], lin.bias.detach()) and not last.master[4:].any()
    assert _pieces(flat(2, 1)) == [(8, 12, True), (12, 16, False)]
    assert _pieces(flat(2, 1), {"bias"}) == [(12, 16, False)]
    assert _pieces(flat(1, 0, stage=0)) == [(0, 12, True), (12, 16, False)]
    stage1 = flat(2, 0, stage=1)  # full compute buffer; the master is its own range
    assert stage1.master.data_ptr() == stage1.params.data_ptr()
    assert torch.equal(stage1.params[:12], lin.weight.detach().reshape(-1))


def test_an_exact_pool_allocates_what_is_asked():
    """A pipeline stage holds all its units at once: a small unit's buffer must not be
    the size of the largest (the default pool's way to serve every size later)."""
    from meshwise.sharding.binding import BufferPool

    shared, exact = BufferPool(), BufferPool(exact=True)
    for pool in (shared, exact):
        big = pool.acquire(1000, torch.float32, "cpu")
        small = pool.acquire(10, torch.float32, "cpu")
        assert big.numel() == 1000 and small.numel() == 10
    assert shared.acquire(10, torch.float32, "cpu")._base.numel() == 1000
    small = exact.acquire(10, torch.float32, "cpu")
    assert small._base is None and small.numel() == 10
    exact.release(small)
    assert exact.acquire(10, torch.float32, "cpu").data_ptr() == small.data_ptr()  # reused


def test_a_unit_of_trained_and_frozen_parameters_is_one_all_reduce_where_gathers_are(
    monkeypatch,
):
    """gloo gathers by all-reducing a buffer zero but for the rank's shards: the adapters
    and the frozen weights of a unit then go in one all-reduce, whose sum over the ranks
    is every parameter where its views read it."""
    from meshwise.comm import ops, policy

    sent = []
    done = SimpleNamespace(wait=lambda: None)

    def all_reduce(buf, group, **kwargs):
        sent.append((buf.clone(), kwargs["category"]))
        return done

    monkeypatch.delenv("MESHWISE_COMM_CHECK")  # gloo's own formulations
    monkeypatch.setattr(ops, "backend", lambda group: "gloo")
    monkeypatch.setattr(ops, "all_reduce", all_reduce)
    assert policy.all_gather_by_all_reduce(_group(2))
    model = _gpt_frozen()
    ref = dict(model.named_parameters())
    for rank in (0, 1):
        unit = ZeroStage3(copy.deepcopy(model), _group(2, rank), CFG).blocks[0]
        unit.start_gather()
        assert unit.flat.numel and unit.frozen.numel and len(sent) == rank + 1
    (first, category), (second, _) = sent
    assert category == "param" and first.shape == second.shape
    unit.buffer.copy_(first + second)
    for flat, views in ((unit.flat, unit.plain_views()), (unit.frozen, unit.plain_views(True))):
        for slot, view in zip(flat.slots, views):
            assert torch.equal(view, ref[slot.name])
