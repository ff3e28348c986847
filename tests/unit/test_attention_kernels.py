"""Every attention kernel against an independent reference, on the CPU (float64).

The CUDA paths are forced here (``attention(..., kernel=...)``) where their
operations run on the CPU: SDPA with the key/value heads expanded,
``flex_attention`` run eagerly (values only: it has no backward on the CPU;
and it evaluates its mask rule on every pair, so the block lists it would
skip by on a GPU are checked on their own, against ``create_block_mask``),
and dropout over tiles of keys. The reference is
``F.scaled_dot_product_attention`` with a boolean mask written out here, or
each document cut out and attended alone.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from meshwise.context_parallel import blocks
from meshwise.context_parallel.ring import RingBlocks, ring_backward, ring_forward
from meshwise.geometry.documents import Documents
from meshwise.geometry.sequence import zigzag_slice
from meshwise.models import tiled_attention
from meshwise.models.attention import ScaledDotProductAttention
from meshwise.models.attention_kernels import KERNELS, attention, choose_kernel
from meshwise.models.attention_masks import DocumentMask, block_mask, mask_mod
from meshwise.models.context import ForwardContext
from tests.unit.test_ring_attention import run_ring, unzigzag

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
T = 40
# Three rows of 40 tokens: ragged documents; one document; many short ones.
LENGTHS = [[7, 20, 1, 12], [40], [3, 3, 3, 3, 3, 3, 3, 19]]


def _inputs(B=3, H=6, G=2, t_q=T, t_k=T, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, t_q, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, G, t_k, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(B, H, t_q, d, generator=g, dtype=torch.float64)


def _documents(lengths=LENGTHS) -> DocumentMask:
    ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    return DocumentMask(Documents(ids, positions), lengths)


def _reference_mask(t_q, t_k, window=0, lengths=None):
    """(B or 1, 1, Tq, Tk): written out pair by pair, the queries the last positions."""
    rows = []
    for row in lengths or [[t_k]]:
        doc = [i for i, n in enumerate(row) for _ in range(n)]
        rows.append(
            [
                [j <= i and (not window or i - j < window) and doc[i] == doc[j] for j in range(t_k)]
                for i in range(t_k - t_q, t_k)
            ]
        )
    return torch.tensor(rows)[:, None]


def _run(fn, q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _same(got, want, tol=1e-10):
    for g, w, name in zip(got, want, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)


def _check(kernel, fn, q, k, v, dout, want):
    """``fn``'s values and gradients against ``want``'s; flex_attention has no backward on
    the CPU, so its values only (tests/gpu/test_attention.py checks its gradients)."""
    if kernel != "flex":
        return _same(_run(fn, q, k, v, dout), want)
    torch.testing.assert_close(fn(q, k, v), want[0], rtol=1e-10, atol=1e-10)


def _masked_sdpa(mask):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("heads", [(6, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "decoding"])
def test_expanded_heads_equal_grouped_sdpa(heads, causal):
    """fp32's CUDA path: the key/value heads repeated for their query heads."""
    q, k, v, dout = _inputs(H=heads[0], G=heads[1], t_q=T if causal else 1)
    want = _run(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
        q,
        k,
        v,
        dout,
    )
    _same(
        _run(lambda q, k, v: attention(q, k, v, causal, kernel="sdpa_expanded"), q, k, v, dout),
        want,
    )


@pytest.mark.parametrize("window", [1, 3, 8, 39, 40, 64])
@pytest.mark.parametrize("kernel", ["flex", "sdpa_mask", "tiled", "explicit"])
def test_sliding_window_equals_the_written_out_mask(window, kernel):
    q, k, v, dout = _inputs()
    want = _run(_masked_sdpa(_reference_mask(T, T, window)), q, k, v, dout)
    _check(
        kernel,
        lambda q, k, v: attention(q, k, v, window=window, kernel=kernel),
        q,
        k,
        v,
        dout,
        want,
    )


@pytest.mark.parametrize("window", [0, 2, 5, 16])
@pytest.mark.parametrize("kernel", ["flex", "each_document", "sdpa_mask", "tiled", "explicit"])
def test_documents_equal_each_document_alone(window, kernel, monkeypatch):
    monkeypatch.setattr(tiled_attention, "KV_TILE", 6)  # several tiles per row
    q, k, v, dout = _inputs()

    def alone(q, k, v):  # each document cut out and attended from its first token
        out = torch.zeros_like(q)
        for b, row in enumerate(LENGTHS):
            start = 0
            for n in row:
                part = slice(start, start + n)
                out[b, :, part] = _masked_sdpa(_reference_mask(n, n, window))(
                    q[b : b + 1, :, part], k[b : b + 1, :, part], v[b : b + 1, :, part]
                )[0]
                start += n
        return out

    _check(
        kernel,
        lambda q, k, v: attention(q, k, v, window=window, documents=_documents(), kernel=kernel),
        q,
        k,
        v,
        dout,
        _run(alone, q, k, v, dout),
    )


def test_the_documents_mask_without_host_lengths_is_one_masked_call():
    q, k, v, dout = _inputs()
    docs = _documents()
    want = _run(lambda q, k, v: attention(q, k, v, documents=docs), q, k, v, dout)
    docs.lengths = None
    _same(
        _run(
            lambda q, k, v: attention(q, k, v, documents=docs, kernel="each_document"),
            q,
            k,
            v,
            dout,
        ),
        want,
    )


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_tiled_dropout_drops_what_the_explicit_weights_drop(documents, heads, monkeypatch):
    """CUDA's dropout over tiles of keys against the weights formed whole (the CPU's
    path), with the same keyed keep-masks, in the forward and the backward."""
    monkeypatch.setattr(tiled_attention, "KV_TILE", 7)
    q, k, v, dout = _inputs(H=heads[0], G=heads[1])
    context = ForwardContext(seed=3, step=4, first_sample=2)
    module = ScaledDotProductAttention(0.3, "blocks.1.attn.weights").train()
    masks = _documents() if documents else None

    def run(kernel):
        def fn(q, k, v):
            return attention(
                q, k, v, documents=masks, keep=module._keep(q, T, context), kernel=kernel
            )

        return _run(fn, q, k, v, dout)

    explicit = run("explicit")
    _same(run("tiled"), explicit)
    if not documents:  # the module itself (the CPU's choice) drops the same weights
        _same(_run(lambda q, k, v: module(q, k, v, context=context), q, k, v, dout), explicit)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("kernel", [None, "sdpa_expanded", "sdpa_mask"])
def test_decoding_after_a_cache_equals_the_last_row_of_causal_attention(window, kernel):
    """One query over P + 1 cached keys (causal=False: it sees every key, or its window)
    against the last row of causal attention over the whole sequence."""
    if kernel == "sdpa_expanded" and window:
        pytest.skip("a window over a cache takes a mask")
    q, k, v, _ = _inputs()
    whole = attention(q, k, v, window=window)
    last = attention(q[:, :, -1:], k, v, causal=False, window=window, kernel=kernel)
    torch.testing.assert_close(last, whole[:, :, -1:], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="causal attention of 1 queries over 40 keys"):
        attention(q[:, :, -1:], k, v)


def test_the_kernel_choice():
    fp32, bf16 = torch.float32, torch.bfloat16

    def cuda(dtype=bf16, grouped=True, window=False, documents=False, dropout=False, whole=True):
        return choose_kernel("cuda", dtype, grouped, window, documents, dropout, whole)

    assert cuda() == "sdpa" and cuda(fp32, grouped=False) == "sdpa"
    assert cuda(fp32) == "sdpa_expanded" and cuda(fp32, whole=False) == "sdpa_expanded"
    assert cuda(window=True) == "flex" and cuda(fp32, documents=True) == "flex"
    assert cuda(window=True, whole=False) == "sdpa_mask"
    assert cuda(dropout=True, documents=True) == "tiled"
    assert choose_kernel("cpu", fp32, True, False, False, False, True) == "sdpa"
    assert choose_kernel("cpu", fp32, True, True, False, False, True) == "sdpa_mask"
    assert choose_kernel("cpu", fp32, True, True, True, False, True) == "each_document"
    assert choose_kernel("cpu", fp32, True, False, True, True, True) == "explicit"
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="valid: " + ", ".join(KERNELS)):
        attention(q, k, v, kernel="math")


@pytest.mark.parametrize("length", [48, 50, 8, 3])
@pytest.mark.parametrize("window", [0, 1, 5, 8, 17])
@pytest.mark.parametrize("documents", [False, True])
def test_block_lists_equal_create_block_mask(length, window, documents):
    """The blocks worked out from positions and id ranges are those flex's own
    ``create_block_mask`` finds by evaluating the rule on every pair (blocks of 8)."""
    g = torch.Generator().manual_seed(length + window)
    # ids that never decrease: a new document where a coin says so (some rows: one)
    starts = torch.rand(4, length, generator=g) < torch.tensor([[0.0], [0.1], [0.3], [0.9]])
    ids = starts.long().cumsum(1) if documents else None
    mine = block_mask(length, window, ids, block_size=8, device="cpu")
    theirs = create_block_mask(
        mask_mod(window, ids),
        4 if documents else None,
        None,
        length,
        length,
        device="cpu",
        BLOCK_SIZE=8,
    )
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
    assert mine.seq_lengths == theirs.seq_lengths


def test_a_forward_makes_each_document_mask_once():
    docs = _documents()
    assert docs.block_mask(T, 5) is docs.block_mask(T, 5)
    assert docs.additive(T, 0, torch.float64) is docs.additive(T, 0, torch.float64)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("window", [3, 9, 20])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_with_a_window_equals_one_process(cp, window, documents, fused, monkeypatch):
    """The ring's blocks masked by the window over global positions (and documents);
    blocks wholly outside every query's window are skipped."""
    if not fused:
        monkeypatch.setattr(blocks, "_fused", lambda q, keep: False)
    q, k, v, dout = _inputs()
    masks = _documents() if documents else None
    want = _run(
        _masked_sdpa(_reference_mask(T, T, window, LENGTHS if documents else None)), q, k, v, dout
    )
    scale = 1 / math.sqrt(q.shape[-1])
    skipped = []

    def rank(ring):
        mine = [zigzag_slice(t, 2, ring.rank, ring.size) for t in (q, k, v, dout)]
        docs = masks.documents if documents else None
        plan = RingBlocks(
            ring.rank,
            ring.size,
            T // ring.size,
            docs,
            docs.ids.numpy() if documents else None,
            window,
            q.device,
        )
        skipped.extend(
            s for s in range(1, ring.size) if plan(s, (ring.rank - s) % ring.size) is None
        )
        out, lse = ring_forward(*mine[:3], ring, scale, blocks_of=plan)
        return (out,) + ring_backward(mine[3], *mine[:3], out, lse, ring, scale, blocks_of=plan)

    per_rank = run_ring(cp, rank)
    _same([unzigzag([r[i] for r in per_rank]) for i in range(4)], want)
    if cp == 4 and window == 3:  # chunks of 5 tokens: most blocks lie outside the window
        assert skipped
