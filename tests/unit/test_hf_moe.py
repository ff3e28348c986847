"""Mixtral, Qwen3-MoE and Qwen2-MoE folders read into meshwise's Llama compute transformers'
logits and aux loss; experts are read one rank's slice at a time (published per-expert names
or transformers 5's fused ones); exports load in transformers; unsupported families refused."""

import json

import pytest
import torch

from meshwise.geometry.pieces import Piece
from meshwise.hf.llama import hf_config, hf_shapes, llama_sizes, read_config
from meshwise.hf.llama_weights import LlamaWeights, stored_tensors
from meshwise.hf.moe import export_family
from meshwise.models.llama import LlamaConfig
from tests.hf_llama import ATOL, hf_logits, laid_out, materialize, token_ids
from tests.hf_moe import MOE_FAMILIES, save_hf_moe

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe")
    for name in MOE_FAMILIES:
        save_hf_moe(root / name, name)
    return root


def _config(directory) -> LlamaConfig:
    return LlamaConfig(**llama_sizes(read_config(directory), str(directory)))


def _our_logits(directory, ids):
    pm, values = laid_out(directory)
    materialize(pm, values)
    with torch.no_grad():
        return pm.chunks[0](ids), pm


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_logits_match_transformers_at_one_rank(moe_dirs, name):
    LlamaWeights(moe_dirs / name, _config(moe_dirs / name)).check()
    ids = token_ids()
    ours, _ = _our_logits(moe_dirs / name, ids)
    diff = (ours - hf_logits(moe_dirs / name, ids)).abs().max().item()
    assert diff <= ATOL, diff


def test_sizes_follow_each_family(moe_dirs):
    mixtral, qwen3, qwen2 = (_config(moe_dirs / name) for name in MOE_FAMILIES)
    assert (mixtral.n_experts, mixtral.experts_per_token, mixtral.norm_topk_prob) == (4, 2, True)
    assert mixtral.moe_ffn_hidden_size in (0, 96) and mixtral.shared_expert_size == 0
    assert (qwen3.moe_ffn_hidden_size, qwen3.first_dense_layers, qwen3.moe_every) == (32, 1, 2)
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.norm_topk_prob
    assert (qwen2.shared_expert_size, qwen2.shared_expert_gate, qwen2.qkv_bias) == (48, True, True)
    assert not qwen2.norm_topk_prob  # transformers' default when config.json names none
    for cfg in (mixtral, qwen3, qwen2):
        assert cfg.aux_loss_formula == "hf-concatenated" and cfg.aux_loss_coef == 0.0


def test_the_aux_loss_coefficient_is_the_folders_when_it_trains_with_one(moe_dirs):
    config = {**read_config(moe_dirs / "qwen3_moe"), "output_router_logits": True}
    config["router_aux_loss_coef"] = 0.02
    assert llama_sizes(config, "d")["aux_loss_coef"] == 0.02


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_config_round_trips_through_export(moe_dirs, name):
    sizes = llama_sizes(read_config(moe_dirs / name), "d")
    exported = hf_config(LlamaConfig(**sizes))
    assert exported["model_type"] == name
    assert llama_sizes(exported, "d") == sizes


def test_shapes_name_every_stored_tensor(moe_dirs):
    from safetensors import safe_open

    for name in MOE_FAMILIES:
        with safe_open(str(moe_dirs / name / "model.safetensors"), "pt") as f:
            stored = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        assert hf_shapes(_config(moe_dirs / name)) == stored, name


def _recording(weights: LlamaWeights) -> list[str]:
    """The stored tensors ``weights`` opens from now on, by name."""
    opened, read = [], weights.files.read

    def read_and_record(name, piece):
        opened.append(name)
        return read(name, piece)

    weights.files.read = read_and_record
    return opened


def test_a_rank_reads_only_its_experts(moe_dirs):
    """Experts 2 and 3 of Mixtral's layer 1 (one rank at ep 2), then a ZeRO run that starts
    inside expert 1 and ends inside expert 2: only those experts' tensors are opened."""
    directory = moe_dirs / "mixtral"
    weights = LlamaWeights(directory, _config(directory))
    opened = _recording(weights)
    shape = (4, 96, 64)
    full = weights.read(Piece.whole("layers.1.mlp.experts.up_proj", shape)).view(shape)
    opened.clear()
    half = Piece.box("layers.1.mlp.experts.up_proj", shape, (2, 0, 0), (2, 96, 64))
    assert torch.equal(weights.read(half).view(2, 96, 64), full[2:])
    assert opened == [f"model.layers.1.block_sparse_moe.experts.{j}.w3.weight" for j in (2, 3)]
    opened.clear()
    per_expert = 96 * 64
    run = Piece.whole("layers.1.mlp.experts.up_proj", shape).flat(
        per_expert + 100, 2 * per_expert + 7
    )
    assert torch.equal(weights.read(run), full.reshape(-1)[per_expert + 100 : 2 * per_expert + 7])
    assert [name.split(".")[5] for name in opened] == ["1", "2"]


def test_transformers_fused_experts_read_as_the_published_ones(moe_dirs, tmp_path):
    """A folder holding transformers 5's in-memory tensors (``experts.gate_up_proj``: gate
    rows then up rows; Mixtral's under ``mlp``) gives the same values, piece by piece."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    directory = moe_dirs / "mixtral"
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors"
    )
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    cfg = _config(directory)
    fused, published = LlamaWeights(tmp_path, cfg), LlamaWeights(directory, cfg)
    fused.check()
    for projection, shape in (
        ("gate_proj", (4, 96, 64)),
        ("up_proj", (4, 96, 64)),
        ("down_proj", (4, 64, 96)),
    ):
        piece = Piece.box(
            f"layers.0.mlp.experts.{projection}", shape, (1, 8, 0), (3, shape[1] - 8, shape[2])
        ).flat(5, 9000)
        assert torch.equal(fused.read(piece), published.read(piece)), projection


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_export_loads_in_transformers_with_our_logits(moe_dirs, tmp_path, name):
    """Our tensors under the published names and our config.json: transformers loads them
    (no missing or unexpected tensor) and computes our logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = export_family(_config(moe_dirs / name))
    ids = token_ids()
    ours, pm = _our_logits(moe_dirs / name, ids)
    tensors = {pm.logical_name(k): v.detach() for k, v in pm.named_parameters()}
    save_file(
        {k: v.contiguous() for k, v in stored_tensors(cfg, tensors).items()},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg)))
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert (hf_logits(tmp_path, ids) - ours).abs().max().item() <= ATOL


def test_a_model_of_our_own_with_experts_exports_as_mixtral():
    cfg = LlamaConfig(n_layer=2, d_model=64, n_head=4, ffn_hidden_size=96, n_experts=4)
    assert export_family(cfg).hf_type == "mixtral"
    with pytest.raises(ValueError, match="router_score 'sigmoid'"):
        export_family(LlamaConfig(n_experts=4, router_score="sigmoid"))
    with pytest.raises(ValueError, match="dense layers"):
        export_family(LlamaConfig(n_layer=4, n_experts=4, first_dense_layers=1))


def test_a_routing_bias_is_not_exported_silently(moe_dirs):
    cfg = _config(moe_dirs / "mixtral")
    bias = {"layers.0.mlp.expert_bias": torch.tensor([0.0, 0.5, 0.0, 0.0])}
    with pytest.raises(ValueError, match="expert_bias is not zero"):
        stored_tensors(cfg, bias)
    assert stored_tensors(cfg, {"layers.0.mlp.expert_bias": torch.zeros(4)}) == {}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "deepseek_v3"}, "multi-head latent attention"),
        ({"model_type": "gpt_oss"}, "attention sinks"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers \[1\]"),
        ({"router_jitter_noise": 0.01}, "router_jitter_noise 0.01"),
        ({"num_experts_per_tok": None}, "lacks num_experts_per_tok"),
        ({"use_sliding_window": True}, "use_sliding_window true"),
    ],
)
def test_what_meshwise_does_not_compute_is_named(moe_dirs, change, message):
    merged = {**read_config(moe_dirs / "qwen3_moe"), **change}
    config = {key: value for key, value in merged.items() if value is not None}  # None: left out
    with pytest.raises(ValueError, match=message):
        llama_sizes(config, "d")


def test_the_aux_loss_of_an_imported_qwen3_moe_is_transformers(moe_dirs):
    """transformers' ``aux_loss`` (``output_router_logits=True``: every MoE layer's tokens
    concatenated) from our router statistics, and its gradient reaches every router."""
    from transformers import AutoModelForCausalLM

    from meshwise.models.context import ForwardContext
    from meshwise.models.router_stats import RouterTally

    directory = moe_dirs / "qwen3_moe"
    cfg = _config(directory)
    pm, values = laid_out(directory)
    materialize(pm, values)
    ids = token_ids()
    tally = RouterTally(aux_scale=1.0, formula=cfg.aux_loss_formula)
    pm.chunks[0](ids, context=ForwardContext(router=tally))
    ours = tally.concatenated_share()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(ids, output_router_logits=True).aux_loss
    assert abs(ours.item() - theirs.item()) <= 1e-6, (ours.item(), theirs.item())
    ours.backward()
    routers = [p for name, p in pm.named_parameters() if name.endswith("mlp.gate.weight")]
    assert len(routers) == 2 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)


@pytest.mark.parametrize("flag, want", [(None, 0.02), (0.5, 0.5), (0.0, 0.0)])
def test_moe_aux_loss_coef_wins_over_the_folders(moe_dirs, tmp_path, flag, want):
    import shutil

    from meshwise.train.config import TrainConfig
    from meshwise.train.init_from import apply_init_from

    directory = shutil.copytree(moe_dirs / "mixtral", tmp_path / "mixtral")
    config = {**read_config(directory), "output_router_logits": True, "router_aux_loss_coef": 0.02}
    (directory / "config.json").write_text(json.dumps(config))
    cfg, origins = TrainConfig(), {}
    cfg.model.init_from = str(directory)
    if flag is not None:
        cfg.model.aux_loss_coef, origins["aux_loss_coef"] = flag, "flag"
    apply_init_from(cfg, origins)
    assert cfg.model.aux_loss_coef == want and cfg.model.n_experts == 4
