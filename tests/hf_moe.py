"""Small random Hugging Face Mixtral, Qwen3-MoE and Qwen2-MoE folders built in the test (no
downloads): routers drawn wide enough that no two experts tie for a token."""

from __future__ import annotations

import torch

from tests.hf_llama import save_hf_llama

# name -> model_type and its MoE sizes on top of tests.hf_llama.HF_SIZES (4 layers, d 64)
MOE_FAMILIES = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # Qwen3-30B-A3B's switches: renormalised top-k; here also a leading dense layer and
    # experts every second layer (MoE layers 1 and 3)
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        head_dim=32,
        decoder_sparse_step=2,
        mlp_only_layers=[0],
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
}


def save_hf_moe(out, name: str, seed: int = 0, **change):
    """A random model of family ``name`` (``MOE_FAMILIES``) saved to ``out`` by
    ``save_pretrained``: one tensor per expert under the published names."""
    model = save_hf_llama(out, seed=seed, **{**MOE_FAMILIES[name], **change})
    shards = {"max_shard_size": change["max_shard_size"]} if "max_shard_size" in change else {}
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)  # routing scores far apart: no near-ties in top-k
            elif ".experts." in param_name:
                param.normal_(0.0, 0.1)  # experts that move the logits
    model.save_pretrained(out, **shards)
    return model
