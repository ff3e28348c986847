"""Compute orders of the schedules with a split backward: ZB-H1, ZB-V, DualPipeV (pure).

One rank's order as ``(kind, micro_batch, chunk)``: a ``B`` followed later by its ``W`` is a
split backward, a ``B`` alone a whole one; ``schedules`` places the messages. The orders are
torch.distributed.pipelining's (``tests/unit/test_zero_bubble.py``); docs/pipelines.md.
"""

from __future__ import annotations

from collections import deque

from meshwise.pipeline.actions import Order


def zb_h1_order(S: int, M: int, V: int, rank: int) -> Order:
    """ZB-H1 (Qi et al. 2024, section 2.1): 1F1B's warm-up, so rank 0 holds no more than under
    1F1B; the k-th steady step runs F, B, and the W of micro-batch k - rank once k >= rank;
    the remaining W passes fill the cool-down.
    """
    num_warmup = min(S - rank - 1, M)
    order: Order = [("F", m, 0) for m in range(num_warmup)]  # warm-up: forwards
    next_weight = 0
    for k in range(M):  # one backward per step
        if num_warmup + k < M:
            order.append(("F", num_warmup + k, 0))
        order.append(("B", k, 0))
        if k >= rank:  # the first `rank` weight passes wait for the cool-down
            order.append(("W", next_weight, 0))
            next_weight += 1
    order += [("W", m, 0) for m in range(next_weight, M)]  # cool-down: W fills it
    return order


class _Counters:
    """Next micro-batch of each (kind, chunk) on one rank, and the order being built."""

    def __init__(self):
        self.order: Order = []
        self.next = {(k, c): 0 for k in ("F", "B") for c in (0, 1)}
        self.waiting_weights: deque = deque()  # split backwards whose W has not run

    def forward(self, chunk: int) -> None:
        self._append("F", chunk)

    def backward(self, chunk: int, split: bool = False, weight_now: bool = False) -> None:
        mb = self._append("B", chunk)
        if weight_now:
            self.order.append(("W", mb, chunk))
        elif split:
            self.waiting_weights.append((mb, chunk))

    def weight(self) -> None:
        """The oldest postponed weight pass, if any."""
        if self.waiting_weights:
            mb, chunk = self.waiting_weights.popleft()
            self.order.append(("W", mb, chunk))

    def _append(self, kind: str, chunk: int) -> int:
        mb = self.next[(kind, chunk)]
        self.next[(kind, chunk)] = mb + 1
        self.order.append((kind, mb, chunk))
        return mb


def zbv_order(S: int, M: int, V: int, rank: int) -> Order:
    """ZB-V (Qi et al. 2024, section 6): stages r and 2S - 1 - r, a warm-up of 2(S - r) - 1
    forwards, B with W in the steady state, postponed W in the cool-down (1F1B's activation
    memory, twice its messages). Built for max(M, 2S - 1) micro-batches (the fewest that
    fill the V), then those past M are dropped.
    """
    n = max(M, 2 * S - 1)
    c = _Counters()
    for _ in range(2 * (S - rank) - 1):  # warm-up down the first chunk
        c.forward(0)
    for _ in range(rank):  # both chunks start
        c.forward(1)
        c.forward(0)
    for _ in range(S - rank):  # the second chunk's first backwards
        c.forward(1)
        c.backward(1, weight_now=True)
    while c.next[("F", 1)] < c.next[("F", 0)] or c.next[("F", 0)] < n:  # steady state
        if c.next[("F", 0)] < n:
            c.forward(0)
        c.backward(0, weight_now=True)
        c.forward(1)
        c.backward(1, weight_now=True)
    for _ in range(rank):  # cool-down: W postponed
        c.backward(0, split=True)
        c.backward(1, split=True)
    postponed_second = [w for w in c.waiting_weights if w[1] == 1]
    first = deque(w for w in c.waiting_weights if w[1] == 0)
    c.waiting_weights = first
    for _ in range(S - rank):
        c.backward(0, split=True)
        c.weight()
    c.order += [("W", mb, chunk) for mb, chunk in postponed_second]
    c.order += [("W", mb, chunk) for mb, chunk in c.waiting_weights]
    return [action for action in c.order if action[1] < M]


def dualpipev_order(S: int, M: int, V: int, rank: int) -> Order:
    """DualPipeV (DeepSeek-V3 report, Liu et al. 2024, section 3.2.1: DualPipe's V-shaped half),
    in eight phases; needs M >= 2S. A forward of one chunk pairs with a backward of the other,
    run back to back here (DualPipe overlaps their communication on a GPU).
    """
    c = _Counters()
    for _ in range(2 * (S - rank - 1)):  # 1: forwards of the first chunk
        c.forward(0)
    for _ in range(rank + 1):  # 2: both chunks
        c.forward(0)
        c.forward(1)
    for _ in range(S - rank - 1):  # 3: split backwards of the second
        c.backward(1, split=True)
        c.weight()
        c.forward(1)
    for _ in range(M - 2 * S + rank + 1):  # 4: F of one chunk with B of the other
        c.forward(0)  # (the last rank's first pair runs unpaired; the order is the same)
        c.backward(1)
        c.forward(1)
        c.backward(0)
    for _ in range(S - rank - 1):  # 5: the second chunk drains
        c.backward(1)
        c.forward(1)
        c.backward(0)
    split = False
    for i in range(rank + 1):  # 6: both chunks' last backwards,
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)  # split from halfway
        c.backward(1, split=split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        c.backward(0, split=split)
    for _ in range(S - rank - 1):  # 7: postponed W between backwards
        c.weight()
        c.backward(0, split=split)
    for _ in range(rank + 1):  # 8: the remaining W passes
        c.weight()
    return c.order
