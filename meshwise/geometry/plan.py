"""Parallel plans (pure data): what parallelism does to a plain model, applied by
``meshwise.apply.parallelize`` without touching its code (as torchtitan's
``parallelize_module`` and picotron's ``apply_tensor_parallel``). Entry by entry:
docs/own-model.md "The plan, entry by entry".
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

TP_STYLES = (
    "colwise",
    "rowwise",
    "vocab_embedding",
    "vocab_head",
    "position_embedding",
    "shard_norm",
)
CP_STYLES = ("positions", "ring_attention")
EP_STYLES = ("experts",)  # stacked expert weights split along dim 0 over ep


@dataclass(frozen=True)
class ParallelPlan:
    """What tensor parallelism, pipeline cuts, ZeRO-3 units and ties are for one model."""

    layers: str
    first_stage: tuple[str, ...] = ()
    last_stage: tuple[str, ...] = ()
    tp: tuple[tuple[str, str], ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()
    cp: tuple[tuple[str, str], ...] = ()
    ep: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for entries, styles in ((self.tp, TP_STYLES), (self.cp, CP_STYLES), (self.ep, EP_STYLES)):
            for pattern, style in entries:
                if style not in styles:
                    raise ValueError(
                        f"plan: style {style!r} for {pattern!r}; valid: {', '.join(styles)}"
                    )
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

    def ep_style(self, module_path: str) -> str | None:
        """What expert parallelism makes of ``module_path`` (None: nothing)."""
        return _style(self.ep, module_path)

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
            fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern_parts)
        ):
            return pattern, style
    return None


def _style(entries: tuple[tuple[str, str], ...], module_path: str) -> str | None:
    match = _match(entries, module_path)
    return match[1] if match else None
