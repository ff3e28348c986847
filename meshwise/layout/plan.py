"""Parallel plans: how a plain single-device model is laid out (pure data).

A model is written for one device (``meshwise.models``); its family's plan says
what parallelism does to it, and ``meshwise.apply.parallelize`` applies the plan
without touching the model's code (as torchtitan's ``parallelize_module`` plans
and picotron's ``apply_tensor_parallel`` do):

- ``tp``: which modules become tensor parallel, by path pattern (``*`` matches
  one component, e.g. ``blocks.*.attn.qkv``) and style:

  ``colwise``
      an ``nn.Linear`` whose output features are split (Megatron's column
      parallel layer); its output stays split.
  ``rowwise``
      an ``nn.Linear`` whose input features are split; the partial outputs are
      summed over tp (row parallel); its bias is added once, after the sum.
  ``vocab_embedding``
      an ``nn.Embedding`` whose rows (the vocabulary) are split, padded to a
      multiple of tp.
  ``vocab_head``
      the output ``nn.Linear`` over the vocabulary, split like the embedding;
      its logits stay split and the loss is computed from the shards.
  ``shard_norm``
      an RMSNorm (``weight`` and ``eps``) applied to each head of a split
      activation (Qwen3's q/k norms): replicated, its gradient summed over tp.

- ``layers``: the ``nn.ModuleDict`` of repeated layers, keyed by their global
  index, in order. Pipeline stages are cut from it (a stage keeps its layers
  under their global keys, so parameter names never depend on the layout), and
  each layer is a ZeRO-3 unit.
- ``first_stage`` / ``last_stage``: the modules that run before / after the
  layers; a pipeline stage that does not hold them has them set to ``None``, so
  the model's forward must skip a missing module (``if self.wte is not None``).
- ``ties``: parameters that are one tensor (a tied embedding and output head).
  The first name of a tie is its logical name (what checkpoints store); when a
  pipeline puts the members on different stages (only the first and the last
  stage may share a tie), each holds a copy and their gradients are summed.

The model's own code must use ``-1`` (or the local size) where a split dimension
is reshaped (``view(B, T, -1, head_dim)``), so the same code runs on a shard.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

TP_STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head", "shard_norm")


@dataclass(frozen=True)
class ParallelPlan:
    """What tensor parallelism, pipeline cuts, ZeRO-3 units and ties are for one model."""

    layers: str
    first_stage: tuple[str, ...] = ()
    last_stage: tuple[str, ...] = ()
    tp: tuple[tuple[str, str], ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self):
        for pattern, style in self.tp:
            if style not in TP_STYLES:
                raise ValueError(f"plan: style {style!r} for {pattern!r}; valid: "
                                 f"{', '.join(TP_STYLES)}")
        names = [n for tie in self.ties for n in tie]
        if len(names) != len(set(names)):
            raise ValueError("plan: a parameter is listed in two ties")

    def tp_match(self, module_path: str) -> tuple[str, str] | None:
        """The first ``(pattern, style)`` matching ``module_path`` (None: replicated)."""
        parts = module_path.split(".")
        for pattern, style in self.tp:
            pattern_parts = pattern.split(".")
            if len(parts) == len(pattern_parts) and all(
                    fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern_parts)):
                return pattern, style
        return None

    def tp_style(self, module_path: str) -> str | None:
        """The style of the first pattern matching ``module_path`` (None: replicated)."""
        match = self.tp_match(module_path)
        return match[1] if match else None

    def logical_name(self, name: str) -> str:
        """The name checkpoints and the init use: a tie's first member."""
        for tie in self.ties:
            if name in tie:
                return tie[0]
        return name
