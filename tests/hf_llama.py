"""Small random Hugging Face Llamas built in the test (no downloads), and meshwise's
model of the same directory, laid out on any layout and filled from its files."""

from __future__ import annotations

import torch

from meshwise.apply.parallelize import parallelize
from meshwise.hf.llama import llama_sizes, read_config
from meshwise.hf.llama_weights import LlamaWeights
from meshwise.models.llama import Llama, LlamaConfig, llama_plan
from meshwise.sharding.binding import param_owners, rebind

# 4 layers (pp 2 x 2 virtual stages), GQA with 2 kv heads (tp 2), an odd vocabulary
# (padded under tp 2).
HF_SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=301,
    max_position_embeddings=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
ATOL = 1e-5


def save_hf_llama(
    out,
    tie: bool = False,
    rope_scaling: dict | None = None,
    max_shard_size: str | None = None,
    seed: int = 0,
    model_type: str = "llama",
    **sizes,
):
    """A random ``LlamaForCausalLM`` (or Mistral, Qwen2, Qwen3 by ``model_type``; norm
    weights and biases random too) saved to ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    scaling = {"rope_scaling": dict(rope_scaling)} if rope_scaling else {}  # it edits it
    config = AutoConfig.for_model(
        model_type, **{**HF_SIZES, **sizes}, tie_word_embeddings=tie, **scaling
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return model


def hf_logits(directory, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def token_ids(vocab_size: int = HF_SIZES["vocab_size"], shape=(2, 24), seed: int = 0):
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def laid_out(
    directory,
    tp_group=None,
    pp_rank: int = 0,
    pp_size: int = 1,
    virtual_stages: int = 1,
    cp_group=None,
    sequence_parallel: bool = False,
    tie_group=None,
    ep_group=None,
):
    """meshwise's ``ParallelModel`` of ``directory`` (on the meta device) and the
    ``values(name, start, end)`` that read its slices from the files."""
    cfg = LlamaConfig(**llama_sizes(read_config(directory), str(directory)))
    with torch.device("meta"):
        model = Llama(cfg)
    pm = parallelize(
        model,
        llama_plan(cfg),
        tp_group=tp_group,
        pp_rank=pp_rank,
        pp_size=pp_size,
        virtual_stages=virtual_stages,
        cp_group=cp_group,
        sequence_parallel=sequence_parallel,
        tie_group=tie_group,
        ep_group=ep_group,
    )
    return pm, pm.values_from(LlamaWeights(directory, cfg).read)


def materialize(pm, values) -> None:
    """Give every parameter its values in one process, as an engine would (ties kept)."""
    owners = param_owners(pm.chunks)
    for name, param in pm.named_parameters():
        rebind(param, values(name, 0, param.numel()).view(param.shape), owners)


GPT2_SIZES = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=301, n_positions=64)


def save_gpt2(out, prefix: bool = True, **change):
    """A random ``GPT2LMHeadModel`` (biases and LayerNorms random too) saved to ``out``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**{**GPT2_SIZES, **change})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "ln" in name:
                param.normal_(0.5 if "ln" in name and name.endswith("weight") else 0.0, 0.2)
    model.save_pretrained(out)
    if not prefix:  # the original checkpoints' names: no "transformer." prefix
        from safetensors.torch import load_file, save_file

        tensors = load_file(out / "model.safetensors")
        save_file(
            {
                k.removeprefix("transformer."): v
                for k, v in tensors.items()
                if not k.startswith("lm_head")
            },
            out / "model.safetensors",
        )
