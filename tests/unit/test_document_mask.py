"""Document masking on one process against each document run alone (float64).

The reference is independent of the masking code: the plain model (or
``F.scaled_dot_product_attention`` with its causal flag) run on each document
cut out of the packed sequence, from position 0. Packed and masked, every
document's logits, attention outputs and gradients must be those.
"""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshwise.context_parallel import blocks
from meshwise.context_parallel.ring import RingBlocks, ring_backward, ring_forward
from meshwise.data.packing import documents_from_starts
from meshwise.geometry.documents import Documents
from meshwise.geometry.sequence import zigzag_slice
from meshwise.models.attention_masks import DocumentMask
from meshwise.models.context import ForwardContext, takes_context
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.models.llama import Llama, LlamaConfig
from tests.unit.test_ring_attention import run_ring, unzigzag

T = 32
# Two rows: documents of 5, 11, 1 and 15 tokens; one document of 9 then one of 23.
STARTS = [[0, 5, 16, 17], [0, 9]]


def _documents() -> Documents:
    starts = np.zeros((len(STARTS), T), dtype=bool)
    for row, cuts in enumerate(STARTS):
        starts[row, cuts] = True
    return documents_from_starts(starts)


def _segments(row: int):
    cuts = STARTS[row] + [T]
    return list(zip(cuts[:-1], cuts[1:]))


def test_ids_and_positions_restart_at_each_document():
    docs = _documents()
    assert docs.positions[0, :6].tolist() == [0, 1, 2, 3, 4, 0]
    assert docs.positions[0, 16:18].tolist() == [0, 0]
    assert len(np.unique(docs.ids[1])) == 2
    allowed = docs.to("cpu").allowed(torch.arange(T), torch.arange(T))[1, 0]  # (T, T)
    assert allowed[9, 9] and allowed[10, 9] and not allowed[9, 8] and not allowed[8, 9]


def _context(rows: int = 2) -> ForwardContext:
    host = _documents().rows(0, rows)
    return ForwardContext(step=1, documents=DocumentMask.of(host, host.to("cpu")))


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_packed_documents_give_each_documents_own_logits_and_gradients(model):
    torch.manual_seed(0)
    if model == "gpt":
        plain = GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, block_size=T, vocab_size=50))
    else:
        plain = Llama(
            LlamaConfig(
                n_layer=2,
                n_head=4,
                n_kv_head=2,
                d_model=32,
                ffn_hidden_size=48,
                block_size=T,
                vocab_size=50,
            )
        )
    plain = plain.init_weights(seed=3).double()
    masked = copy.deepcopy(plain)
    ids = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(1))
    logits = masked(ids, context=_context())
    logits.square().sum().backward()
    for row in range(2):
        for start, end in _segments(row):
            alone = plain(ids[row : row + 1, start:end])
            torch.testing.assert_close(logits[row, start:end], alone[0], rtol=0, atol=1e-10)
            alone.square().sum().backward()  # the gradients sum over the documents
    for (name, got), (_, want) in zip(masked.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10, msg=name)


def _inputs(heads=4, kv_heads=2, d=8):
    g = torch.Generator().manual_seed(5)
    return [
        torch.randn(2, n, T, d, generator=g, dtype=torch.float64)
        for n in (heads, kv_heads, kv_heads, heads)
    ]


def _each_document_alone(q, k, v, dout):
    """Attention of every document on its own (causal from its first token)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.zeros_like(q)
    for row in range(q.shape[0]):
        for start, end in _segments(row):
            part = slice(start, end)
            out[row, :, part] = F.scaled_dot_product_attention(
                q[row : row + 1, :, part],
                k[row : row + 1, :, part],
                v[row : row + 1, :, part],
                is_causal=True,
                enable_gqa=True,
            )[0]
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_with_documents_equals_each_document_alone(cp, fused, monkeypatch):
    if not fused:  # the plain formulation (GPUs, dropout) in place of the CPU kernel
        monkeypatch.setattr(blocks, "_fused", lambda q, keep: False)
    q, k, v, dout = _inputs()
    docs = _documents()
    scale = 1 / math.sqrt(q.shape[-1])
    skipped = []

    def rank(ring):
        mine = [zigzag_slice(t, 2, ring.rank, ring.size) for t in (q, k, v, dout)]
        plan = RingBlocks(ring.rank, ring.size, T // ring.size, docs.to("cpu"), docs.ids)
        skipped.extend(
            s for s in range(1, ring.size) if plan(s, (ring.rank - s) % ring.size) is None
        )
        out, lse = ring_forward(*mine[:3], ring, scale, blocks_of=plan)
        grads = ring_backward(mine[3], *mine[:3], out, lse, ring, scale, blocks_of=plan)
        return (out,) + grads

    per_rank = run_ring(cp, rank)
    want = _each_document_alone(q, k, v, dout)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = unzigzag([r[i] for r in per_rank])
        torch.testing.assert_close(got, want[i], rtol=1e-10, atol=1e-12, msg=name)
    if cp == 4:  # row 0's 15-token document and row 1's: most later blocks see nothing
        assert skipped


@pytest.mark.parametrize("path", ["each document", "mask (dropout's)"])
def test_sdpa_module_with_documents_equals_each_document_alone(path):
    from meshwise.models.attention import ScaledDotProductAttention

    q, k, v, dout = _inputs()
    context = _context()
    sdpa = ScaledDotProductAttention(0.0, "attn")
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    if path == "each document":
        out = sdpa(q_, k_, v_, context=context)
    else:  # the weights formed explicitly, as with dropout (p = 0: every weight kept)
        out = sdpa._with_dropout(
            q_, k_, v_, True, context.documents.additive(T, 0, q.dtype), context
        )
    out.backward(dout)
    want = _each_document_alone(q, k, v, dout)
    for got, expected in zip((out.detach(), q_.grad, k_.grad, v_.grad), want):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_model_whose_forward_takes_no_context_is_refused_document_masking():
    """The documents reach attention only through the forward's context: a model of one's
    own that takes none would silently attend across documents."""
    from examples.own_model import TinyLM
    from meshwise.train.batches import _check_documents_reach

    gpt = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=T, vocab_size=50))
    _check_documents_reach([gpt], takes_context(gpt))
    with pytest.raises(ValueError, match="a forward that takes context="):
        _check_documents_reach([TinyLM()], takes_context(TinyLM()))
