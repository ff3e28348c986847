"""NCCL's thread rule in the strict mode (``meshwise.comm.checks.strict``, rule 2): one thread
issues on a group at a time; a thread may issue while the group's issuing thread waits
for it in ``strict.backward``, as CUDA's autograd device thread does."""

import threading

import pytest
import torch

from meshwise.comm.checks import strict


def _issue(rules, site):
    """``site``'s operation checked against the rule: None, or the refusal."""
    try:
        rules.check_thread(site)
    except strict.NcclRuleError as exc:
        return str(exc)
    return None


def _on_thread(name, fn):
    """``fn()`` on a new thread named ``name``, joined; its result."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), name=name)
    thread.start()
    thread.join()
    return out[0]


def _in_backward(fn):
    """``fn()`` from inside ``strict.backward`` (a gradient hook: this thread waits there)."""
    out = []
    x = torch.ones(2, requires_grad=True)
    with torch.enable_grad():  # also inside a backward, whose hooks run without it
        y = x * 2
        loss = y.sum()
    y.register_hook(lambda grad: out.append(fn()))
    strict.backward(loss)
    return out[0]


def test_a_thread_may_issue_while_the_issuing_thread_waits_in_backward():
    rules = strict.GroupRules("dp[0,1]")
    assert _issue(rules, "forward.py:1") is None
    assert _in_backward(lambda: _on_thread("device", lambda: _issue(rules, "hook.py:2"))) is None
    assert _issue(rules, "forward.py:1") is None  # the backward returned: the forward goes on
    # and again, the next step, from the same device thread as CUDA's
    device_thread_result = _in_backward(lambda: [_issue(rules, "hook.py:2")])
    assert device_thread_result == [None]


def test_a_second_thread_in_the_same_wait_is_refused_naming_both():
    rules = strict.GroupRules("dp[0,1]")
    _issue(rules, "forward.py:1")

    def two_threads():
        return [
            _on_thread(name, lambda name=name: _issue(rules, f"{name}.py:3"))
            for name in ("device", "other")
        ]

    first, second = _in_backward(two_threads)
    assert first is None
    assert second.startswith(
        "NCCL rule (one issuing thread per group at a time): other.py:3 "
        "issues an operation on group dp[0,1] from thread 'other', while "
        "thread 'device' issues on the group (device.py:3) for thread "
        "'MainThread', which waits in a backward ("
    )
    assert "test_issuing_threads.py" in second  # where it waits


def test_a_thread_issuing_while_the_issuing_thread_does_not_wait_is_refused():
    rules = strict.GroupRules("tp[0,1]")
    _issue(rules, "forward.py:1")
    found = _on_thread("other", lambda: _issue(rules, "other.py:4"))
    assert found.startswith(
        "NCCL rule (one issuing thread per group at a time): other.py:4 "
        "issues an operation on group tp[0,1] from thread 'other', while "
        "thread 'MainThread' issues on it too (forward.py:1) and does not "
        "wait for it in a backward"
    )
    # a thread that issued during a backward may not issue once it returned
    assert _in_backward(lambda: _on_thread("device", lambda: _issue(rules, "hook.py:2"))) is None
    late = _on_thread("late", lambda: _issue(rules, "late.py:5"))
    assert "from thread 'late', while thread 'MainThread' issues on it too" in late


def test_the_waiting_thread_may_not_issue_while_another_issues_for_it():
    rules = strict.GroupRules("cp[0,1]")
    _issue(rules, "forward.py:1")

    def both():
        worker = threading.Event()
        done = threading.Event()

        def device():
            _issue(rules, "hook.py:2")
            worker.set()
            done.wait(5)

        thread = threading.Thread(target=device, name="device")
        thread.start()
        worker.wait(5)
        found = _issue(rules, "recompute.py:6")  # while "device" is still at work
        done.set()
        thread.join()
        return found

    found = _in_backward(both)
    assert "from thread 'MainThread', which waits in a backward (" in found
    assert "while thread 'device' issues on the group for it (hook.py:2)" in found


def test_a_group_first_used_in_a_backward_belongs_to_the_waiting_thread():
    rules = strict.GroupRules("dp[0,1]")
    assert _in_backward(lambda: _on_thread("device", lambda: _issue(rules, "bucket.py:7"))) is None
    assert _issue(rules, "step.py:8") is None


def test_nested_waits():
    rules = strict.GroupRules("pp[0,1]")
    _issue(rules, "forward.py:1")
    # on the CPU a backward inside a backward runs on the waiting thread itself
    assert _in_backward(lambda: _in_backward(lambda: _issue(rules, "inner.py:9"))) is None

    def device_waits_too():
        first = _issue(rules, "hook.py:2")
        # the device thread's own backward (a reentrant one) hands work to a third thread
        inner = _in_backward(lambda: _on_thread("pool", lambda: _issue(rules, "deep.py:10")))
        after = _on_thread("stray", lambda: _issue(rules, "stray.py:11"))
        return first, inner, after

    first, inner, after = _in_backward(lambda: _on_thread("device", device_waits_too))
    assert first is None and inner is None
    assert after is not None and "for thread 'MainThread'" in after  # "device" waits no more
    assert _issue(rules, "forward.py:1") is None


def test_the_issuing_thread_that_ended_hands_the_group_on():
    rules = strict.GroupRules("world[0,1]")
    assert _on_thread("setup", lambda: _issue(rules, "setup.py:12")) is None
    assert _issue(rules, "train.py:13") is None


def test_backward_passes_gradients_as_autograd_does():
    x = torch.ones(3, requires_grad=True)
    strict.backward(x * 2, torch.full((3,), 0.5))
    assert x.grad.tolist() == [1.0] * 3
    with pytest.raises(RuntimeError):  # a second backward through a freed graph, as torch's
        y = x * 2
        strict.backward(y.sum())
        strict.backward(y.sum())
