"""A checkpoint as one unsharded model that needs no meshwise (``meshwise export``).

``safetensors``: ``model.safetensors`` and ``config.json``; ``hf``: a directory transformers
loads (the GPT as ``GPT2LMHeadModel``, QKV regrouped and weights transposed; Llama-family
models under their architecture) with the tokenizer. It appears complete or not at all.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from meshwise.checkpoint.state import model_tensors
from meshwise.checkpoint.store import open_checkpoint
from meshwise.hf.llama import hf_config
from meshwise.hf.llama_weights import stored_tensors
from meshwise.hf.moe import export_family
from meshwise.serve.adapter import export_adapter, merged_tensors, trained_adapters
from meshwise.serve.model import model_config, model_family

FORMATS = ("safetensors", "hf", "peft")
# model_type -> the tokenizer class transformers 5 builds for it whatever tokenizer_class
# says: from tokenizer.json's vocabulary and merges alone, under its own pre-tokenizer.
REBUILT_TOKENIZERS = {"qwen2": "Qwen2Tokenizer"}
log = logging.getLogger("meshwise")


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str = "safetensors",
    merge_lora: bool = False,
) -> Path:
    """Write ``checkpoint``'s model to the new directory ``out`` in format ``fmt``
    (``FORMATS``); ``merge_lora``: a LoRA run's adapters merged into its frozen weights.
    ``ValueError`` names what cannot be done."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not valid; valid: {', '.join(FORMATS)}")
    ckpt = open_checkpoint(checkpoint)
    out = Path(out)
    if out.exists():
        raise ValueError(f"--out {out}: already exists; choose a new directory")
    if fmt == "peft":
        if merge_lora:
            raise ValueError("--merge-lora makes a whole model; valid: --format hf or safetensors")
        return export_adapter(ckpt, out)
    if trained_adapters(ckpt) and not merge_lora:
        raise ValueError(
            f"{ckpt.path}: a LoRA run's checkpoint holds its adapters only; valid: "
            "--format peft, or --merge-lora for the whole model"
        )
    cfg = model_config(ckpt)
    family = model_family(ckpt)
    tensors = merged_tensors(ckpt, cfg, family) if merge_lora else model_tensors(ckpt)
    if fmt == "hf" and family == "llama":
        cfg = export_family(cfg)  # a model with experts: the MoE family that holds it
        config = hf_config(cfg)
        tensors = stored_tensors(cfg, tensors)
    elif fmt == "hf":
        tensors, config = _to_gpt2(tensors, cfg), _gpt2_config(cfg)
    else:
        tied = family == "gpt" or cfg.tie_embeddings
        config = {
            "architecture": f"meshwise-{family}",
            **ckpt.meta["model"],
            "tied_embeddings": tied,
            "step": ckpt.step,
        }
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(tmp / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fmt == "hf":
        _copy_tokenizer(ckpt, tmp, config["model_type"])
    os.rename(tmp, out)
    return out


def _copy_tokenizer(ckpt, out: Path, model_type: str) -> None:
    """The checkpoint's tokenizer.json, if it is still where training read it and
    unchanged (by digest), with what transformers needs to load it as it is."""
    from meshwise.data.tokenizer import load_unchanged

    data = ckpt.meta.get("config", {}).get("data", {})
    path, digest = data.get("tokenizer"), data.get("tokenizer_digest")
    if not path:
        return
    tokenizer = load_unchanged(path, digest)
    if tokenizer is None:
        log.warning(
            "meshwise export: the tokenizer %s is gone or changed since training; "
            "copy it into the export yourself",
            path,
        )
        return
    if tokenizer.path is None:  # byte-level: no file to copy
        return
    write_tokenizer(Path(tokenizer.path), out, model_type)


def write_tokenizer(source: Path, out: Path, model_type: str) -> None:
    """Copy ``source`` (a tokenizer.json) into ``out`` with the tokenizer_config.json and
    special_tokens_map.json beside it, else a tokenizer_config.json naming the fast
    tokenizer class, so that ``AutoTokenizer`` encodes as ``source`` does."""
    shutil.copyfile(source, out / "tokenizer.json")
    if source.with_name("special_tokens_map.json").is_file():
        shutil.copyfile(
            source.with_name("special_tokens_map.json"), out / "special_tokens_map.json"
        )
    config_file = source.with_name("tokenizer_config.json")
    config = (
        json.loads(config_file.read_text())
        if config_file.is_file()
        else {"tokenizer_class": "PreTrainedTokenizerFast"}
    )
    declared = str(config.get("tokenizer_class") or "PreTrainedTokenizerFast")
    rebuilt = REBUILT_TOKENIZERS.get(model_type)
    if rebuilt and declared.removesuffix("Fast") != rebuilt:
        # An AutoTokenizer entry is what transformers 5 honours over its own class for
        # this model_type: without trust_remote_code it builds tokenizer_class from
        # tokenizer.json as trained (and transformers 4 did that anyway).
        config["auto_map"] = {"AutoTokenizer": [None, declared]}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _to_gpt2(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    hd = cfg.d_model // cfg.n_head
    out = {
        "transformer.wte.weight": tensors["wte.weight"],
        "transformer.wpe.weight": tensors["wpe.weight"],
        "transformer.ln_f.weight": tensors["ln_f.weight"],
        "transformer.ln_f.bias": tensors["ln_f.bias"],
    }
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        # Our QKV rows are (n_head, 3, hd); GPT-2's c_attn columns are (3, n_head, hd).
        qkv_w = tensors[ours + "attn.qkv.weight"].view(cfg.n_head, 3, hd, cfg.d_model)
        qkv_b = tensors[ours + "attn.qkv.bias"].view(cfg.n_head, 3, hd)
        out[theirs + "attn.c_attn.weight"] = qkv_w.transpose(0, 1).reshape(-1, cfg.d_model).t()
        out[theirs + "attn.c_attn.bias"] = qkv_b.transpose(0, 1).reshape(-1)
        for mine, gpt2 in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[theirs + gpt2 + ".weight"] = tensors[ours + mine + ".weight"]
            out[theirs + gpt2 + ".bias"] = tensors[ours + mine + ".bias"]
        for mine, gpt2 in (
            ("attn.proj", "attn.c_proj"),
            ("mlp.fc", "mlp.c_fc"),
            ("mlp.proj", "mlp.c_proj"),
        ):
            # Conv1D keeps its weight as (in, out), the transpose of ours.
            out[theirs + gpt2 + ".weight"] = tensors[ours + mine + ".weight"].t()
            out[theirs + gpt2 + ".bias"] = tensors[ours + mine + ".bias"]
    return out


def _gpt2_config(cfg) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": 4 * cfg.d_model,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
