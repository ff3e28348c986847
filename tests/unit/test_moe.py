"""The MoE layer against a plain per-expert loop, its routing options, and the
balancing loss's gradient."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshwise.models.llama import Llama, LlamaConfig
from meshwise.models.moe import MoE, expert_swiglu, is_moe_layer
from meshwise.models.router_stats import RouterTally

CFG = LlamaConfig(
    n_layer=2,
    d_model=16,
    n_head=2,
    n_kv_head=1,
    ffn_hidden_size=32,
    vocab_size=64,
    n_experts=4,
    experts_per_token=2,
    moe_ffn_hidden_size=8,
)


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """transformers' Mixtral / Qwen-MoE block, written as a loop over experts."""
    tokens = x.reshape(-1, x.shape[-1])
    scores = moe.gate(tokens).float()
    scores = scores.softmax(-1) if moe.score == "softmax" else scores.sigmoid()
    bias = getattr(moe, "expert_bias", torch.zeros(moe.num_experts))
    chosen = (scores + bias).topk(moe.top_k, -1).indices
    weights = scores.gather(-1, chosen)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    e = moe.experts
    for j in range(moe.num_experts):
        rows, slot = torch.where(chosen == j)
        h = F.silu(tokens[rows] @ e.gate_proj[j].T) * (tokens[rows] @ e.up_proj[j].T)
        out.index_add_(0, rows, (h @ e.down_proj[j].T) * weights[rows, slot, None])
    if hasattr(moe, "shared_expert"):
        shared = moe.shared_expert(tokens)
        if hasattr(moe, "shared_expert_gate"):
            shared = shared * torch.sigmoid(moe.shared_expert_gate(tokens))
        out = out + shared
    return out.view_as(x)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"norm_topk_prob": False, "experts_per_token": 1},
        {"router_score": "sigmoid", "shared_expert_size": 8},
        {"shared_expert_size": 8, "shared_expert_gate": True, "bias_update_rate": 0.1},
        {"moe_ffn_hidden_size": 6},  # unaligned width: the per-expert loop
    ],
)
def test_moe_layer_matches_a_per_expert_loop(options):
    cfg = dataclasses.replace(CFG, **options)
    model = Llama(cfg).init_weights(3)
    moe = model.layers["0"].mlp
    if hasattr(moe, "expert_bias"):
        moe.expert_bias.data = torch.tensor([0.0, 0.5, -0.5, 0.1])
    x = torch.randn(2, 5, cfg.d_model, requires_grad=True)
    got = moe(x)
    want = reference(moe, x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    grad = torch.randn_like(got)
    params = [x, *moe.parameters()]
    params = [p for p in params if p.requires_grad and p is not getattr(moe, "expert_bias", 0)]
    got_grads = torch.autograd.grad(got, params, grad)
    want_grads = torch.autograd.grad(want, params, grad)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("width", [16, 5])  # grouped kernel; unaligned: the loop
def test_experts_on_sorted_tokens_with_empty_experts(width):
    E, D = 4, 8
    x = torch.randn(11, D)
    w = [torch.randn(E, width, D), torch.randn(E, width, D), torch.randn(E, D, width)]
    counts = torch.tensor([3, 0, 8, 0])
    got = expert_swiglu(x, *w, counts)
    for j, rows in ((0, slice(0, 3)), (2, slice(3, 11))):
        want = (F.silu(x[rows] @ w[0][j].T) * (x[rows] @ w[1][j].T)) @ w[2][j].T
        torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-5)


def test_layer_rule_mixes_dense_and_moe_layers():
    cfg = dataclasses.replace(CFG, n_layer=6, first_dense_layers=1, moe_every=2)
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, True, False, True, False, True]
    assert not any(is_moe_layer(dataclasses.replace(cfg, n_experts=0), i) for i in range(6))


@pytest.mark.parametrize(
    "bad", [{"experts_per_token": 5}, {"router_score": "relu"}, {"moe_every": 0}]
)
def test_bad_moe_sizes_name_the_valid_values(bad):
    with pytest.raises(ValueError, match="valid"):
        dataclasses.replace(CFG, **bad)


def _router_grad(coef: float, formula: str = "per-layer") -> torch.Tensor:
    model = Llama(CFG).init_weights(1)
    tally = RouterTally(aux_scale=coef, formula=formula)
    from meshwise.models.context import ForwardContext

    x = torch.randint(0, 64, (2, 6))
    loss = model(x, context=ForwardContext(router=tally)).float().pow(2).mean()
    if formula == "hf-concatenated":
        loss = loss + coef * tally.concatenated_share()
    loss.backward()
    return model.layers["0"].mlp.gate.weight.grad, tally


def test_aux_loss_gradient_reaches_the_router():
    base, _ = _router_grad(0.0)
    with_aux, tally = _router_grad(0.5)
    assert not torch.allclose(base, with_aux)
    assert sorted(tally.aux) == [0, 1]


def test_aux_loss_matches_switch_formula_and_its_autograd_gradient():
    """The injected gradient equals autograd's of coef * E * sum_e (c_e / N) (P_e / N)."""
    torch.manual_seed(0)
    moe = Llama(CFG).init_weights(2).layers["0"].mlp
    x = torch.randn(1, 9, CFG.d_model)
    tally = RouterTally(aux_scale=0.3)
    out = moe(x, tally)
    (g_injected,) = torch.autograd.grad(out.sum(), [moe.gate.weight])
    out_plain = moe(x)
    _, _, probs = moe.route(x.reshape(-1, CFG.d_model))
    counts = tally.counts[0].float()
    N = x.shape[1]
    aux = CFG.n_experts * ((counts / N) * (probs.sum(0) / N)).sum()
    torch.testing.assert_close(tally.aux[0], aux.detach())
    (g_want,) = torch.autograd.grad(out_plain.sum() + 0.3 * aux, [moe.gate.weight])
    torch.testing.assert_close(g_injected, g_want, atol=1e-6, rtol=1e-5)


def test_recompute_counts_once():
    moe = Llama(CFG).init_weights(2).layers["0"].mlp
    x = torch.randn(1, 7, CFG.d_model, requires_grad=True)
    tally = RouterTally(aux_scale=0.1)
    calls = []
    tally.reduce_counts = lambda c: calls.append(1) or c
    out = torch.utils.checkpoint.checkpoint(moe, x, tally, use_reentrant=False)
    out.sum().backward()
    assert len(calls) == 1 and int(tally.counts[0].sum()) == 7 * 2


@pytest.mark.parametrize("options", [{}, {"shared_expert_size": 8, "first_dense_layers": 1}])
def test_plan_names_only_modules_that_exist(options):
    from meshwise.apply.checks import split_modules
    from meshwise.models.llama import llama_plan

    cfg = dataclasses.replace(CFG, **options)
    split = split_modules(Llama(cfg), llama_plan(cfg))
    assert all("experts." not in path for path, _, _ in split)
