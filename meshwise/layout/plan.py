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
  ``position_embedding``
      an ``nn.Embedding`` of learned positions, replicated; under sequence
      parallelism each rank looks up only the positions of its slice.

  With sequence parallelism (``--sp``, Korthikanti et al. 2022) the
  activations between those layers, of shape (batch, sequence, features), hold
  ``1/tp`` of the sequence: a column-parallel layer and the head all-gather
  their input along it, a row-parallel layer and the vocabulary embedding
  reduce-scatter their output along it, and every replicated parameter (norms,
  row-parallel biases, positions) sees only its rank's tokens, so its gradient
  is summed over tp.

- ``cp``: what context parallelism (``--cp``) swaps, by path pattern and style:

  ``positions``
      the model's ``Positions`` module: the positions of this rank's tokens.
  ``ring_attention``
      a ``ScaledDotProductAttention``: ring attention over the cp group.

  A plan without a ``ring_attention`` entry cannot run with ``--cp``.

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
is reshaped (``view(B, T, -1, head_dim)``), so the same code runs on a shard,
and take the sequence length from the tensor it reshapes (a column-parallel
layer's output holds the whole sequence under sequence parallelism, its input
a slice).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

TP_STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head", "position_embedding",
             "shard_norm")
CP_STYLES = ("positions", "ring_attention")


@dataclass(frozen=True)
class ParallelPlan:
    """What tensor parallelism, pipeline cuts, ZeRO-3 units and ties are for one model."""

    layers: str
    first_stage: tuple[str, ...] = ()
    last_stage: tuple[str, ...] = ()
    tp: tuple[tuple[str, str], ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()
    cp: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for entries, styles in ((self.tp, TP_STYLES), (self.cp, CP_STYLES)):
            for pattern, style in entries:
                if style not in styles:
                    raise ValueError(f"plan: style {style!r} for {pattern!r}; valid: "
                                     f"{', '.join(styles)}")
        names = [n for tie in self.ties for n in tie]
        if len(names) != len(set(names)):
            raise ValueError("plan: a parameter is listed in two ties")

    def tp_match(self, module_path: str) -> tuple[str, str] | None:
        """The first ``(pattern, style)`` matching ``module_path`` (None: replicated)."""
        return _match(self.tp, module_path)

    def tp_style(self, module_path: str) -> str | None:
        """The style of the first pattern matching ``module_path`` (None: replicated)."""
        return _style(self.tp, module_path)

    def cp_style(self, module_path: str) -> str | None:
        """What context parallelism makes of ``module_path`` (None: nothing)."""
        return _style(self.cp, module_path)

    @property
    def ring_capable(self) -> bool:
        """Whether the model's attention can run as a ring (``--cp`` > 1)."""
        return any(style == "ring_attention" for _, style in self.cp)

    def logical_name(self, name: str) -> str:
        """The name checkpoints and the init use: a tie's first member."""
        for tie in self.ties:
            if name in tie:
                return tie[0]
        return name


def _match(entries: tuple[tuple[str, str], ...], module_path: str) -> tuple[str, str] | None:
    parts = module_path.split(".")
    for pattern, style in entries:
        pattern_parts = pattern.split(".")
        if len(parts) == len(pattern_parts) and all(
                fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern_parts)):
            return pattern, style
    return None


def _style(entries: tuple[tuple[str, str], ...], module_path: str) -> str | None:
    match = _match(entries, module_path)
    return match[1] if match else None
