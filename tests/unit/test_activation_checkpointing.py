"""Activation checkpointing applied from outside: same numbers, blocks recomputed in backward."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
from meshwise.models.context import ForwardContext
from meshwise.models.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=3, n_head=2, d_model=16, block_size=32, vocab_size=50, dropout=0.1)


def _models():
    """A float64 GPT with dropout and a plain copy of it."""
    model = GPT(CFG).init_weights(1).double()
    plain = GPT(CFG).double()
    plain.load_state_dict(model.state_dict())
    return model, plain


def _loss(model, x, y, context=None):
    return F.cross_entropy(model(x, context=context).flatten(0, 1), y.flatten(), reduction="sum")


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 50, (2, 10), generator=gen), torch.randint(
        0, 50, (2, 10), generator=gen
    )


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_same_loss_and_gradients_with_blocks_run_twice(mode):
    model, plain = _models()
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model.blocks.values(), mode)
    assert [n for n, _ in model.named_parameters()] == names  # nothing renamed
    runs = []
    for block in model.blocks.values():
        block.register_forward_pre_hook(lambda module, args: runs.append(module))
    x, y = _batch()
    this = ForwardContext(seed=7, step=3, first_sample=4)
    loss = _loss(model, x, y, this)
    assert len(runs) == CFG.n_layer
    # Under a pipeline other micro-batches' forwards run before this backward; the
    # recompute must still draw this forward's masks.
    other = _loss(model, x, y, ForwardContext(seed=7, step=9, first_sample=0))
    loss.backward()
    del other
    assert len(runs) == 3 * CFG.n_layer  # each block again, through its hooks
    plain_loss = _loss(plain, x, y, this)
    plain_loss.backward()
    assert loss.item() == plain_loss.item()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_forward_without_autograd_runs_once_and_copies_stay_checkpointed():
    model, _ = _models()
    apply_activation_checkpointing(model.blocks.values(), "full")
    model.eval()
    x, _ = _batch()
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (2, 10, CFG.vocab_size)
    copied = copy.deepcopy(model)
    assert type(copied.blocks["0"]) is type(model.blocks["0"])
    assert copied.blocks["0"] is not model.blocks["0"]
    torch.testing.assert_close(copied(x), model(x))


def test_none_leaves_blocks_alone_and_unknown_mode_is_refused():
    model, _ = _models()
    block_type = type(model.blocks["0"])
    apply_activation_checkpointing(model.blocks.values(), "none")
    assert type(model.blocks["0"]) is block_type
    with pytest.raises(ValueError, match="valid: none, selective, full"):
        apply_activation_checkpointing(model.blocks.values(), "partial")


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, recomputed", [("none", 0), ("selective", 0), ("full", 4)])
def test_selective_keeps_the_matmul_outputs_full_recomputes_them(mode, recomputed):
    """Backward's matmuls: 2 per forward matmul (input and weight gradients), plus
    the recompute's forward matmuls under full checkpointing (4 per GPT block)."""
    model, _ = _models()
    apply_activation_checkpointing(model.blocks.values(), mode)
    x, y = _batch()
    loss = _loss(model, x, y)
    with _CountMatmuls() as counted:
        loss.backward()
    forward_matmuls = 4 * CFG.n_layer + 1  # qkv, proj, fc, proj per block; the head
    assert counted.count == 2 * forward_matmuls + recomputed * CFG.n_layer


@pytest.mark.parametrize("name", ["llama", "qwen3-like"])
def test_selective_checkpointing_of_the_llama_family_changes_no_gradient(name):
    from meshwise.models.families import family
    from meshwise.models.llama import LlamaConfig

    cfg = LlamaConfig(
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        ffn_hidden_size=64,
        block_size=32,
        vocab_size=50,
        qk_norm=name == "qwen3-like",
        qkv_bias=name == "qwen3-like",
        sliding_window=4,
    )
    plain, model = (family("llama").create(cfg, seed=2).double() for _ in range(2))
    apply_activation_checkpointing(model.layers.values(), "selective")
    x, y = _batch()
    for m in (plain, model):
        F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
