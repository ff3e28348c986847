"""Ring attention on one process against ``F.scaled_dot_product_attention`` (float64).

The N cp ranks of a ring run as N threads that exchange through a barrier
(``LocalRing``), so the forward and backward drivers are the code that runs on
a cp group, minus its transport (tests/dist/test_context_parallel.py runs them
over gloo).
"""

import math
import threading

import pytest
import torch
import torch.nn.functional as F

from meshwise.context_parallel import blocks
from meshwise.context_parallel.ring import ring_backward, ring_forward
from meshwise.geometry.sequence import zigzag_slice
from meshwise.models.attention import ScaledDotProductAttention
from meshwise.models.context import ForwardContext


class LocalRing:
    """Rank ``rank`` of ``size`` threads; ``exchange`` passes tensors to the next one."""

    def __init__(self, rank: int, size: int, mailbox: list, barrier: threading.Barrier):
        self.rank, self.size, self.mailbox, self.barrier = rank, size, mailbox, barrier

    def exchange(self, tensors):
        self.mailbox[(self.rank + 1) % self.size] = [t.clone() for t in tensors]
        self.barrier.wait()
        received = self.mailbox[self.rank]
        self.barrier.wait()  # nobody writes the next step's mail before all have read
        return received


def run_ring(size: int, fn):
    """``fn(ring)`` on ``size`` threads; their results in rank order."""
    mailbox, barrier = [None] * size, threading.Barrier(size, timeout=60)
    results, errors = [None] * size, []

    def body(rank):
        try:
            results[rank] = fn(LocalRing(rank, size, mailbox, barrier))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def unzigzag(chunks: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """Every rank's zigzag chunks back in sequence order."""
    size = len(chunks)
    halves = [c.chunk(2, dim=dim) for c in chunks]
    order = [halves[r][0] for r in range(size)] + [halves[r][1] for r in reversed(range(size))]
    return torch.cat(order, dim=dim)


def _inputs(B=2, H=6, G=2, T=48, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, d, generator=g, dtype=torch.float64) for n in (H, G, G)]


def _reference(q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring(q, k, v, dout, size, keep_for=None):
    scale = 1 / math.sqrt(q.shape[-1])

    def rank_fn(ring):
        mine = [zigzag_slice(t, 2, ring.rank, size) for t in (q, k, v, dout)]
        out, lse = ring_forward(*mine[:3], ring, scale, keep_for and keep_for(ring.rank))
        grads = ring_backward(
            mine[3], *mine[:3], out, lse, ring, scale, keep_for and keep_for(ring.rank)
        )
        return out, *grads

    per_rank = run_ring(size, rank_fn)
    return [unzigzag([r[i] for r in per_rank]) for i in range(4)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("plain", [False, True], ids=["fused", "plain"])
def test_ring_equals_causal_sdpa_forward_and_backward(cp, heads, plain, monkeypatch):
    if plain:  # the formulation used off the CPU and with dropout, in tiles of 5 keys
        monkeypatch.setattr(blocks, "_fused", lambda q, keep: False)
        monkeypatch.setattr(blocks, "KV_TILE", 5)
    q, k, v = _inputs(H=heads[0], G=heads[1])
    dout = torch.randn_like(q)
    expected = _reference(q, k, v, dout)
    for got, want, name in zip(_ring(q, k, v, dout, cp), expected, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def test_ring_dropout_drops_what_one_process_drops():
    """Keyed masks: the ring's blocks draw the weights' masks of the whole matrix."""
    p, context = 0.3, ForwardContext(seed=5, step=2, first_sample=4)
    q, k, v = _inputs(T=24)
    dout = torch.randn_like(q)
    single = ScaledDotProductAttention(p, "blocks.0.attn.weights").train()
    expected = _reference_with(single, q, k, v, dout, context)

    def keep_for(rank):
        from meshwise.context_parallel.ring import RingAttention

        class _Group:  # what RingAttention reads of its group to key the masks
            size, rank = 4, None

        group = _Group()
        group.rank = rank
        module = RingAttention(group, p, "blocks.0.attn.weights")
        return module._keep_for(zigzag_slice(q, 2, rank, 4), context)

    for got, want, name in zip(
        _ring(q, k, v, dout, 4, keep_for), expected, ("out", "dq", "dk", "dv")
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def _reference_with(module, q, k, v, dout, context):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, context=context)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def test_uneven_kv_heads_are_refused():
    from meshwise.context_parallel.ring import RingAttention

    q, k, v = _inputs(H=6, G=4)
    with pytest.raises(ValueError, match="6 query heads do not split into groups over 4"):
        RingAttention(cp_group=None)(q, k, v)
    with pytest.raises(ValueError, match="6 query heads do not split"):
        ScaledDotProductAttention()(q, k, v)
