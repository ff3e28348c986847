"""Comparing ledgers every few steps (``MESHWISE_LEDGER_CHECK_EVERY``) still names the
first operation that differs, on one process through a dictionary store."""

import json

import pytest
import torch

from meshwise.comm.checks import context
from meshwise.comm.checks.ledger import CAPACITY, Ledger, signature
from meshwise.comm.checks.watchdog import LedgerExchange
from tests.unit.test_ledger import DictStore


def _issue(ledger, channel, op, numel, site):
    ledger.complete(ledger.issue(channel, op, signature(op, [torch.zeros(numel)]), site))


def test_check_every_is_a_positive_whole_number(monkeypatch):
    monkeypatch.delenv(context.CHECK_EVERY_ENV, raising=False)
    assert context.check_every() == 10
    monkeypatch.setenv(context.CHECK_EVERY_ENV, "3")
    assert context.check_every() == 3
    for bad in ("0", "-2", "often", "1.5"):
        monkeypatch.setenv(context.CHECK_EVERY_ENV, bad)
        with pytest.raises(
            ValueError,
            match=rf"MESHWISE_LEDGER_CHECK_EVERY='{bad}' is not "
            "valid; valid: a whole number of steps, 1 or more",
        ):
            context.check_every()


class CountingExchange:
    def __init__(self):
        self.rounds = 0

    def check(self, timeout_s):
        self.rounds += 1


def test_steps_compare_every_few_and_when_asked_now(monkeypatch):
    monkeypatch.setenv(context.CHECK_EVERY_ENV, "4")
    ctx = context.CommContext(0, 2)
    ctx.exchange = CountingExchange()
    compared = []
    for step in range(1, 11):
        before = ctx.exchange.rounds
        ctx.check(5.0, step, now=step == 10)
        if ctx.exchange.rounds > before:
            compared.append(step)
    assert compared == [4, 8, 10]
    ctx.check(5.0)  # without a step: at once
    assert ctx.exchange.rounds == 4


def _pair(tmp_path):
    store, a, b = DictStore(), Ledger(0), Ledger(1)
    for ledger in (a, b):
        ledger.keep_unchecked()
    return store, a, b, LedgerExchange(store, 0, 2, a, tmp_path)


def _check(store, mine, theirs: Ledger):
    """Rank 0's check, rank 1 having published what it would."""
    r = mine.round + 1
    store.set(f"meshwise/ledger/sum/{r}/1", json.dumps(theirs.summary()))
    store.set(f"meshwise/ledger/dump/{r}/1", json.dumps(theirs.dump(unchecked=True)))
    return mine.check(1.0)


def test_a_desync_the_ring_has_moved_past_is_named_at_its_first_operation(tmp_path):
    store, a, b, mine = _pair(tmp_path)
    for ledger in (a, b):
        _issue(ledger, "dp[0,1]", "all_reduce sum", 8, "engine.py:10")
    assert _check(store, mine, b) is None
    assert len(a.unchecked) == 0  # agreed: nothing left to name
    _issue(a, "dp[0,1]", "all_reduce sum", 8, "engine.py:10")
    _issue(b, "dp[0,1]", "all_reduce max", 8, "clip.py:5")
    for _ in range(2 * CAPACITY):  # steps later, the ring holds none of it
        for ledger in (a, b):
            _issue(ledger, "dp[0,1]", "all_reduce sum", 8, "engine.py:10")
    found = _check(store, mine, b)
    assert found.startswith(
        "rank 1 diverged on group dp (ranks [0, 1]) at operation #2: rank 1 "
        "issued all_reduce max float32[8] at clip.py:5, while rank 0 issued "
        "all_reduce sum float32[8] at engine.py:10"
    )


def test_an_extra_last_operation_is_named_though_its_peer_issued_none_since(tmp_path):
    store, a, b, mine = _pair(tmp_path)
    for ledger in (a, b):
        _issue(ledger, "dp[0,1]", "all_reduce sum", 8, "engine.py:10")
    assert _check(store, mine, b) is None
    _issue(b, "dp[0,1]", "all_reduce sum", 1, "faults.py:37")
    for _ in range(2 * CAPACITY):  # other groups' operations fill the ring
        for ledger in (a, b):
            _issue(ledger, "tp[0,1]", "all_reduce sum", 4, "mappings.py:58")
    found = _check(store, mine, b)
    assert found.startswith(
        "rank 1 diverged on group dp (ranks [0, 1]): it issued all_reduce "
        "sum float32[1] #2 at faults.py:37, which rank 0 never issued (its "
        "last there is all_reduce sum float32[8] #1 at engine.py:10)"
    )


def test_a_rank_that_never_arrives_at_a_check_is_a_one_line_timeout_naming_it():
    from datetime import timedelta

    import torch.distributed as dist

    from meshwise.comm.handle import CollectiveTimeout

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    exchange = LedgerExchange(store, 0, 2, Ledger(0))  # rank 1 never publishes its summary
    with pytest.raises(CollectiveTimeout) as caught:
        exchange.check(timeout_s=0.5)
    message = str(caught.value)
    assert "after 0.5s timed out: rank(s) [1] did not arrive" in message, message
    assert "\n" not in message


def test_a_timeout_names_the_ranks_that_do_not_answer_the_ledgers_alert(monkeypatch):
    from meshwise.comm.checks import watchdog

    monkeypatch.setattr(watchdog, "COLLECT_S", 0.2)
    ctx = context.CommContext(0, 3)
    ctx.exchange = LedgerExchange(DictStore(), 0, 3, ctx.ledger)
    ctx.watchdog = watchdog.Watchdog(ctx.exchange, stall_s=10, timeout_s=5, reports_timeouts=False)
    # Rank 1 answers, with nothing in flight; rank 2 (stopped) never does.
    LedgerExchange(ctx.exchange.store, 1, 3, Ledger(1)).answer(1)
    assert ctx.explain_stall() == "rank(s) [2] did not answer the ledger's alert within 0.2s " + (
        "(stopped or gone)"
    )
