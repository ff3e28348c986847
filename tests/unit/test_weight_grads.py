"""The split backward: B gives the input gradient and defers linear weights; W completes them."""

import copy

import pytest
import torch
from torch import nn

from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.models.llama import Llama, LlamaConfig
from meshwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from meshwise.tensor_parallel.vocab import VocabParallelHead
from meshwise.tensor_parallel.weight_grads import (
    WeightGradStore,
    defer_weight_grads,
    defers_weight_grad,
)

DT = torch.float64


def _gpt(checkpointing: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8, vocab_size=32)).to(DT)
    model.init_weights(0)
    if checkpointing:
        apply_activation_checkpointing(model.blocks, "full")
    return model


def _hidden_input(model):
    """A middle pipeline stage's view: hidden states in, hidden states out (no embedding)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 8, model.cfg.d_model, generator=g, dtype=DT, requires_grad=True)


def _middle(model, x):
    for block in model.blocks.values():
        x = block(x)
    return model.lm_head(model.ln_f(x))


def _split_step(model, x, grad_out, store, key=0):
    with store.capturing(key):
        out = _middle(model, x)
    with store.capturing(key):
        torch.autograd.backward(out, grad_out)  # B
    return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_b_then_w_gives_the_whole_backward(checkpointing):
    ref, split = _gpt(checkpointing), _gpt(checkpointing)
    store = WeightGradStore()
    assert defer_weight_grads([split], store) == 9  # qkv, proj, fc, proj per block, the head
    x_ref, x = _hidden_input(ref), _hidden_input(split)
    grad_out = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(2), dtype=DT)
    torch.autograd.backward(_middle(ref, x_ref), grad_out)
    _split_step(split, x, grad_out, store)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-14)  # B: input gradient
    deferred = {
        n for n, m in split.named_modules() for a in ("weight",) if defers_weight_grad(m, a)
    }
    for name, p in split.named_parameters():
        module = name.rpartition(".")[0]
        if module in deferred and name.endswith(".weight"):
            assert p.grad is None, f"{name} got its gradient in B"
        elif p.grad is not None:  # norms and biases: in B
            torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad)
    assert store.pending(0)
    store.run(0)  # W
    assert not store.pending(0)
    for (name, p), q in zip(split.named_parameters(), ref.parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_checkpointed_blocks_recompute_once_in_b_and_never_in_w():
    model = _gpt(checkpointing=True)
    store = WeightGradStore()
    defer_weight_grads([model], store)
    calls = []
    for block in model.blocks.values():
        block.attn.register_forward_hook(lambda m, args, out: calls.append("attn"))
    x = _hidden_input(model)
    out = None
    with store.capturing("mb"):
        out = _middle(model, x)
    assert len(calls) == 2
    with store.capturing("mb"):
        torch.autograd.backward(out, torch.ones_like(out))
    assert len(calls) == 4  # one recompute per block, inside B
    store.run("mb")
    assert len(calls) == 4  # W reuses what B kept


def test_outside_capturing_layers_run_the_plain_backward():
    model = _gpt()
    store = WeightGradStore()
    defer_weight_grads([model], store)
    x = _hidden_input(model)
    _middle(model, x).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("blocks"))
    assert not store.pending(None)


def test_hooks_see_each_deferred_weight_once_in_w():
    model = _gpt()
    store = WeightGradStore()
    defer_weight_grads([model], store)
    seen = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append(name))
    x = _hidden_input(model)
    _split_step(model, x, torch.ones(3, 8, 32, dtype=DT), store)
    in_b = list(seen)
    assert "blocks.0.attn.qkv.weight" not in in_b and "blocks.0.attn.qkv.bias" in in_b
    store.run(0)
    linear_weights = ("qkv.weight", "attn.proj.weight", "fc.weight", "mlp.proj.weight")
    # the head's weight is the tied token embedding: named wte.weight
    assert sorted(seen[len(in_b) :]) == sorted(
        [n for n in dict(model.named_parameters()) if n.endswith(linear_weights)] + ["wte.weight"]
    )


def test_parallel_layers_and_llama_defer_too():
    layers = [
        ColumnParallelLinear(4, 6, None, dtype=DT),
        RowParallelLinear(6, 4, None, dtype=DT),
        VocabParallelHead(4, 10, None, dtype=DT),
    ]
    store = WeightGradStore()
    assert defer_weight_grads([nn.Sequential(*layers)], store) == 3
    twin = copy.deepcopy(nn.Sequential(*layers))
    twin.apply(lambda m: setattr(m, "weight_grads", None) if hasattr(m, "weight_grads") else None)
    x = torch.randn(2, 4, dtype=DT)
    with store.capturing(1):
        out = nn.Sequential(*layers)(x)
        torch.autograd.backward(out, torch.ones_like(out))
    store.run(1)
    twin(x).sum().backward()
    for p, q in zip(nn.Sequential(*layers).parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    llama = Llama(
        LlamaConfig(
            n_layer=1,
            n_head=2,
            n_kv_head=1,
            d_model=8,
            ffn_hidden_size=16,
            block_size=8,
            vocab_size=16,
        )
    )
    assert defer_weight_grads([llama], WeightGradStore()) == 8  # q k v o gate up down, head


class _ViewsOfBuffer(torch.autograd.Function):
    """A weight handed out as a view of a shared buffer (as a ZeRO-3 unit does)."""

    @staticmethod
    def forward(ctx, anchor, buffer):
        return buffer.view(2, 3)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(-1), None


def test_w_reaches_a_weight_whose_buffer_was_rewritten_since_b():
    """A ZeRO-3 unit freed after B and gathered again rewrites its buffer in place: W
    still delivers the gradient (through the edge taken in the forward)."""
    anchor = torch.zeros(6, dtype=DT, requires_grad=True)
    buffer = torch.arange(6, dtype=DT)
    layer = nn.Linear(3, 2, bias=False, dtype=DT)
    store = WeightGradStore()
    defer_weight_grads([layer], store)
    del layer.weight  # the unit owns it, as cut_into_units arranges
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    with store.capturing(0):
        layer.weight = _ViewsOfBuffer.apply(anchor, buffer)
        out = layer(x)
        out.sum().backward()  # B: nothing reaches the weight yet
    assert anchor.grad is None
    buffer.mul_(0)  # the buffer goes back to the pool and is gathered again
    store.run(0)
    expected = (torch.ones(4, 2, dtype=DT).t() @ x.detach()).reshape(-1)
    torch.testing.assert_close(anchor.grad, expected)
