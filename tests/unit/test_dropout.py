"""Dropout masks depend on what an element is, not on who computes it or when."""

import pytest
import torch
import torch.nn.functional as F

from meshwise.models.context import ForwardContext
from meshwise.models.dropout import keep_mask
from meshwise.models.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, n_head=4, d_model=32, block_size=16, dropout=0.2)


def _loss(model, tokens, step, first):
    logits = model(tokens[:, :-1], context=ForwardContext(step=step, first_sample=first))
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")


def test_a_batch_split_in_two_drops_the_same_elements():
    model = GPT(CFG).init_weights(1).train()
    tokens = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    whole = _loss(model, tokens, step=3, first=0)
    halves = _loss(model, tokens[:2], 3, 0) + _loss(model, tokens[2:], 3, 2)
    torch.testing.assert_close(halves, whole, rtol=1e-6, atol=1e-6)
    whole.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    halves.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_masks_change_with_step_and_sample_and_vanish_in_eval():
    model = GPT(CFG).init_weights(1).train()
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    a, b = _loss(model, tokens, 1, 0), _loss(model, tokens, 2, 0)
    assert a != b and a == _loss(model, tokens, 1, 0)
    assert _loss(model, tokens, 1, 0) != _loss(model, tokens, 1, 5)
    model.eval()
    assert _loss(model, tokens, 1, 0) == _loss(model, tokens, 2, 0)


def test_a_forward_without_a_context_is_sample_zero_of_step_zero():
    model = GPT(CFG).init_weights(1).train()
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = F.cross_entropy(
        model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum"
    )
    assert plain == _loss(model, tokens, 0, 0) and plain != _loss(model, tokens, 0, 1)


def test_heads_draw_their_own_masks():
    one_rank = ForwardContext(seed=0)
    other_rank = ForwardContext(seed=0, tp_rank=1)  # holds the second of two heads
    both = keep_mask(one_rank, "s", torch.Size([1, 2, 4, 4]), 0.5, "cpu", per_head=True)
    second = keep_mask(other_rank, "s", torch.Size([1, 1, 4, 4]), 0.5, "cpu", per_head=True)
    assert torch.equal(both[:, 1:], second)  # head 1 alone (another tp rank) draws the same
    assert not torch.equal(both[:, 0], both[:, 1])
    assert ((both == 0) | (both == 2)).all()


def test_dropout_must_be_below_one():
    from meshwise.cli.main import build_parser
    from meshwise.cli.train import train_config

    with pytest.raises(ValueError, match="--dropout must be in"):
        train_config(build_parser().parse_args(["train", "--dropout", "1"]))
