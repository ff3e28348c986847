"""A LoRA run's checkpoint as a PEFT adapter (``meshwise export --format peft``): the
adapters, read whole from whatever layout saved them, under PEFT's names, with the
``adapter_config.json`` of the run's ``--lora-*`` settings.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from meshwise.apply.lora import is_adapter
from meshwise.checkpoint.state import model_tensors
from meshwise.checkpoint.store import Checkpoint
from meshwise.hf import peft


def lora_settings(ckpt: Checkpoint) -> dict:
    """The run's ``--lora-*`` settings (ValueError when it trained no adapter)."""
    lora = ckpt.meta.get("config", {}).get("lora") or {}
    if not lora.get("rank"):
        raise ValueError(
            f"{ckpt.path}: this run trained no LoRA adapter (--lora-rank 0); valid: "
            "--format safetensors or hf"
        )
    return lora


def export_adapter(ckpt: Checkpoint, out: Path) -> Path:
    """Write the checkpoint's adapters to the new directory ``out``, complete or not at all."""
    lora = lora_settings(ckpt)
    tensors = {n: t for n, t in model_tensors(ckpt).items() if is_adapter(n)}
    targets = {n.split(".")[-2] for n in tensors}
    base = ckpt.meta.get("config", {}).get("model", {}).get("init_from") or ""
    config = peft.adapter_config(
        lora["rank"], lora["alpha"], lora["adapter_dropout"], targets, base
    )
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    peft.write_adapter(tmp, tensors, config)
    os.rename(tmp, out)
    return out
