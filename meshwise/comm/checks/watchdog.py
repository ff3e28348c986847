"""Comparing ranks' ledgers through the launch's key-value store, independent of every
process group: ``LedgerExchange.check`` every few steps, and the ``Watchdog`` thread when an
operation is in flight ``stall_s``. A divergence ends the rank at once (docs/gpus.md).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from meshwise.comm.checks import diagnose
from meshwise.comm.checks.ledger import Ledger
from meshwise.comm.handle import CollectiveTimeout, is_timeout

PREFIX = "meshwise/ledger"
FAILURE_DIR_ENV = "MESHWISE_FAILURE_DIR"
COLLECT_S = 5.0  # how long an alert waits for the other ranks' entries


class LedgerExchange:
    """This rank's side of comparing ledgers through ``store``."""

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        ledger: Ledger,
        out_dir: str | os.PathLike | None = None,
    ):
        self.store, self.rank, self.world_size, self.ledger = store, rank, world_size, ledger
        self.out_dir = out_dir
        self.round = 0

    def check(self, timeout_s: float) -> str | None:
        """One round: compare channel summaries with every rank; the diagnosis of the
        first disagreement involving this rank, or None. Every rank calls it."""
        self.round += 1
        r = self.round
        self.store.set(f"{PREFIX}/sum/{r}/{self.rank}", json.dumps(self.ledger.summary()))
        summaries = self._get_all("sum", r, range(self.world_size), timeout_s)
        if r > 2:
            for kind in ("sum", "dump"):
                self.store.delete_key(f"{PREFIX}/{kind}/{r - 2}/{self.rank}")
        mine = self.ledger.channels.keys() | {
            c for s in summaries.values() for c in s if self.rank in diagnose.participants(c)
        }
        bad = [c for c in diagnose.mismatched(summaries) if c in mine]
        if not bad:
            self.ledger.checked()
            return None
        involved = sorted({p for c in bad for p in diagnose.participants(c)})
        self.store.set(
            f"{PREFIX}/dump/{r}/{self.rank}", json.dumps(self.ledger.dump(unchecked=True))
        )
        dumps = self._get_all("dump", r, involved, timeout_s)
        finding = diagnose.explain(dumps, bad, settled=True)
        return self.report(
            str(finding) if finding else f"ranks {involved} disagree on {', '.join(bad)}"
        )

    def collect(self, gen: int, wait_s: float | None = None) -> dict[int, dict]:
        """Raise alert ``gen`` and gather every rank's entries that arrive in ``wait_s``
        (default ``COLLECT_S``)."""
        wait_s = COLLECT_S if wait_s is None else wait_s
        self.store.set(f"{PREFIX}/alert", str(gen))
        self.answer(gen)
        deadline = time.monotonic() + wait_s
        keys = {r: f"{PREFIX}/stall/{gen}/{r}" for r in range(self.world_size)}
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(0.1)
        return {r: json.loads(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}

    def answer(self, gen: int) -> None:
        """Publish this rank's entries for alert ``gen``, and keep them as a file."""
        self.store.set(f"{PREFIX}/stall/{gen}/{self.rank}", json.dumps(self.ledger.dump()))
        self.write()

    def pending_alert(self) -> int | None:
        key = f"{PREFIX}/alert"
        return int(self.store.get(key)) if self.store.check([key]) else None

    def report(self, message: str) -> str:
        written = self.write()
        return message + (f" (ledgers: {written.parent})" if written else "")

    def write(self) -> Path | None:
        if self.out_dir is None:
            return None
        try:
            return self.ledger.write_json(self.out_dir)
        except OSError:
            return None

    def _get_all(self, kind: str, r: int, ranks, timeout_s: float) -> dict[int, dict]:
        keys = [f"{PREFIX}/{kind}/{r}/{p}" for p in ranks]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # DistStoreError: a rank stopped or gone
            if not is_timeout(exc):
                raise
            missing = [p for p, key in zip(ranks, keys) if not self._has(key)]
            raise CollectiveTimeout(
                f"ledger check #{r} on the launch's store (ranks {list(ranks)}) after "
                f"{timeout_s:g}s timed out: rank(s) {missing or list(ranks)} did not arrive"
            ) from None
        multi_get = getattr(self.store, "multi_get", None)  # torch >= 2.5
        values = multi_get(keys) if multi_get else [self.store.get(k) for k in keys]
        return {p: json.loads(v) for p, v in zip(ranks, values)}

    def _has(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except RuntimeError:
            return False


class Watchdog(threading.Thread):
    """Watches this rank's ledger; answers and raises alerts through ``exchange``."""

    def __init__(
        self,
        exchange: LedgerExchange,
        stall_s: float,
        timeout_s: float | None,
        reports_timeouts: bool,
        poll_s: float = 1.0,
    ):
        super().__init__(name="meshwise-ledger-watchdog", daemon=True)
        self.exchange, self.stall_s, self.timeout_s = exchange, stall_s, timeout_s
        self.reports_timeouts, self.poll_s = reports_timeouts, poll_s
        self._answered = 0
        self._examined: set[int] = set()  # entries already diagnosed as slow, not wrong
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def new_alert(self) -> int:
        """A generation number for an alert no rank has raised yet (as far as we know)."""
        self._answered = max(self._answered, self.exchange.pending_alert() or 0) + 1
        return self._answered

    def run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            try:
                self._tick()
            except Exception:  # the store went away: the job is ending
                return

    def _tick(self) -> None:
        gen = self.exchange.pending_alert()
        if gen is not None and gen > self._answered:
            self._answered = gen
            self.exchange.answer(gen)
        entry = self.exchange.ledger.oldest_pending()
        if entry is None:
            return
        age = time.monotonic() - entry.issued_s
        timed_out = self.reports_timeouts and self.timeout_s and age > self.timeout_s
        if age < self.stall_s or (entry.number in self._examined and not timed_out):
            return
        self._examined.add(entry.number)
        finding = diagnose.explain(self.exchange.collect(self.new_alert()))
        if finding and finding.kind == "diverged":
            end_rank(self.exchange.rank, "CollectiveDesync", self.exchange.report(str(finding)))
        if timed_out:
            what = (
                f"{entry.op} on {diagnose.describe_channel(entry.channel)} issued at "
                f"{entry.site} did not complete in {self.timeout_s:g}s"
            )
            end_rank(
                self.exchange.rank,
                "CollectiveTimeout",
                self.exchange.report(f"{what}: {finding}" if finding else what),
            )


def end_rank(rank: int, kind: str, message: str) -> None:
    """End this process from a thread, leaving the line for the launcher (which
    prints it as it prints a rank's ``kind`` error: ``rank <r>: <message>``)."""
    # The line goes to $MESHWISE_FAILURE_DIR/rank-<r>.txt and stderr. A rank still
    # behind after timeout_s is reported here only on backends that do not time out by
    # themselves (NCCL aborts the process instead).
    folder = os.environ.get(FAILURE_DIR_ENV)
    if folder:
        try:
            Path(folder, f"rank-{rank}.txt").write_text(message + "\n")
        except OSError:
            pass
    print(f"[rank {rank}] {kind}: {message}", file=sys.stderr, flush=True)
    os._exit(1)
