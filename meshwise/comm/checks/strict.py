"""NCCL's rules enforced on any backend (``MESHWISE_COMM_CHECK=nccl``): (1) one stream per
pair, (2) one issuing thread per group at a time, (3) tensors on the group's device,
(4) NCCL's types and reductions; the same order on every rank is the ledger's job.
What each catches: docs/gpus.md "NCCL's rules, enforced on any backend".
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from dataclasses import dataclass

import torch

from meshwise.comm.checks.ledger import call_site

ENV = "MESHWISE_COMM_CHECK"
WAIT_ENV = "MESHWISE_COMM_CHECK_WAIT_S"
# What NCCL carries (ncclDataType_t as PyTorch maps them); int16 and bool have no NCCL type.
NCCL_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)
NCCL_REDUCE_OPS = ("sum", "max", "min", "avg", "product")


class NcclRuleError(RuntimeError):
    """An operation that would hang or fail under NCCL; names the rule and call site."""


def enabled() -> bool:
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "nccl"):
        raise ValueError(f"{ENV}={value!r} is not valid; valid: nccl, or unset")
    return value == "nccl"


def wait_s() -> float:
    """How long an unbatched transfer may wait for its peer before the pair is named
    (``MESHWISE_COMM_CHECK_WAIT_S``, default 5 s)."""
    return float(os.environ.get(WAIT_ENV, "5"))


class _Waits:
    """Which threads wait inside ``backward`` (innermost wait last, each with a token
    and the call site). Process-wide, as the process's ``CommContext`` is: any thread
    asks about any other."""

    def __init__(self):
        self.lock = threading.Lock()
        self._tokens = itertools.count(1)
        # Keyed by the thread itself (threads hash by identity): an ident is reused once
        # its thread ended, a Thread object is not.
        self._stacks: dict[threading.Thread, list[tuple[int, str]]] = {}

    @contextlib.contextmanager
    def waiting(self, site: str):
        me = threading.current_thread()
        with self.lock:
            self._stacks.setdefault(me, []).append((next(self._tokens), site))
        try:
            yield
        finally:
            with self.lock:
                stack = self._stacks[me]
                stack.pop()  # waits on one thread nest: this one is the innermost
                if not stack:
                    del self._stacks[me]

    # The rest is asked with ``lock`` held.
    def innermost(self, thread: threading.Thread) -> tuple[int, str] | None:
        stack = self._stacks.get(thread)
        return stack[-1] if stack else None

    def innermost_site(self, thread: threading.Thread) -> str:
        """Where ``thread``, known to be waiting, waits."""
        wait = self.innermost(thread)
        assert wait is not None, f"thread {thread.name!r} is not waiting in a backward"
        return wait[1]

    def active(self, thread: threading.Thread, token: int | None) -> bool:
        return any(t == token for t, _ in self._stacks.get(thread, []))

    def latest_other(self, me: threading.Thread):
        """The thread other than ``me`` whose innermost wait began last, and that wait."""
        others = [(stack[-1], thread) for thread, stack in self._stacks.items() if thread is not me]
        return max(others, key=lambda o: o[0][0], default=None)


_WAITS = _Waits()


def backward(tensors, grad_tensors=None) -> None:
    """``torch.autograd.backward(tensors, grad_tensors)`` with this thread declared waiting
    in it (rule 2): on CUDA the engine runs the backward on its device thread, which
    issues the backward's operations on this thread's groups while this one is blocked.
    Every backward that may communicate runs through here."""
    with _WAITS.waiting(call_site()):
        torch.autograd.backward(tensors, grad_tensors)


@dataclass
class _Issuer:
    """A thread issuing on a group: the first, or one issuing while the one before it
    waits in ``backward`` (in the wait ``token``)."""

    thread: threading.Thread
    site: str  # its latest operation on the group (or where it waits, if it issued none)
    token: int | None = None


class GroupRules:
    """One group's issuing threads and unbatched transfers still in flight, per peer."""

    def __init__(self, name: str):
        self.name = name
        self.issuers: list[_Issuer] = []
        self.unbatched: dict[int, list[tuple[list, str, str]]] = {}  # peer -> (works, op, site)

    def check_thread(self, site: str) -> None:
        """Rule 2: the last issuing thread, or a new one while that one waits in ``backward``."""
        me = threading.current_thread()
        with _WAITS.lock:
            chain = self._current()
            if not chain:
                self.issuers = _first_issuers(me, site)
                return
            last = chain[-1]
            if last.thread is me:
                last.site = site
                return
            wait = _WAITS.innermost(last.thread)
            if wait is not None and all(link.thread is not me for link in chain):
                chain.append(_Issuer(me, site, wait[0]))
                return
            raise NcclRuleError(self._refusal(me, site, chain))

    def _current(self) -> list[_Issuer]:
        """The issuers still entitled: one whose predecessor's wait ended (the backward
        returned: it issues nothing more for it) drops out, and every one after it; so
        does the first once its thread ended. Within one wait the thread that issued
        stays the one that may, even after it ended."""
        for i, link in enumerate(self.issuers):
            if (
                not _alive(link.thread)
                if i == 0
                else not _WAITS.active(self.issuers[i - 1].thread, link.token)
            ):
                del self.issuers[i:]
                break
        return self.issuers

    def _refusal(self, me: threading.Thread, site: str, chain: list[_Issuer]) -> str:
        last = chain[-1]
        head = (
            f"NCCL rule (one issuing thread per group at a time): {site} issues an "
            f"operation on group {self.name} from thread {me.name!r}"
        )
        if any(link.thread is me for link in chain):  # it waits while `last` issues for it
            why = (
                f", which waits in a backward ({_WAITS.innermost_site(me)}) while thread "
                f"{last.thread.name!r} issues on the group for it ({last.site})"
            )
        elif len(chain) > 1:
            waiter = chain[-2].thread
            why = (
                f", while thread {last.thread.name!r} issues on the group ({last.site}) for "
                f"thread {waiter.name!r}, which waits in a backward "
                f"({_WAITS.innermost_site(waiter)}): one thread at most may issue for it"
            )
        else:
            why = (
                f", while thread {last.thread.name!r} issues on it too ({last.site}) and "
                "does not wait for it in a backward (meshwise.comm.checks.strict.backward)"
            )
        return (
            head + why + "; NCCL communicators are not thread-safe and two threads "
            "issuing at once cannot keep every rank's order the same"
        )

    def before_transfer(self, peer: int, op: str, site: str) -> None:
        """Rule 1: wait (at most ``wait_s()``) for unbatched transfers with ``peer``."""
        for works, first_op, first_site in self.unbatched.pop(peer, []):
            deadline = time.monotonic() + wait_s()
            while not all(w.is_completed() for w in works):
                if time.monotonic() > deadline:
                    raise NcclRuleError(
                        f"NCCL rule (transfers with one peer share a stream): on group "
                        f"{self.name}, the unbatched {first_op} with rank {peer} issued at "
                        f"{first_site} had not completed after {wait_s():g}s when a {op} with "
                        f"rank {peer} was issued at {site}; on a GPU the {op} queues behind that "
                        f"{first_op}, and the peer's matching transfer behind its own: a "
                        "deadlock. Post both in one ops.batch_p2p"
                    )
                time.sleep(0.0005)

    def note_unbatched(self, peer: int, works: list, op: str, site: str) -> None:
        self.unbatched.setdefault(peer, []).append((works, op, site))


def _alive(thread: threading.Thread) -> bool:
    try:
        return thread.is_alive()
    except RuntimeError:  # newer Pythons raise for a foreign thread (autograd's) once ended
        return False


def _first_issuers(me: threading.Thread, site: str) -> list[_Issuer]:
    """A group's first issuer; a thread that is not waiting itself while another waits
    issues for that one (autograd's device thread reducing a group's first gradients),
    which stays the group's issuing thread once its backward returns."""
    if _WAITS.innermost(me) is None:
        waiter = _WAITS.latest_other(me)
        if waiter is not None:
            (token, wait_site), thread = waiter
            return [_Issuer(thread, wait_site), _Issuer(me, site, token)]
    return [_Issuer(me, site)]


def check_tensors(
    group_name: str, group_device: torch.device, tensors, site: str, reduce_op: str | None = None
) -> None:
    """Rules 3 and 4 for the tensors one operation hands to a group: its device (the CPU on
    gloo), NCCL's dtypes and reductions."""
    for t in tensors:
        if t.device.type != group_device.type or (
            group_device.index is not None and t.device.index != group_device.index
        ):
            raise NcclRuleError(
                f"NCCL rule (tensors on the group's device): {site} hands a tensor on {t.device} "
                f"to group {group_name}, whose device is {group_device}"
            )
        if t.dtype not in NCCL_DTYPES or (t.is_complex() and reduce_op in ("max", "min")):
            raise NcclRuleError(
                f"NCCL rule (its data types): {site} hands a {t.dtype} tensor to group "
                f"{group_name}; NCCL carries {', '.join(str(d) for d in NCCL_DTYPES)}"
            )
    if reduce_op is not None and reduce_op not in NCCL_REDUCE_OPS:
        raise NcclRuleError(
            f"NCCL rule (its reductions): {site} asks group {group_name} for a "
            f"{reduce_op} reduction; NCCL has {', '.join(NCCL_REDUCE_OPS)}"
        )
