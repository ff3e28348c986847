"""LoRA's settings and checks on one process: which layers a target names, the refusals
before any rank starts (a target matching nothing, a rank too large, an adapter that is
not plain LoRA or contradicts a flag), and the adapted layer's arithmetic against PEFT's
formula with its initial values drawn as PEFT draws them."""

import json
import math

import pytest
import torch

from meshwise.apply.lora import LoraConfig, add_adapters, targeted_layers
from meshwise.cli.main import build_parser
from meshwise.cli.train import train_config
from meshwise.geometry.init import on_meta
from meshwise.models.llama import Llama, LlamaConfig

SIZES = dict(n_layer=2, d_model=16, n_head=2, n_kv_head=1, ffn_hidden_size=24, vocab_size=64)


def _model():
    with on_meta():
        return Llama(LlamaConfig(**SIZES))


def test_all_linear_targets_every_linear_layer_but_the_head():
    every = [p for p, _ in targeted_layers(_model(), LoraConfig(lora_rank=2))]
    assert len(every) == 2 * 7 + 1 and every[-1] == "lm_head"
    skipped = [p for p, _ in targeted_layers(_model(), LoraConfig(lora_rank=2), skip=("lm_head",))]
    assert skipped == every[:-1]


def test_names_match_as_peft_matches_them():
    cfg = LoraConfig(lora_rank=2, lora_targets="q_proj, mlp.down_proj")
    paths = [p for p, _ in targeted_layers(_model(), cfg)]
    assert paths == [
        "layers.0.self_attn.q_proj",
        "layers.0.mlp.down_proj",
        "layers.1.self_attn.q_proj",
        "layers.1.mlp.down_proj",
    ]


def test_a_target_matching_nothing_lists_the_linear_names():
    with pytest.raises(
        ValueError,
        match="'qproj' matches no linear layer; valid: all-linear or "
        "names among down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj",
    ):
        targeted_layers(_model(), LoraConfig(lora_rank=2, lora_targets="q_proj,qproj"))


def test_a_rank_above_a_layers_smaller_dimension_is_refused():
    # k_proj maps 16 -> 8 (one kv head of 8)
    with pytest.raises(
        ValueError,
        match=r"--lora-rank 9 is above the smallest dimension of "
        r"layers.0.self_attn.k_proj \(16 -> 8\); valid: 1 to 8",
    ):
        targeted_layers(_model(), LoraConfig(lora_rank=9, lora_targets="k_proj"))


def test_bad_settings_are_named():
    for cfg, match in [
        (LoraConfig(lora_rank=-1), "--lora-rank -1"),
        (LoraConfig(lora_rank=2, lora_alpha=0), "--lora-alpha 0"),
        (LoraConfig(lora_rank=2, lora_dropout=1.0), "--lora-dropout 1"),
        (
            LoraConfig(lora_rank=2, lora_init="xavier"),
            "--lora-init 'xavier'; valid: kaiming, gaussian",
        ),
        (LoraConfig(lora_rank=2, lora_targets=" , "), "names no module"),
    ]:
        with pytest.raises(ValueError, match=match):
            cfg.check()


def test_the_adapted_layer_is_peft_s_formula_and_the_rest_is_frozen():
    from meshwise.apply.lora import adapter_init
    from meshwise.geometry.init import full_init, init_module
    from meshwise.models.llama import llama_init

    cfg = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_targets="q_proj")
    model = Llama(LlamaConfig(**SIZES))
    init_module(model, lambda n: llama_init(model.cfg, n), 0)
    names = add_adapters([model], cfg)
    shapes = {n: tuple(model.get_parameter(n).shape) for n in names}
    init_of = adapter_init(cfg, shapes)
    with torch.no_grad():
        for name in names:
            model.get_parameter(name).copy_(full_init(init_of(name), 3, name, shapes[name]))
    a = model.get_parameter("layers.0.self_attn.q_proj.lora_A")
    assert a.abs().max() <= 1 / math.sqrt(16) and a.std() > 0.5 / math.sqrt(3 * 16)
    assert not model.get_parameter("layers.0.self_attn.q_proj.lora_B").any()
    assert [n for n, p in model.named_parameters() if p.requires_grad] == names
    q = model.layers["0"].self_attn.q_proj
    with torch.no_grad():
        q.lora_B.normal_()
    x = torch.randn(3, 16)
    want = x @ q.weight.T + (x @ q.lora_A.T) @ q.lora_B.T * 2.0
    torch.testing.assert_close(q(x), want)


def _adapter(tmp_path, **config):
    out = tmp_path / "adapter"
    out.mkdir(parents=True)
    base = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "target_modules": ["v_proj", "q_proj"],
    }
    (out / "adapter_config.json").write_text(json.dumps({**base, **config}))
    return str(out)


def _train_config(*argv):
    args = build_parser().parse_args(["train", "--model", "llama-tiny", *argv])
    return train_config(args)[0]


def test_lora_from_takes_the_adapter_s_settings(tmp_path):
    cfg = _train_config("--lora-from", _adapter(tmp_path), "--lora-alpha", "8")
    lora = cfg.lora
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_targets) == (4, 8.0, "q_proj,v_proj")


def test_lora_from_refuses_a_contradicting_flag_and_what_is_not_plain_lora(tmp_path):
    with pytest.raises(
        ValueError, match="--lora-rank 8 contradicts --lora-from .* r 4; leave --lora-rank out"
    ):
        _train_config("--lora-from", _adapter(tmp_path), "--lora-rank", "8")
    with pytest.raises(ValueError, match="use_dora True is not supported"):
        _train_config("--lora-from", _adapter(tmp_path / "x", use_dora=True))


def test_lora_from_names_the_families_peft_names_alike(tmp_path):
    """GPT-2's fused Conv1D layers have other PEFT names: refused before any rank starts."""
    from meshwise.train.lora_setup import check_lora

    args = build_parser().parse_args(
        ["train", "--model", "tiny", "--lora-from", _adapter(tmp_path)]
    )
    cfg = train_config(args)[0]
    with pytest.raises(ValueError, match="needs a Llama, Mistral, Qwen2, Qwen3, .* not a gpt"):
        check_lora(cfg, 256)
