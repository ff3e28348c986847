"""Which run wrote a checkpoint, and which checkpoints a run may call its own.

A manifest records ``{"run": id, "ancestors": [[parent_id, step], ...]}``; a run's lineage
is its own checkpoints plus each ancestor's up to the step it branched off at, and
``--keep-last`` prunes only inside it (docs/checkpoints.md "Lineages and branches").
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

KEY = "lineage"


def new_run_id() -> str:
    """Sortable by start time, unique without coordination: ``20250102-130405-9f2c1a``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class Lineage:
    run: str | None
    ancestors: tuple[tuple[str | None, int], ...] = ()

    @classmethod
    def of(cls, meta: dict) -> "Lineage":
        """The lineage recorded in a checkpoint's metadata; a nameless run if none (written
        before lineages existed: a run resumed from one adopts its older checkpoints alike)."""
        recorded = meta.get(KEY)
        if not isinstance(recorded, dict):
            return cls(None)
        ancestors = tuple((run, int(step)) for run, step in recorded.get("ancestors", []))
        return cls(recorded.get("run"), ancestors)

    def to_meta(self) -> dict:
        return {"run": self.run, "ancestors": [list(a) for a in self.ancestors]}

    def resumed_by(self, run: str, step: int) -> "Lineage":
        """The lineage of ``run`` starting from this lineage's checkpoint of ``step``.

        A restart of the same run (``--max-restarts``) stays that run."""
        if run == self.run:
            return self
        return Lineage(run, ((self.run, step), *self.ancestors))

    def holds(self, meta: dict) -> bool:
        """Whether the checkpoint with metadata ``meta`` belongs to this lineage."""
        theirs, step = Lineage.of(meta).run, int(meta.get("step", -1))
        if theirs is not None and theirs == self.run:
            return True
        return any(run == theirs and step <= upto for run, upto in self.ancestors)
