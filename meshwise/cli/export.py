"""``meshwise export CKPT --out DIR [--format safetensors|hf]`` (``meshwise.serve.export``)."""

from __future__ import annotations

from meshwise.serve.export import FORMATS, export_checkpoint


def add_export_arguments(parser) -> None:
    parser.add_argument(
        "checkpoint", help="a checkpoint directory, or a --save directory (its newest checkpoint)"
    )
    parser.add_argument("--out", required=True, help="directory to create")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="safetensors",
        help="safetensors: meshwise names + config.json; hf: a Hugging Face "
        "directory (GPT-2 or Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE: the "
        "checkpoint's family, with "
        "the tokenizer); peft: a LoRA run's adapters as PEFT saves them (default "
        "safetensors)",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run: merge its adapters into the frozen weights (the whole model)",
    )


def run_export(args) -> str:
    """What ``meshwise export`` prints."""
    out = export_checkpoint(args.checkpoint, args.out, args.format, args.merge_lora)
    return f"wrote {out}"
