"""FLOPs per token from the model's shapes, against PyTorch's own count of one step."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from meshwise.models.families import family
from meshwise.train.flops import flops_per_token

SIZES = {
    "gpt": dict(n_layer=2, n_head=4, d_model=64, block_size=64, vocab_size=300),
    "llama": dict(
        n_layer=3,
        n_head=4,
        n_kv_head=2,
        d_model=64,
        ffn_hidden_size=160,
        block_size=64,
        vocab_size=300,
    ),
}


SEQ_LEN = 48


def _counted_per_token(model, vocab_size: int, batch: int = 2) -> float:
    """PyTorch's count of one training step of ``model``, per token. The math attention
    kernel: PyTorch counts its matrix products (the fused CPU kernel it would otherwise
    pick has no FLOP formula registered)."""
    tokens = torch.randint(0, vocab_size, (batch, SEQ_LEN + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return counter.get_total_flops() / (batch * SEQ_LEN)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_flops_per_token_match_pytorchs_count_of_a_training_step(name):
    fam = family(name)
    cfg = fam.make_config(SIZES[name])
    model = fam.create(cfg, seed=0)
    counted = _counted_per_token(model, cfg.vocab_size)
    layers = list(getattr(model, fam.plan(cfg).layers).values())
    ours, hardware = flops_per_token(model, layers, cfg.n_layer, cfg.d_model, SEQ_LEN)
    assert abs(ours - counted) <= 0.02 * counted, (ours, counted)
    assert hardware == ours


def test_lora_counts_no_weight_gradient_for_the_frozen_weights():
    """Frozen weights cost their forward and their input's gradient (4 per parameter), the
    adapters all three products (6); PyTorch's count of the step sees only what runs."""
    from meshwise.apply.lora import LoraConfig, add_adapters

    fam = family("llama")
    cfg = fam.make_config({**SIZES["llama"], "n_layer": 6})
    model = fam.create(cfg, seed=0)
    add_adapters([model], LoraConfig(lora_rank=4), skip=fam.plan(cfg).last_stage)
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.02)
    counted = _counted_per_token(model, cfg.vocab_size)
    layers = list(getattr(model, fam.plan(cfg).layers).values())
    ours, _ = flops_per_token(model, layers, cfg.n_layer, cfg.d_model, SEQ_LEN)
    # over by the first layer's q, k and v, whose input needs no gradient: 1/6 of them
    assert abs(ours - counted) <= 0.02 * counted, (ours, counted)
    model.requires_grad_(True)
    full, _ = flops_per_token(model, layers, cfg.n_layer, cfg.d_model, SEQ_LEN)
    assert counted < 0.8 * full  # the difference is no round-off


def test_recomputation_adds_one_forward_of_the_layers():
    fam = family("gpt")
    cfg = fam.make_config(SIZES["gpt"])
    with torch.device("meta"):
        model = fam.build(cfg)
    layers = list(model.blocks.values())
    model_flops, hardware = flops_per_token(
        model, layers, cfg.n_layer, cfg.d_model, 48, recomputed=True
    )
    per_layer = sum(
        m.weight.numel()
        for layer in layers
        for m in layer.modules()
        if isinstance(m, torch.nn.Linear)
    )
    assert hardware - model_flops == 2 * per_layer + 4 * cfg.n_layer * cfg.d_model * 48
