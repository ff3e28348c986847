"""How a Llama is laid out and initialised: its ``ParallelPlan`` (tensor, context and expert
parallelism, ties), Hugging Face's initialisation per parameter, and the tensor-parallel
degrees that split it.
"""

from __future__ import annotations

from meshwise.geometry.init import ONES, ZEROS, Init, normal
from meshwise.geometry.plan import ParallelPlan
from meshwise.models.llama_config import LlamaConfig
from meshwise.models.moe import is_moe_layer


def llama_plan(cfg: LlamaConfig) -> ParallelPlan:
    """Megatron-LM's layout (Shoeybi et al. 2019, section 3) for Llama: whole query and
    key/value heads per tp rank, the vocabulary split; under cp, positions and a ring.
    """
    return ParallelPlan(
        layers="layers",
        first_stage=("embed_tokens",),
        last_stage=("norm", "lm_head"),
        tp=(
            ("embed_tokens", "vocab_embedding"),
            ("layers.*.self_attn.q_proj", "colwise"),
            ("layers.*.self_attn.k_proj", "colwise"),
            ("layers.*.self_attn.v_proj", "colwise"),
            ("layers.*.self_attn.o_proj", "rowwise"),
            *(
                (
                    ("layers.*.mlp.gate_proj", "colwise"),
                    ("layers.*.mlp.up_proj", "colwise"),
                    ("layers.*.mlp.down_proj", "rowwise"),
                )
                if any(not is_moe_layer(cfg, i) for i in range(cfg.n_layer))
                else ()
            ),
            *(
                (
                    ("layers.*.mlp.shared_expert.gate_proj", "colwise"),
                    ("layers.*.mlp.shared_expert.up_proj", "colwise"),
                    ("layers.*.mlp.shared_expert.down_proj", "rowwise"),
                )
                if cfg.n_experts and cfg.shared_expert_size
                else ()
            ),
            ("lm_head", "vocab_head"),
            *(
                (
                    ("layers.*.self_attn.q_norm", "shard_norm"),
                    ("layers.*.self_attn.k_norm", "shard_norm"),
                )
                if cfg.qk_norm
                else ()
            ),
        ),
        cp=(("positions", "positions"), ("layers.*.self_attn.sdpa", "ring_attention")),
        ties=(("embed_tokens.weight", "lm_head.weight"),) if cfg.tie_embeddings else (),
        ep=(("layers.*.mlp.experts", "experts"),) if cfg.n_experts else (),
    )


def llama_init(cfg: LlamaConfig, name: str) -> Init:
    """Hugging Face's ``LlamaForCausalLM`` initialisation: N(0, 0.02) for every
    linear and embedding weight, ones for the RMSNorm weights, zeros for biases."""
    if name.endswith("norm.weight"):
        return ONES
    if name.endswith(".bias") or name.endswith("expert_bias"):
        return ZEROS
    return normal(0.02)  # the router and the stacked expert weights too


def valid_llama_tp(cfg: LlamaConfig) -> list[int]:
    """Tensor-parallel degrees that split whole query and key/value heads and the MLP."""
    return [
        t
        for t in range(1, cfg.n_kv_head + 1)
        if cfg.n_kv_head % t == 0
        and cfg.n_head % t == 0
        and cfg.ffn_hidden_size % t == 0
        and cfg.shared_expert_size % t == 0
    ]


def check_llama_tp(cfg: LlamaConfig, tp: int) -> None:
    """Each tp rank holds whole key/value heads with their query groups, so tp must
    divide the key/value heads (a fortiori the query heads) and the MLP width.
    Replicating key/value heads across ranks (as some frameworks do when tp
    exceeds them) is not supported."""
    if tp in valid_llama_tp(cfg):
        return
    valid = ", ".join(map(str, valid_llama_tp(cfg)))
    raise ValueError(
        f"--tp {tp} cannot split the model's {cfg.n_kv_head} key/value heads, "
        f"{cfg.n_head} query heads and MLP width {cfg.ffn_hidden_size}: each tp "
        f"rank must hold whole key/value heads; valid: --tp {valid}"
    )
