"""What one process knows about its communication (one ``CommContext`` per default process
group, asked about every operation before ``ops`` issues it): its ledger, the NCCL rules
per group, and the exchange and watchdog; settings come from the environment.
"""

from __future__ import annotations

import logging
import os

import torch

from meshwise.comm.checks import diagnose, strict, watchdog
from meshwise.comm.checks.ledger import Entry, Ledger, call_site, signature
from meshwise.comm.checks.watchdog import LedgerExchange, Watchdog

log = logging.getLogger("meshwise")
LEDGER_ENV = "MESHWISE_LEDGER"  # 0: no ledger, so no checks across ranks
# Steps between comparisons (default 10): each is a round trip to the launch's store on
# the step's critical path; the ledger keeps every operation since the ranks last
# agreed, so a check still names the first that differs.
CHECK_EVERY_ENV = "MESHWISE_LEDGER_CHECK_EVERY"
STALL_ENV = "MESHWISE_STALL_S"  # in flight this long (default 10 s): the watchdog compares
# A folder for each rank's ledger as a file kept current, set by the local launcher so
# it can read them after a rank died.
LEDGER_DIR_ENV = "MESHWISE_LEDGER_DIR"


def ledger_enabled() -> bool:
    return os.environ.get(LEDGER_ENV, "1") != "0"


def check_every() -> int:
    """Steps between two comparisons of the ranks' ledgers."""
    value = os.environ.get(CHECK_EVERY_ENV, "10")
    if not (value.isdigit() and int(value) >= 1):
        raise ValueError(
            f"{CHECK_EVERY_ENV}={value!r} is not valid; valid: a whole number of steps, 1 or more"
        )
    return int(value)


STORE_TIMEOUT_S = 60.0  # a store call's bound where the job sets no timeout
WATCHDOG_JOIN_S = 10.0  # longer than one tick's store calls; bounded if the store hangs


class CommContext:
    """One rank's ledger, NCCL-rule state and cross-rank exchange."""

    def __init__(self, rank: int, world_size: int, store_factory=None, world_id: int | None = None):
        self.rank, self.world_size = rank, world_size
        self.world_id = world_id  # id() of the default process group it belongs to
        self.strict = strict.enabled()
        folder = os.environ.get(LEDGER_DIR_ENV)
        path = os.path.join(folder, f"rank-{rank:05d}.ledger") if folder else None
        self.ledger = Ledger(rank, path=path) if ledger_enabled() else None
        self.rules: dict[int, strict.GroupRules] = {}  # id(process group) -> its rules
        self._store_factory = store_factory
        self.exchange: LedgerExchange | None = None
        self.watchdog: Watchdog | None = None

    # -- every operation ---------------------------------------------------------------
    def begin(
        self,
        group,
        op: str,
        tensors,
        reduce_op: str | None = None,
        peer: int | None = None,
        channel: str | None = None,
        tag: int = 0,
    ) -> Entry | None:
        """Check ``op`` against NCCL's rules (strict mode) and enter it in the ledger.

        ``peer``: the group rank of a point-to-point transfer, whose ``channel`` is
        the pair's; both ends enter it under the same signature (with its ``tag``)."""
        site = call_site()
        if self.strict:
            rules = self.rules_for(group)
            rules.check_thread(site)
            strict.check_tensors(group.name, group.device, tensors, site, reduce_op)
            if peer is not None:
                rules.before_transfer(group.global_rank(peer), op, site)
        if self.ledger is None:
            return None
        if peer is not None:
            sig = signature(f"transfer tag{tag}", tensors)
        else:
            # every rank pickles a different object, or sends different row counts
            uneven = op == "all_gather_object" or op.startswith("all_to_all")
            sig = signature(op, () if uneven else tensors)
        return self.ledger.issue(channel or group.channel, op, sig, site)

    def unbatched(self, group, peer: int, works: list, op: str) -> None:
        """A send or receive issued outside a batch: strict mode holds the pair to it."""
        if self.strict:
            self.rules_for(group).note_unbatched(group.global_rank(peer), works, op, call_site())

    def rules_for(self, group) -> strict.GroupRules:
        key = id(group.pg)
        if key not in self.rules:
            self.rules[key] = strict.GroupRules(group.channel)
        return self.rules[key]

    # -- across ranks -----------------------------------------------------------------
    def start(
        self,
        timeout_s: float | None,
        reports_timeouts: bool,
        out_dir: str | os.PathLike | None = None,
    ) -> None:
        """Open the exchange and start the watchdog (once; a no-op without a ledger,
        a store, or a second rank)."""
        if self.exchange is not None:
            self.exchange.out_dir = out_dir or self.exchange.out_dir
            return
        if self.ledger is None or self.world_size == 1 or self._store_factory is None:
            return
        try:  # its calls bounded like a collective: a peer never stalls this rank longer
            store = self._store_factory(timeout_s or STORE_TIMEOUT_S)
        except (RuntimeError, OSError) as exc:  # the ledger still records; ranks do not compare
            log.warning(
                "warning: collective ledger: cannot reach the launch's store (%s); "
                "ranks will not compare their ledgers",
                exc,
            )
            return
        if store is None:
            return
        self.exchange = LedgerExchange(store, self.rank, self.world_size, self.ledger, out_dir)
        self.ledger.keep_unchecked()  # what a check names if ranks part between two checks
        thread_exchange = LedgerExchange(
            store.clone(), self.rank, self.world_size, self.ledger, out_dir
        )
        stall_s = float(os.environ.get(STALL_ENV, "10"))
        self.watchdog = Watchdog(thread_exchange, stall_s, timeout_s, reports_timeouts)
        self.watchdog.start()

    def check(self, timeout_s: float, step: int | None = None, now: bool = False) -> str | None:
        """Compare this rank's ledger with every rank's (all ranks call it together): at
        once, or with ``step`` every ``check_every()`` steps unless ``now``."""
        if self.exchange is None:
            return None
        if step is not None and not now and step % check_every():
            return None
        return self.exchange.check(timeout_s)

    def explain_stall(self) -> str | None:
        """After a timeout: what the other ranks' ledgers say, or which ranks did not
        answer (stopped or gone: a stopped rank answers nothing)."""
        if self.exchange is None or self.watchdog is None:
            return None
        gen = self.watchdog.new_alert()
        answers = self.exchange.collect(gen)
        finding = diagnose.explain(answers)
        if finding:
            return self.exchange.report(str(finding))
        silent = [r for r in range(self.world_size) if r not in answers]
        if not silent:
            return None
        return self.exchange.report(
            f"rank(s) {silent} did not answer the ledger's alert within "
            f"{watchdog.COLLECT_S:g}s (stopped or gone)"
        )

    def close(self) -> None:
        """Stop the watchdog and wait for it: a daemon thread still inside a store
        call when the interpreter exits aborts the process (std::terminate)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog.join(timeout=WATCHDOG_JOIN_S)


def default_device(backend_name: str) -> torch.device:
    """Where a group's tensors live when nothing says otherwise."""
    if backend_name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
