"""What the launcher learns after a local rank failed: its last words and every ledger.

The ranks share a folder holding each one's ledger file (``MESHWISE_LEDGER_DIR``) and a
watchdog's one-line reason (``MESHWISE_FAILURE_DIR``); a rank killed by a signal (gloo
aborting on mismatched sizes) says nothing, but the ledgers still name who diverged.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from meshwise.comm.checks import diagnose
from meshwise.comm.checks.context import LEDGER_DIR_ENV
from meshwise.comm.checks.ledger import read_ledgers, write_dumps
from meshwise.comm.checks.watchdog import FAILURE_DIR_ENV


class JobFolder:
    """The shared folder of one local launch (a context manager)."""

    def __init__(self, ledger_out: str | os.PathLike | None = None):
        self.ledger_out = ledger_out
        self._tmp = tempfile.TemporaryDirectory(prefix="meshwise-job-")
        self.ledgers = Path(self._tmp.name, "ledgers")
        self.notes = Path(self._tmp.name, "notes")
        self.ledgers.mkdir()
        self.notes.mkdir()

    def env(self) -> dict[str, str]:
        """What every rank's environment must hold."""
        return {LEDGER_DIR_ENV: str(self.ledgers), FAILURE_DIR_ENV: str(self.notes)}

    def explain(self, rank: int, message: str, silent: bool = False) -> str:
        """The launcher's line for a failed ``rank``: its own note when it left one,
        and what the ledgers show: a divergence always; which rank was behind only
        for a rank that died ``silent`` (a signal, no traceback of its own)."""
        note = self.notes / f"rank-{rank}.txt"
        if note.is_file():
            return f"rank {rank}: {note.read_text().strip()}"
        dumps = read_ledgers(self.ledgers)
        finding = diagnose.explain(dumps)
        if finding is None or (finding.kind != "diverged" and not silent):
            return message
        where = ""
        if self.ledger_out is not None:
            try:
                where = f" (ledgers: {write_dumps(dumps, self.ledger_out)})"
            except OSError:
                pass
        return f"{message}; collective ledger: {finding}{where}"

    def __enter__(self) -> "JobFolder":
        return self

    def __exit__(self, *exc) -> None:
        self._tmp.cleanup()
