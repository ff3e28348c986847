"""The Llama family on one process: parity with transformers, its plan, its configs."""

import dataclasses
import types

import pytest
import torch

from meshwise.apply.parallelize import parallelize
from meshwise.geometry.pieces import Piece
from meshwise.hf.llama import hf_config, hf_shapes, llama_sizes, read_config
from meshwise.hf.safetensors_dir import SafetensorsDir
from meshwise.models.families import family
from meshwise.models.kv_cache import LayerCache
from meshwise.models.llama import (
    Llama,
    LlamaConfig,
    check_llama_tp,
    llama_plan,
    rope_inverse_frequencies,
)
from tests.hf_llama import (
    ATOL,
    LLAMA3_SCALING,
    hf_logits,
    laid_out,
    materialize,
    save_hf_llama,
    token_ids,
)

pytest.importorskip("transformers")

CFG = LlamaConfig(
    n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden_size=64, block_size=64, vocab_size=50
)


@pytest.mark.parametrize("variant", ["untied", "tied", "llama3-rope", "sharded"])
def test_logits_match_transformers_at_tp1(tmp_path, variant):
    save_hf_llama(
        tmp_path,
        tie=variant == "tied",
        rope_scaling=LLAMA3_SCALING if variant == "llama3-rope" else None,
        max_shard_size="60KB" if variant == "sharded" else None,
    )
    if variant == "sharded":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    pm, values = laid_out(tmp_path)
    materialize(pm, values)
    ids = token_ids(shape=(2, 48))  # past the llama3 scaling's original 32 positions
    with torch.no_grad():
        diff = (pm.chunks[0](ids) - hf_logits(tmp_path, ids)).abs().max().item()
    assert diff <= ATOL, diff
    if variant == "tied":
        model = pm.chunks[0]
        assert model.lm_head.weight is model.embed_tokens.weight


def test_kv_cache_decoding_equals_the_full_forward():
    model = family("llama").create(CFG, seed=3).eval()
    ids = token_ids(CFG.vocab_size, (1, 20))
    cache = [LayerCache() for _ in range(CFG.n_layer)]
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :12], cache=cache)[:, -1]]
        steps += [model(ids[:, t : t + 1], cache=cache)[:, -1] for t in range(12, 20)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 11:], rtol=1e-5, atol=1e-5)
    assert cache[0].k.shape == (1, CFG.n_kv_head, 20, CFG.head_dim)  # cached before the repeat


def test_llama3_inverse_frequencies_equal_transformers():
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = HFLlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_SCALING, original_max_position_embeddings=8192),
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_inverse_frequencies(
        LlamaConfig(
            n_head=2,
            n_kv_head=2,
            d_model=128,
            rope_theta=500000.0,
            rope_scaling=dict(LLAMA3_SCALING, original_max_position_embeddings=8192),
        )
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


# ---------------------------------------------------------------- the plan
def _rank(model_cfg, tp_rank, tp=2):
    with torch.device("meta"):
        model = Llama(model_cfg)
    group = types.SimpleNamespace(size=tp, rank=tp_rank)  # shapes only: no collective runs
    return parallelize(model, llama_plan(model_cfg), tp_group=group)


def test_plan_splits_heads_kv_heads_mlp_and_vocabulary():
    params = dict(_rank(CFG, 1).named_parameters())
    expected = {  # name: (local shape, tp dim); dim None: replicated
        "embed_tokens.weight": ((25, 32), 0),
        "layers.0.self_attn.q_proj.weight": ((16, 32), 0),  # 2 of 4 query heads
        "layers.0.self_attn.k_proj.weight": ((8, 32), 0),  # 1 of 2 kv heads
        "layers.0.self_attn.v_proj.weight": ((8, 32), 0),
        "layers.0.self_attn.o_proj.weight": ((32, 16), 1),
        "layers.0.mlp.gate_proj.weight": ((32, 32), 0),
        "layers.0.mlp.up_proj.weight": ((32, 32), 0),
        "layers.0.mlp.down_proj.weight": ((32, 32), 1),
        "layers.0.input_layernorm.weight": ((32,), None),
        "norm.weight": ((32,), None),
        "lm_head.weight": ((25, 32), 0),
    }
    for name, (shape, dim) in expected.items():
        assert tuple(params[name].shape) == shape, name
        assert getattr(params[name], "tp_dim", None) == dim, name
    assert not any(name.endswith(".bias") for name in params)
    assert params["lm_head.weight"] is not params["embed_tokens.weight"]  # untied by default


def test_gqa_shard_holds_whole_query_groups_and_the_boxes_tile_the_tensors():
    pieces = [_rank(CFG, r).pieces() for r in range(2)]
    k = [p["layers.1.self_attn.k_proj.weight"] for p in pieces]
    q = [p["layers.1.self_attn.q_proj.weight"] for p in pieces]
    assert [piece.box_offsets for piece in k] == [(0, 0), (8, 0)]  # kv head r on rank r
    assert [piece.box_offsets for piece in q] == [(0, 0), (16, 0)]  # its query heads 2r, 2r+1
    vocab = [p["lm_head.weight"] for p in pieces]
    assert [v.box_sizes[0] for v in vocab] == [25, 25] and vocab[1].shape == (50, 32)


def test_tied_embedding_and_head_are_one_parameter_on_every_shard():
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    plan = llama_plan(tied)
    assert plan.ties == (("embed_tokens.weight", "lm_head.weight"),)
    model = _rank(tied, 0).chunks[0]
    assert model.lm_head.weight is model.embed_tokens.weight
    assert [n for n, _ in _rank(tied, 0).named_parameters()].count("embed_tokens.weight") == 1
    last = parallelize(family("llama").create(tied), plan, pp_rank=1, pp_size=2)
    assert last.cross_stage_ties == ["lm_head.weight"]


@pytest.mark.parametrize("tp, ok", [(1, True), (2, True), (3, False), (4, False)])
def test_tp_must_split_whole_kv_heads(tp, ok):
    if ok:
        check_llama_tp(CFG, tp)
        return
    with pytest.raises(ValueError) as err:
        check_llama_tp(CFG, tp)
    assert f"--tp {tp} cannot split the model's 2 key/value heads" in str(err.value)
    assert "valid: --tp 1, 2" in str(err.value)


# ---------------------------------------------------------------- configs and files
def test_config_json_both_formats_and_back(tmp_path):
    save_hf_llama(tmp_path, tie=True, rope_scaling=LLAMA3_SCALING)
    sizes = llama_sizes(read_config(tmp_path), "d")  # transformers 5: rope_parameters
    assert sizes["rope_theta"] == 500000.0 and sizes["tie_embeddings"] is True
    assert sizes["rope_scaling"] == LLAMA3_SCALING and sizes["n_kv_head"] == 2
    legacy = hf_config(LlamaConfig(**sizes))  # what we export: transformers 4's keys
    assert legacy["rope_theta"] == 500000.0 and legacy["rope_scaling"] == LLAMA3_SCALING
    assert llama_sizes(legacy, "d") == sizes


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"attention_bias": True}, "attention_bias true"),
        ({"num_key_value_heads": 3}, "--n-kv-head 3 does not divide --n-head 4"),
    ],
)
def test_config_json_refused(tmp_path, change, message):
    save_hf_llama(tmp_path)
    config = {**read_config(tmp_path), **change}  # rope_scaling wins over rope_parameters
    with pytest.raises(ValueError, match=message):
        llama_sizes(config, "d")


def test_reading_a_piece_reads_its_box_and_flat_run(tmp_path):
    model = save_hf_llama(tmp_path)
    full = model.state_dict()["model.layers.0.mlp.down_proj.weight"]  # (64, 96)
    weights = SafetensorsDir(tmp_path)
    piece = Piece.box("x", full.shape, (0, 48), (64, 48))  # tp rank 1 of a row split
    for start, end in [(0, 3072), (5, 50), (47, 49), (3000, 3072), (7, 7)]:
        expected = full[:, 48:].reshape(-1)[start:end]
        got = weights.read("model.layers.0.mlp.down_proj.weight", piece.flat(start, end))
        assert torch.equal(got, expected), (start, end)
    cfg = LlamaConfig(**llama_sizes(read_config(tmp_path), "d"))
    assert hf_shapes(cfg) == {name: tuple(t.shape) for name, t in model.state_dict().items()}


def test_bf16_weights_are_read_as_float32(tmp_path):
    from safetensors.torch import save_file

    full = torch.randn(6, 4).to(torch.bfloat16)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    got = SafetensorsDir(tmp_path).read("w", Piece.box("w", (6, 4), (2, 0), (3, 4)).flat(1, 9))
    assert got.dtype == torch.float32 and torch.equal(got, full[2:5].float().reshape(-1)[1:9])


def test_swiglu_keeps_its_inputs_only_and_differentiates_as_autograd():
    from meshwise.models.llama import swiglu

    gate, up = (torch.randn(3, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(swiglu, (gate, up))
    out = swiglu(gate, up)
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_backward_is_autograds_bit_for_bit_in_four_kernels(dtype):
    """autograd's three (it keeps silu(gate)) and the recomputed silu: no more."""
    from torch.profiler import profile

    from meshwise.models.llama import swiglu

    gate, up = (torch.randn(4, 6, 40, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(4, 6, 40, dtype=dtype)
    reference = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), grad)
    out = swiglu(gate, up)
    with profile() as prof:
        got = torch.autograd.grad(out, (gate, up), grad)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    plumbing = ("empty", "view", "strided", "detach", "alias", "resize")
    kernels = [
        e.name
        for e in prof.events()
        if e.name.startswith("aten::") and not any(w in e.name for w in plumbing)
    ]
    assert len(kernels) <= 4, kernels


def test_grouped_query_attention_keeps_kv_heads_unrepeated():
    """The kv heads reach attention (and its saved tensors) as they are, not repeated."""
    from meshwise.models.llama import Llama, LlamaConfig

    model = Llama(
        LlamaConfig(n_layer=1, n_head=4, n_kv_head=1, d_model=32, ffn_hidden_size=48)
    ).init_weights(0)
    seen = []
    model.layers["0"].self_attn.sdpa.register_forward_hook(
        lambda module, args, out: seen.append([t.shape[1] for t in args[:3]])
    )
    model(torch.randint(0, 256, (1, 8)))
    assert seen == [[4, 1, 1]]
