"""PEFT LoRA adapters on disk: ``adapter_config.json`` and ``adapter_model.safetensors``
with PEFT's tensor names (``base_model.model.<Hugging Face module>.lora_A.weight``), as
``peft.PeftModel.save_pretrained`` writes them and ``from_pretrained`` reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from meshwise.geometry.pieces import Piece
from meshwise.hf.llama import hf_name

# The families whose modules PEFT names as transformers' Llama does (GPT-2's fused Conv1D
# layers have other names and a transposed weight: not supported).
FAMILIES = "Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE or Qwen2-MoE"
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# Options of PEFT's LoraConfig that change the adapter's arithmetic: meshwise computes
# only their defaults (plain LoRA, no bias, no per-layer rank or alpha).
PLAIN = {
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "rank_pattern": {},
    "alpha_pattern": {},
}


def peft_name(name: str) -> str:
    """meshwise's ``<module>.lora_A`` -> PEFT's ``base_model.model.<hf module>.lora_A.weight``."""
    return f"{PREFIX}{hf_name(name)}.weight"


def adapter_config(rank: int, alpha: float, dropout: float, targets, base: str = "") -> dict:
    """A PEFT ``LoraConfig`` for a causal language model, as JSON."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base or None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(targets),
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        **PLAIN,
    }


def write_adapter(out, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """``tensors``: meshwise's adapter names -> whole tensors."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stored = {peft_name(n): t.detach().float().contiguous().cpu() for n, t in tensors.items()}
    save_file(stored, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_config(directory) -> dict:
    """The adapter's configuration; ValueError for what is not a plain LoRA adapter."""
    path = Path(directory) / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--lora-from {directory}: no readable {CONFIG} ({exc})") from None
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"--lora-from {directory}: peft_type {config.get('peft_type')!r}; valid: LORA"
        )
    for key, plain in PLAIN.items():
        if config.get(key, plain) not in (plain, None):
            raise ValueError(
                f"--lora-from {directory}: {key} {config[key]!r} is not supported; "
                f"valid: {plain!r} (plain LoRA)"
            )
    return config


class AdapterFile:
    """A PEFT adapter's tensors by meshwise's names; ``read`` gives any piece of one."""

    def __init__(self, directory):
        from safetensors.torch import load_file

        path = Path(directory) / WEIGHTS
        if not path.is_file():
            raise ValueError(f"--lora-from {directory}: {WEIGHTS} is missing")
        self.directory = directory
        self.tensors = load_file(str(path))

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every adapter meshwise holds (name -> logical shape) is stored with that shape."""
        for name, shape in shapes.items():
            stored = self.tensors.get(peft_name(name))
            if stored is None:
                raise ValueError(
                    f"--lora-from {self.directory}: no tensor {peft_name(name)} for {name}; "
                    "its target_modules do not cover --lora-targets"
                )
            if tuple(stored.shape) != tuple(shape):
                raise ValueError(
                    f"--lora-from {self.directory}: {peft_name(name)} is stored as "
                    f"{list(stored.shape)} but the model needs {list(shape)}"
                )

    def read(self, piece: Piece) -> torch.Tensor:
        whole = self.tensors[peft_name(piece.name)]
        box = whole[tuple(slice(o, o + s) for o, s in zip(piece.box_offsets, piece.box_sizes))]
        return box.reshape(-1)[piece.flat_start : piece.flat_end].float()
