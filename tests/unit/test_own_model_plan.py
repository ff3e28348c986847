"""A model of one's own under a plan: what parallelize reads, checks and initialises."""

import math
import types

import pytest
import torch
from torch import nn

from examples.own_model import PLAN, VOCAB, WIDTH, Attention, TinyLM
from meshwise.apply.module_init import default_inits
from meshwise.apply.parallelize import parallelize
from meshwise.geometry.init import init_module, normal
from meshwise.geometry.plan import ParallelPlan


def _tp(rank, size=2):
    return types.SimpleNamespace(rank=rank, size=size)


def _laid_out(model_fn=TinyLM, plan=PLAN, tp_rank=0, tp_size=2, **kw):
    with torch.device("meta"):
        model = model_fn()
    return parallelize(model, plan, tp_group=_tp(tp_rank, tp_size), **kw)


def test_the_vocabulary_comes_from_the_split_modules_not_a_cfg_attribute():
    assert not hasattr(TinyLM(), "cfg")
    parts = _laid_out()
    assert parts.vocab_size == VOCAB  # 257: tp 2 pads it to 258, the padding stays out
    assert parallelize(TinyLM(), PLAN).vocab_size == VOCAB
    with pytest.raises(ValueError, match="vocab_size=511 but tok_emb holds 257 rows"):
        _laid_out(vocab_size=511)


def test_initial_values_default_to_each_modules_own_initialisation():
    seed = 3
    whole = TinyLM()
    inits = default_inits(whole)
    init_module(whole, inits.__getitem__, seed, PLAN.logical_name)
    full = dict(whole.named_parameters())
    bound = 1 / math.sqrt(WIDTH)
    assert torch.equal(full["layers.0.norm1.weight"], torch.ones(WIDTH))
    assert not full["layers.0.norm1.bias"].any()
    w1 = full["layers.1.ffn.w1.bias"]
    assert w1.abs().max() <= bound and w1.std() > bound / 3  # U(-1/sqrt(in), 1/sqrt(in))
    assert 0.9 < full["tok_emb.weight"].std() < 1.1  # the tie is drawn as the embedding's N(0, 1)
    for rank in (0, 1):  # each tp shard is the slice of the single-process tensor
        parts = _laid_out(tp_rank=rank)
        values = parts.init_values(seed=seed)
        for name, param in parts.named_parameters():
            got = values(name, 0, param.numel()).view(param.shape)
            dim = getattr(param, "tp_dim", None)
            expected = full[name] if dim is None else full[name].chunk(2, dim)[rank]
            rows = min(got.shape[0], expected.shape[0])  # the vocabulary's padding row
            torch.testing.assert_close(
                got[:rows], expected[:rows].detach(), rtol=0, atol=0, msg=name
            )


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return x * self.gain


def test_a_module_without_a_known_initialisation_asks_for_an_init_function():
    def with_custom_norm():
        model = TinyLM()
        model.final_norm = _Scaled()
        return model

    parts = _laid_out(with_custom_norm)
    with pytest.raises(ValueError, match=r"final_norm.gain \(_Scaled\) has no known default"):
        parts.init_values(seed=0)
    values = parts.init_values(lambda name: normal(0.02), seed=0)  # given: no question
    assert values("final_norm.gain", 0, WIDTH).shape == (WIDTH,)


def _plan(**changes):
    fields = {f: getattr(PLAN, f) for f in ("layers", "first_stage", "last_stage", "tp", "ties")}
    return ParallelPlan(**{**fields, **changes})


def test_plan_mistakes_name_the_module_at_parallelize_time():
    with pytest.raises(ValueError, match=r"'layers.\*.attn.qq' matches no module"):
        _laid_out(plan=_plan(tp=PLAN.tp + (("layers.*.attn.qq", "colwise"),)))
    with pytest.raises(ValueError, match="tok_emb is a Embedding, but style 'colwise' needs"):
        _laid_out(plan=_plan(tp=(("tok_emb", "colwise"),)))
    with pytest.raises(ValueError, match="'head' is not a module"):
        _laid_out(plan=_plan(last_stage=("final_norm", "head")))
    with pytest.raises(ValueError, match="tied parameters have different shapes"):
        _laid_out(plan=_plan(ties=(("tok_emb.weight", "layers.0.attn.q.weight"),)))
    with pytest.raises(ValueError, match="out_features = 64 is not divisible by tp 3"):
        _laid_out(tp_size=3)


class _CountsHeads(Attention):
    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, 4, WIDTH // 4)  # the whole model's 4 heads: wrong on a shard
        return self.o(q.reshape(B, T, -1))


class _NoSkip(TinyLM):
    def forward(self, x):
        x = self.tok_emb(x)  # called on every stage, also where it is None
        for layer in self.layers.values():
            x = layer(x)
        return self.out(self.final_norm(x))


def test_a_forward_that_cannot_run_on_a_shard_or_a_stage_is_caught_with_the_rule():
    def counting_heads():
        model = TinyLM()
        model.layers["0"].attn = _CountsHeads()
        return model

    _laid_out(counting_heads, tp_size=1)  # whole: fine
    with pytest.raises(
        ValueError,
        match=r"layers.0.attn's forward fails on one tensor-parallel "
        r"shard \(tp 2\).*use -1 or the local size",
    ):
        _laid_out(counting_heads)
    with pytest.raises(
        ValueError,
        match="_NoSkip.s forward fails in pipeline stage 0 of 2.*must skip a module set to None",
    ):
        _laid_out(_NoSkip, tp_size=1, pp_size=2, tie_group=object())


def test_an_own_family_builds_a_reference_only_with_its_init_function():
    from meshwise.models.families import ModelFamily

    with pytest.raises(ValueError, match="model family 'own' has no init"):
        ModelFamily.own(TinyLM, PLAN).create(None)  # not a TypeError from calling None
    drawn = ModelFamily.own(TinyLM, PLAN, lambda name: normal(0.02)).create(None, seed=1)
    again = ModelFamily.own(TinyLM, PLAN, lambda name: normal(0.02)).create(None, seed=1)
    for (name, param), (_, same) in zip(drawn.named_parameters(), again.named_parameters()):
        assert torch.equal(param, same), name
    assert abs(drawn.final_norm.weight.std().item() - 0.02) < 0.01
