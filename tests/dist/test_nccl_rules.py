"""NCCL's rules enforced on gloo (``MESHWISE_COMM_CHECK=nccl``, set for every test)
and the collective ledger's per-step check, on two gloo ranks.

Each breach is refused before the offending operation is issued, so both ranks
stay in step and the pool goes on to the next test.
"""

import os
import threading
import time

import pytest
import torch

from meshwise.comm import ops
from meshwise.comm.checks import strict
from tests.dist.pool import RankError

pytestmark = pytest.mark.timeout(120)


def _fresh_group(name):
    return ops.new_group([0, 1], name, ops.CommCounters(), timeout_s=30)


def _receive_before_send():
    """Both ranks post an unbatched receive, then a send: a deadlock on one NCCL stream."""
    os.environ[strict.WAIT_ENV] = "1"
    group = _fresh_group("pair")
    peer = 1 - group.rank
    inbox = torch.zeros(4)
    pending = ops.recv(inbox, peer, group, tag=3, async_op=True)
    start = time.monotonic()
    try:
        ops.send(torch.ones(4), peer, group, tag=3)
        return None
    except strict.NcclRuleError as exc:
        message, waited = str(exc), time.monotonic() - start
    finally:
        os.environ.pop(strict.WAIT_ENV)
    # Clean up in step on both ranks: the send each receive waits for, in one batch.
    ops.batch_p2p([(torch.ones(4), peer, 3)], [], group)
    pending.wait()
    return message, waited


def test_an_unbatched_receive_before_a_send_fails_fast_naming_the_pair(dist_pools):
    for message, waited in dist_pools.run(2, _receive_before_send):
        assert message.startswith("NCCL rule (transfers with one peer share a stream): on group "
                                  "pair[0,1], the unbatched recv with rank")
        assert "test_nccl_rules.py" in message and "ops.batch_p2p" in message
        assert waited < 10


def _exchange_in_a_batch():
    group = _fresh_group("batched")
    peer = 1 - group.rank
    inbox = torch.zeros(4)
    ops.batch_p2p([(torch.full((4,), float(group.rank)), peer, 5)], [(inbox, peer, 5)], group)
    return inbox.tolist()


def test_a_batched_exchange_passes(dist_pools):
    assert dist_pools.run(2, _exchange_in_a_batch) == [[1.0] * 4, [0.0] * 4]


def _second_thread():
    group = _fresh_group("threads")
    ops.all_reduce(torch.ones(2), group)
    found = []

    def other():
        try:
            ops.all_reduce(torch.ones(2), group)
        except strict.NcclRuleError as exc:
            found.append(str(exc))

    thread = threading.Thread(target=other, name="helper")
    thread.start()
    thread.join()
    return found


def test_a_second_issuing_thread_is_refused(dist_pools):
    for found in dist_pools.run(2, _second_thread):
        assert len(found) == 1
        assert found[0].startswith("NCCL rule (one issuing thread per group at a time): ")
        assert "from thread 'helper'" in found[0] and "MainThread" in found[0]
        assert found[0].count("test_nccl_rules.py") == 2  # both call sites


def _wrong_device_and_dtype():
    group = _fresh_group("kinds")
    found = []
    for tensor, op in ((torch.ones(2, device="meta"), "sum"),
                       (torch.ones(2, dtype=torch.int16), "sum"),
                       (torch.ones(2, dtype=torch.bool), "max")):
        try:
            ops.all_reduce(tensor, group, op=op)
        except strict.NcclRuleError as exc:
            found.append(str(exc).split(":")[0])
    return found


def test_tensors_off_the_groups_device_and_types_nccl_lacks_are_refused(dist_pools):
    expected = ["NCCL rule (tensors on the group's device)", "NCCL rule (its data types)",
                "NCCL rule (its data types)"]
    assert dist_pools.run(2, _wrong_device_and_dtype) == [expected, expected]


def _mismatched_reduction():
    group = _fresh_group("desync")
    t = torch.ones(3)
    if group.rank == 0:
        ops.all_reduce(t, group, op="sum")
    else:
        ops.all_reduce(t, group, op="max")  # gloo pairs it silently; NCCL would too
    ops.check_ledger(30)


def test_the_per_step_check_names_operations_that_differ(dist_pools):
    with pytest.raises(RankError, match=r"CollectiveDesync: rank \d diverged on group desync "
                                        r"\(ranks \[0, 1\]\) at operation #1: .*all_reduce "
                                        r"(sum|max) float32\[3\] at tests/dist/test_nccl_rules"):
        dist_pools.run(2, _mismatched_reduction)


def _desync_between_checks():
    """Checks every 4 steps (and at step 1, asked for now); rank 1 issues a max where
    rank 0 issues a sum in step 2, and both go on alike."""
    from meshwise.comm.checks import context

    os.environ[context.CHECK_EVERY_ENV] = "4"
    group, rounds = _fresh_group("cadence"), []
    exchange = ops.context().exchange
    try:
        for step in range(1, 5):
            for i in range(3):
                op = "max" if (step, i, group.rank) == (2, 1, 1) else "sum"
                ops.all_reduce(torch.ones(3), group, op=op)
            try:
                ops.check_ledger(30, step, now=step == 1)
            except ops.CollectiveDesync as exc:
                return rounds, str(exc)
            rounds.append(exchange.round)
    finally:
        os.environ.pop(context.CHECK_EVERY_ENV)
    return rounds, None


def test_a_desync_between_two_checks_is_named_at_the_next_at_its_first_operation(dist_pools):
    # (tests/unit/test_ledger_cadence.py: also once the ring of recent entries moved past it)
    for rounds, found in dist_pools.run(2, _desync_between_checks, agree=False):
        assert len(rounds) == 3 and rounds[1:] == [rounds[0]] * 2  # steps 2, 3: no check
        assert found is not None
        assert found.startswith("rank 1 diverged on group cadence (ranks [0, 1]) at operation "
                                "#5: rank 1 issued all_reduce max float32[3] at "
                                "tests/dist/test_nccl_rules.py")
        assert "while rank 0 issued all_reduce sum float32[3] at tests/dist/" in found
