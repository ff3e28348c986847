"""Generation with a KV cache is the same computation as recomputing the prefix."""

import torch

from meshwise.data.tokenizer import printable
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.models.kv_cache import LayerCache
from meshwise.serve.generate import generate


def _model():
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=32, block_size=48, vocab_size=256)
    return GPT(cfg).init_weights(3).eval()


@torch.no_grad()
def test_cached_logits_match_a_full_forward():
    model = _model()
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    full = model(tokens)  # (1, 20, V)
    cache = [LayerCache() for _ in model.blocks]
    steps = [model(tokens[:, :12], cache=cache)[:, -1]]
    for t in range(12, 20):
        steps.append(model(tokens[:, t : t + 1], cache=cache)[:, -1])
    torch.testing.assert_close(torch.stack(steps[1:], 1), full[:, 12:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steps[0], full[:, 11])


@torch.no_grad()
def test_greedy_generation_equals_recomputing_the_prefix():
    model = _model()
    prompt = list(b"def f(x):")
    new = generate(model, prompt, 20, temperature=0)
    seq = list(prompt)
    for _ in range(20):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert new == seq[len(prompt) :]


def test_generation_stops_at_the_context_and_is_seeded():
    model = _model()
    assert len(generate(model, [1] * 40, 100, temperature=1.0)) == 48 - 40
    a = generate(model, [5, 6], 10, temperature=1.0, top_k=5, seed=7)
    assert a == generate(model, [5, 6], 10, temperature=1.0, top_k=5, seed=7)


def test_printable_escapes_control_bytes():
    assert printable("a\x1b[2Jb\nc\td\x00") == "a\\x1b[2Jb\nc\td\\x00"
