"""NCCL's rules, enforced on any backend: ``MESHWISE_COMM_CHECK=nccl``.

CI has no GPU, so code meant for NCCL runs on gloo there, and gloo forgives
what NCCL does not. In this mode every operation ``meshwise.comm.ops`` issues
is checked against what NCCL requires, and a breach fails at once with the rule,
the group or pair, and the call site:

1. *One stream per pair*: a send or receive that is not in a batch runs on the
   pair's stream and blocks it until the peer's matching end arrives, so it must
   complete before the next transfer with that peer is issued. A receive posted
   before a send on both ends deadlocks on a GPU; here it fails after
   ``MESHWISE_COMM_CHECK_WAIT_S`` (default 5) seconds naming the pair.
2. *One issuing thread per group*: NCCL communicators are not thread-safe, and
   two threads cannot keep every rank's order the same.
3. *The group's device*: NCCL moves tensors of its device only; a CPU tensor
   handed to a CUDA group is refused (on gloo the group's device is the CPU).
4. *NCCL's types and operations*: no int16, bool or complex reductions of
   max/min, none of the bitwise reductions.

The same order of operations on every rank (the fifth rule) is the ledger's
job (``meshwise.comm.ledger``), checked once per step whether or not this mode
is on. The mode also makes ``meshwise.comm.policy`` formulate every operation as
for NCCL, so CI runs the code paths GPUs run.
"""

from __future__ import annotations

import os
import threading
import time

import torch

ENV = "MESHWISE_COMM_CHECK"
WAIT_ENV = "MESHWISE_COMM_CHECK_WAIT_S"
# What NCCL carries (ncclDataType_t as PyTorch maps them); int16 and bool have no NCCL type.
NCCL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
               torch.uint8, torch.int32, torch.int64)
NCCL_REDUCE_OPS = ("sum", "max", "min", "avg", "product")


class NcclRuleError(RuntimeError):
    """An operation that would hang or fail under NCCL; names the rule and call site."""


def enabled() -> bool:
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "nccl"):
        raise ValueError(f"{ENV}={value!r} is not valid; valid: nccl, or unset")
    return value == "nccl"


def wait_s() -> float:
    return float(os.environ.get(WAIT_ENV, "5"))


class GroupRules:
    """One group's issuing thread and unbatched transfers still in flight, per peer."""

    def __init__(self, name: str):
        self.name = name
        self.thread: tuple[int, str] | None = None
        self.first_site = ""
        self.unbatched: dict[int, list[tuple[list, str, str]]] = {}  # peer -> (works, op, site)

    def check_thread(self, site: str) -> None:
        me = (threading.get_ident(), threading.current_thread().name)
        if self.thread is None:
            self.thread, self.first_site = me, site
        elif self.thread[0] != me[0]:
            raise NcclRuleError(
                f"NCCL rule (one issuing thread per group): {site} issues an operation on group "
                f"{self.name} from thread {me[1]!r}, but thread {self.thread[1]!r} issued its "
                f"first one ({self.first_site}); NCCL communicators are not thread-safe and two "
                "threads cannot keep every rank's order the same")

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
                        "deadlock. Post both in one ops.batch_p2p")
                time.sleep(0.0005)

    def note_unbatched(self, peer: int, works: list, op: str, site: str) -> None:
        self.unbatched.setdefault(peer, []).append((works, op, site))


def check_tensors(group_name: str, group_device: torch.device, tensors, site: str,
                  reduce_op: str | None = None) -> None:
    """Rules 3 and 4 for the tensors one operation hands to a group."""
    for t in tensors:
        if t.device.type != group_device.type or (
                group_device.index is not None and t.device.index != group_device.index):
            raise NcclRuleError(
                f"NCCL rule (tensors on the group's device): {site} hands a tensor on {t.device} "
                f"to group {group_name}, whose device is {group_device}")
        if t.dtype not in NCCL_DTYPES or (t.is_complex() and reduce_op in ("max", "min")):
            raise NcclRuleError(
                f"NCCL rule (its data types): {site} hands a {t.dtype} tensor to group "
                f"{group_name}; NCCL carries {', '.join(str(d) for d in NCCL_DTYPES)}")
    if reduce_op is not None and reduce_op not in NCCL_REDUCE_OPS:
        raise NcclRuleError(f"NCCL rule (its reductions): {site} asks group {group_name} for a "
                            f"{reduce_op} reduction; NCCL has {', '.join(NCCL_REDUCE_OPS)}")
