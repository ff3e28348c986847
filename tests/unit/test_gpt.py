"""The plain GPT: pipeline chunks cut by its plan compute what the whole model does."""

import torch
import torch.nn.functional as F

from meshwise.apply.parallelize import parallelize
from meshwise.models.gpt import GPT, GPTConfig, gpt_plan

CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, block_size=16, vocab_size=50)


def _chunks(seed, num_stages):
    """Every stage's chunk, each from its own copy of the initialised model."""
    return [
        parallelize(
            GPT(CFG).init_weights(seed), gpt_plan(CFG), pp_rank=stage, pp_size=num_stages
        ).chunks[0]
        for stage in range(num_stages)
    ]


def test_chunks_hold_their_layers_under_global_names_with_the_full_values():
    full = dict(GPT(CFG).init_weights(3).named_parameters())
    first, last = _chunks(3, 2)
    assert list(first.blocks.keys()) == ["0", "1"] and list(last.blocks.keys()) == ["2", "3"]
    assert first.lm_head is None and last.wte is None
    names = [n for chunk in (first, last) for n, _ in chunk.named_parameters()]
    assert "lm_head.weight" in names  # the last stage's copy of the tied embedding
    for chunk in (first, last):
        for name, p in chunk.named_parameters():
            expected = full["wte.weight" if name == "lm_head.weight" else name]
            assert torch.equal(p, expected), name


def test_chunked_forward_equals_full_forward():
    idx = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    full = GPT(CFG).init_weights(1)
    x = idx
    for chunk in _chunks(1, 4):
        x = chunk(x)
    torch.testing.assert_close(x, full(idx))


def test_seed_changes_init_and_the_head_is_tied():
    a, b = GPT(CFG).init_weights(1), GPT(CFG).init_weights(2)
    assert not torch.equal(a.blocks["0"].attn.qkv.weight, b.blocks["0"].attn.qkv.weight)
    assert a.lm_head.weight is a.wte.weight
    assert [n for n, _ in a.named_parameters()].count("wte.weight") == 1
    idx = torch.randint(0, CFG.vocab_size, (2, 8))
    assert F.cross_entropy(a(idx).flatten(0, 1), idx.flatten()) > 0
