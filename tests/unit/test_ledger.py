"""The collective ledger and its diagnosis, on one process (no communication)."""

import json
import time

import torch

from meshwise.comm.checks import diagnose
from meshwise.comm.checks.ledger import Ledger, call_site, read_ledgers, read_ring, signature


def _issue(ledger, channel, op, numel, site, done=True):
    entry = ledger.issue(channel, op, signature(op, [torch.zeros(numel)]), site)
    if done:
        ledger.complete(entry)
    return entry


def _step(ledger, sites=("engine.py:10", "trainer.py:20")):
    _issue(ledger, "dp[0,1]", "all_reduce sum", 1000, sites[0])
    _issue(ledger, "world[0,1]", "all_reduce sum", 4, sites[1])


def test_ranks_that_issue_the_same_operations_agree():
    a, b = Ledger(0), Ledger(1)
    for ledger in (a, b):
        _step(ledger)
        _step(ledger)
    assert a.summary() == b.summary()
    assert diagnose.mismatched({0: a.summary(), 1: b.summary()}) == []
    assert diagnose.explain({0: a.dump(), 1: b.dump()}) is None


def test_an_extra_operation_names_its_rank_and_both_call_sites():
    a, b = Ledger(0), Ledger(1)
    for ledger in (a, b):
        _step(ledger)
    _issue(b, "dp[0,1]", "all_reduce sum", 1, "faults.py:37")  # rank 1 only
    for ledger in (a, b):
        _step(ledger)
    assert diagnose.mismatched({0: a.summary(), 1: b.summary()}) == ["dp[0,1]"]
    finding = diagnose.explain({0: a.dump(), 1: b.dump()}, ["dp[0,1]"])
    assert finding.kind == "diverged"
    text = str(finding)
    assert text.startswith("rank 1 diverged on group dp (ranks [0, 1]) at operation #2")
    assert "faults.py:37" in text and "engine.py:10" in text


def test_a_rank_cut_short_at_its_odd_operation_is_named_by_its_call_site():
    """As after gloo aborted a collective whose sizes differ: no later operation shows
    the shift, so the call site the other rank never used names the culprit."""
    a, b = Ledger(0), Ledger(1)
    for ledger in (a, b):
        _step(ledger)
    _issue(a, "dp[0,1]", "all_reduce sum", 1000, "engine.py:10", done=False)
    _issue(b, "dp[0,1]", "all_reduce sum", 1, "faults.py:37", done=False)
    finding = diagnose.explain({0: a.dump(), 1: b.dump()})
    assert finding.kind == "diverged" and str(finding).startswith("rank 1 diverged")


def test_the_minority_is_named_among_more_ranks():
    ledgers = [Ledger(r) for r in range(3)]
    for r, ledger in enumerate(ledgers):
        _issue(ledger, "tp[0,1,2]", "all_reduce sum", 8 if r != 2 else 9, f"layer.py:{r}")
    finding = diagnose.explain({r: led.dump() for r, led in enumerate(ledgers)})
    assert str(finding).startswith("rank 2 diverged on group tp")


def test_a_rank_that_never_arrives_is_behind():
    a, b = Ledger(0), Ledger(1)
    for ledger in (a, b):
        _step(ledger)
    _issue(a, "dp[0,1]", "all_reduce sum", 1000, "engine.py:10", done=False)
    _issue(b, "pp[1,3] 1->3", "send", 64, "runtime.py:300", done=False)
    finding = diagnose.explain({0: a.dump(), 1: b.dump()})
    assert finding.kind == "behind"
    assert str(finding).startswith(
        "rank 1 is behind on group dp (ranks [0, 1]): rank 0 waits "
        "in all_reduce sum float32[1000] #2 at engine.py:10"
    )
    assert "runtime.py:300 (in flight)" in str(finding)


def test_transfers_pair_up_between_sender_and_receiver():
    a, b = Ledger(0), Ledger(1)
    a.issue("pp[0,1] 0->1", "send", signature("transfer tag3", [torch.zeros(5)]), "x")
    b.issue("pp[0,1] 0->1", "recv", signature("transfer tag3", [torch.zeros(5)]), "y")
    assert diagnose.mismatched({0: a.summary(), 1: b.summary()}) == []
    b.issue("pp[0,1] 0->1", "recv", signature("transfer tag4", [torch.zeros(5)]), "y")
    assert diagnose.mismatched({0: a.summary(), 1: b.summary()}) == ["pp[0,1] 0->1"]


def test_the_ring_file_survives_its_process_and_keeps_completion(tmp_path):
    path = tmp_path / "rank-00003.ledger"
    ledger = Ledger(3, capacity=4, path=path)
    entries = [
        _issue(ledger, "dp[2,3]", "all_reduce sum", n, f"site{n}", done=False) for n in range(1, 7)
    ]
    ledger.complete(entries[-2])
    read = read_ring(path)
    assert [e["seq"] for e in read] == [3, 4, 5, 6]  # the last ``capacity``
    assert [e["done"] for e in read] == [False, False, True, False]
    assert [e["seq"] for e in read_ledgers(tmp_path)[3]["entries"]] == [3, 4, 5, 6]


def test_call_sites_name_the_caller_outside_the_issuing_modules():
    def caller():
        return call_site()

    site = caller()
    assert site.startswith("tests/unit/test_ledger.py:") and site.endswith(" in caller")


def test_pending_entries_ask_the_backend():
    class Work:
        def __init__(self):
            self.finished = False

        def is_completed(self):
            return self.finished

    ledger, work = Ledger(0), Work()
    entry = ledger.issue("dp[0,1]", "all_reduce sum", "s", "x", works=[work])
    time.sleep(0.01)
    assert ledger.oldest_pending() is entry
    work.finished = True
    assert ledger.oldest_pending() is None and entry.done


class DictStore:
    """The part of a TCPStore the exchange uses, in one process."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def wait(self, keys, timeout):
        assert self.check(keys), f"would wait for {keys}"

    def multi_get(self, keys):
        return [self.data[k] for k in keys]

    def delete_key(self, key):
        self.data.pop(key, None)


def test_the_step_check_finds_the_rank_and_writes_its_ledger(tmp_path):
    from meshwise.comm.checks.watchdog import LedgerExchange

    store = DictStore()
    a, b = Ledger(0), Ledger(1)
    for ledger in (a, b):
        _step(ledger)
    mine, theirs = (LedgerExchange(store, r, 2, led, tmp_path) for r, led in ((0, a), (1, b)))
    store.set("meshwise/ledger/sum/1/1", json.dumps(b.summary()))
    assert mine.check(1.0) is None  # agree
    _issue(b, "dp[0,1]", "all_reduce sum", 1, "faults.py:37")
    store.set("meshwise/ledger/sum/2/1", json.dumps(b.summary()))
    store.set("meshwise/ledger/dump/2/1", json.dumps(b.dump()))
    found = mine.check(1.0)
    assert found.startswith(
        "rank 1 diverged on group dp (ranks [0, 1]): it issued all_reduce "
        "sum float32[1] #2 at faults.py:37, which rank 0 never issued"
    )
    assert found.endswith(f"(ledgers: {tmp_path})")
    assert (tmp_path / "ledger-rank00000.json").is_file()


def test_the_watchdog_ends_a_rank_whose_peer_diverged(monkeypatch):
    from meshwise.comm.checks import watchdog

    store, ended = DictStore(), []
    a, b = Ledger(0), Ledger(1)
    for ledger in (a, b):
        _step(ledger)
    _issue(a, "dp[0,1]", "all_reduce sum", 1000, "engine.py:10", done=False)
    _issue(b, "dp[0,1]", "all_reduce sum", 1, "faults.py:37", done=False)
    _issue(b, "dp[0,1]", "all_reduce sum", 1000, "engine.py:10", done=False)
    store.set("meshwise/ledger/stall/1/1", json.dumps(b.dump()))  # rank 1 answers the alert
    monkeypatch.setattr(watchdog, "end_rank", lambda rank, kind, msg: ended.append((kind, msg)))
    dog = watchdog.Watchdog(
        watchdog.LedgerExchange(store, 0, 2, a), stall_s=0.0, timeout_s=60, reports_timeouts=True
    )
    dog._tick()
    [(kind, message)] = ended
    assert kind == "CollectiveDesync"
    assert message.startswith("rank 1 diverged on group dp (ranks [0, 1]) at operation #2")
