"""Mistral, Qwen2 and Qwen3 read into meshwise's Llama compute transformers' logits,
and their configs round-trip; what meshwise does not compute is refused by name."""

import pytest
import torch

from meshwise.hf.llama import hf_config, hf_shapes, llama_sizes, read_config
from meshwise.hf.safetensors_dir import SafetensorsDir
from meshwise.models.llama import LlamaConfig, window_mask
from tests.hf_llama import ATOL, hf_logits, laid_out, materialize, save_hf_llama, token_ids

pytest.importorskip("transformers")

# model_type, what save_hf_llama is given on top of its sizes
FAMILIES = {
    "qwen2-tied": ("qwen2", dict(tie=True)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),  # its own head size: 4 x 32 != hidden 64
    "qwen3-tied": ("qwen3", dict(tie=True)),
    "mistral-window": ("mistral", dict(sliding_window=8)),  # 24 tokens: the window bites
}


def save_family(directory, name: str, **extra):
    model_type, kwargs = FAMILIES[name]
    return save_hf_llama(directory, model_type=model_type, **kwargs, **extra)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers_at_tp1(tmp_path, name):
    save_family(tmp_path, name)
    sizes = llama_sizes(read_config(tmp_path), str(tmp_path))
    SafetensorsDir(tmp_path).check(
        hf_shapes(LlamaConfig(**sizes)), ("lm_head.weight",) if sizes["tie_embeddings"] else ()
    )
    pm, values = laid_out(tmp_path)
    materialize(pm, values)
    ids = token_ids()
    with torch.no_grad():
        diff = (pm.chunks[0](ids) - hf_logits(tmp_path, ids)).abs().max().item()
    assert diff <= ATOL, diff


@pytest.mark.parametrize("name", list(FAMILIES))
def test_config_round_trips_through_export(tmp_path, name):
    save_family(tmp_path, name)
    sizes = llama_sizes(read_config(tmp_path), "d")
    exported = hf_config(LlamaConfig(**sizes))
    assert exported["model_type"] == FAMILIES[name][0]
    assert llama_sizes(exported, "d") == sizes


def test_the_sliding_window_sees_itself_and_the_keys_before_it():
    mask = window_mask(2, 5, 3, "cpu")  # queries at positions 3 and 4 of 5 keys
    assert mask.tolist() == [[False, True, True, True, False], [False, False, True, True, True]]
    assert window_mask(4, 4, 4, "cpu") is None  # the window covers every key: plain causal


@pytest.mark.parametrize(
    "model_type, change, message",
    [
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window true"),
        (
            "qwen3",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "'yarn' is not supported",
        ),
        ("mistral", {"num_local_experts": 8}, r"MoE blocks \(num_local_experts 8\)"),
        (
            "qwen2",
            {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]},
            "model_type 'deepseek_v3' needs multi-head latent attention",
        ),
    ],
)
def test_features_meshwise_does_not_compute_are_named(tmp_path, model_type, change, message):
    save_hf_llama(tmp_path, model_type=model_type)
    config = {**read_config(tmp_path), **change}
    with pytest.raises(ValueError, match=message):
        llama_sizes(config, "d")


def test_a_directory_without_config_json_names_every_family_read(tmp_path):
    with pytest.raises(
        ValueError,
        match="no config.json there; expected a Hugging Face "
        "Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE or GPT-2 directory",
    ):
        read_config(tmp_path)
