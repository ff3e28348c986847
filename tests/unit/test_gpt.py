import torch

from meshwise.models.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, block_size=16, vocab_size=50)


def test_chunks_start_from_the_full_models_values():
    full = dict(GPT(CFG, seed=3).named_parameters())
    first = GPT(CFG, seed=3, layers=range(0, 2), has_head=False)
    last = GPT(CFG, seed=3, layers=range(2, 4), has_embedding=False)
    for chunk in (first, last):
        for name, p in chunk.named_parameters():
            assert torch.equal(p, full[chunk.global_name(name)]), name


def test_chunked_forward_equals_full_forward():
    torch.manual_seed(0)
    idx = torch.randint(0, CFG.vocab_size, (2, 16))
    targets = torch.randint(0, CFG.vocab_size, (2, 16))
    full = GPT(CFG, seed=1)
    first = GPT(CFG, seed=1, layers=range(0, 1), has_head=False)
    middle = GPT(CFG, seed=1, layers=range(1, 3), has_embedding=False, has_head=False)
    last = GPT(CFG, seed=1, layers=range(3, 4), has_embedding=False)
    expected = full(idx, targets)
    got = last(middle(first(idx)), targets)
    torch.testing.assert_close(got, expected)


def test_seed_changes_init_and_loss_is_a_sum():
    a, b = GPT(CFG, seed=1), GPT(CFG, seed=2)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, b.blocks[0].attn.qkv.weight)
    idx = torch.randint(0, CFG.vocab_size, (2, 8))
    loss_sum = a(idx, idx)
    mean = torch.nn.functional.cross_entropy(a(idx).flatten(0, 1), idx.flatten())
    torch.testing.assert_close(loss_sum / 16, mean)
