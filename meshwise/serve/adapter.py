"""A LoRA run's checkpoint as a PEFT adapter (``meshwise export --format peft``): the
adapters, read whole from whatever layout saved them, under PEFT's names, with the
``adapter_config.json`` of the run's ``--lora-*`` settings; or merged into the frozen
weights (``--merge-lora``), which the run rebuilt from ``--init-from`` or ``--seed``
(and, under ``--quantize-base nf4``, held as NF4: merged into those dequantised values).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from meshwise.apply.lora import ADAPTER_NAMES, is_adapter
from meshwise.apply.nf4 import dequantize_nf4, quantizable_layers, quantize_nf4
from meshwise.checkpoint.state import model_tensors
from meshwise.checkpoint.store import Checkpoint
from meshwise.geometry.init import full_init, on_meta
from meshwise.geometry.pieces import Piece
from meshwise.hf import peft
from meshwise.models.families import family


def trained_adapters(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint's run trained LoRA adapters (and holds only them)."""
    return bool((ckpt.meta.get("config", {}).get("lora") or {}).get("lora_rank"))


def lora_settings(ckpt: Checkpoint) -> dict:
    """The run's ``--lora-*`` settings (ValueError when it trained no adapter)."""
    lora = ckpt.meta.get("config", {}).get("lora") or {}
    if not lora.get("lora_rank"):
        raise ValueError(
            f"{ckpt.path}: this run trained no LoRA adapter (--lora-rank 0); valid: "
            "--format safetensors or hf"
        )
    return lora


def export_adapter(ckpt: Checkpoint, out: Path) -> Path:
    """Write the checkpoint's adapters to the new directory ``out``, complete or not at all."""
    lora = lora_settings(ckpt)
    if ckpt.meta["model"].get("family", "gpt") != "llama":
        raise ValueError(
            f"{ckpt.path}: --format peft writes adapters of a {peft.FAMILIES} model, not "
            f"of a {ckpt.meta['model'].get('family', 'gpt')} model; valid: --format hf "
            "--merge-lora"
        )
    tensors = {n: t for n, t in model_tensors(ckpt).items() if is_adapter(n)}
    targets = {n.split(".")[-2] for n in tensors}
    base = ckpt.meta.get("config", {}).get("model", {}).get("init_from") or ""
    config = peft.adapter_config(
        lora["lora_rank"], lora["lora_alpha"], lora["lora_dropout"], targets, base
    )
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    peft.write_adapter(tmp, tensors, config)
    os.rename(tmp, out)
    return out


@torch.no_grad()
def merged_tensors(ckpt: Checkpoint, cfg, family_name: str) -> dict[str, torch.Tensor]:
    """The model's weights with each adapter merged in, ``W + (B @ A) * alpha / r``: the
    frozen weights as the run built them (``--init-from``'s files, else drawn from the
    run's seed), the adapters from the checkpoint."""
    lora = lora_settings(ckpt)
    run = ckpt.meta["config"]
    fam = family(family_name)
    with on_meta():
        model = fam.build(cfg)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    init_from = run["model"].get("init_from")
    if init_from:
        from meshwise.hf.gpt2 import GPT2Weights
        from meshwise.hf.llama_weights import LlamaWeights

        is_gpt = family_name == "gpt"
        weights = GPT2Weights(init_from, cfg.n_head) if is_gpt else LlamaWeights(init_from, cfg)
        read = lambda name, shape: weights.read(Piece.whole(name, shape))  # noqa: E731
    else:
        seed, init = run["data"]["seed"], fam.init
        assert init is not None, f"model family {family_name!r} draws no initial values"
        read = lambda name, shape: full_init(init(cfg, name), seed, name, shape)  # noqa: E731
    tensors = {name: read(name, shape).reshape(shape) for name, shape in shapes.items()}
    if lora.get("quantize_base", "none") == "nf4":  # the base the run computed with
        for path, _ in quantizable_layers(model, fam.plan(cfg).last_stage):
            weight = tensors[f"{path}.weight"]
            tensors[f"{path}.weight"] = dequantize_nf4(*quantize_nf4(weight), weight.shape)
    adapters = {n: t for n, t in model_tensors(ckpt).items() if is_adapter(n)}
    for name in adapters:
        if name.endswith(ADAPTER_NAMES[0]):
            layer = name.rpartition(".")[0]
            a, b = adapters[name], adapters[f"{layer}.{ADAPTER_NAMES[1]}"]
            tensors[f"{layer}.weight"] += (b.float() @ a.float()) * (
                lora["lora_alpha"] / lora["lora_rank"]
            )
    return tensors
