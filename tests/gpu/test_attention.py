"""Attention on CUDA: every kernel path against a float64 reference, and no (T, T) scores.

Each path ``meshwise.models.attention_kernels`` chooses on CUDA runs with
SDPA's math backend refused (``sdpa_kernel`` with the fused backends only: a
call that needs it fails), in fp32 and bf16, and its values and gradients are
compared with the same inputs in float64 through the math backend (or, for
dropout, the weights formed explicitly with the same keep-masks). The
tolerances are relative errors of the whole tensor (norm of the difference
over norm of the reference): fp32 kernels land near 1e-6, bf16 ones near 1e-2.
Ring attention's blocks on CUDA (PyTorch's fused kernels with their
log-sum-exp) are compared with the plain formulation in float64 on the same
GPU. A Llama layer at 4096 tokens runs forward and backward, and the peak
memory of fp32 grouped-query attention stays far below a score matrix.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshwise.context_parallel.ring import RingBlocks, ring_backward, ring_forward
from meshwise.geometry.documents import Documents
from meshwise.geometry.sequence import zigzag_slice
from meshwise.models.attention import ScaledDotProductAttention
from meshwise.models.attention_kernels import attention, explicit_attention
from meshwise.models.attention_masks import DocumentMask
from meshwise.models.context import ForwardContext
from meshwise.models.llama import Llama, LlamaConfig
from tests.unit.test_ring_attention import run_ring, unzigzag

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device: the GPU suite runs where there is one (python -m pytest tests/gpu)",
    ),
]
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
NAMES = ("out", "dq", "dk", "dv")
T = 512
LENGTHS = [[100, 1, 155, 256], [T]]  # ragged documents across 128-token blocks; one document


def _inputs(dtype, B=2, H=8, G=2, length=T, d=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(B, H, length, d), (B, G, length, d), (B, G, length, d), (B, H, length, d)]
    return [torch.randn(s, generator=g, device="cuda").to(dtype) for s in shapes]


def _documents(lengths=LENGTHS) -> DocumentMask:
    ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    return DocumentMask(Documents(ids.cuda(), positions.cuda()), lengths)


def _allowed(window=0, documents=None, length=T):
    """(B or 1, 1, T, T) bool, written out from positions and document ids."""
    i = torch.arange(length, device="cuda")[:, None]
    j = torch.arange(length, device="cuda")[None, :]
    seen = (j <= i) & ((i - j < window) if window else True)
    if documents is None:
        return seen[None, None]
    ids = documents.documents.ids
    return (seen & (ids[:, :, None] == ids[:, None, :]))[:, None]


def _run(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _close(got, want, dtype):
    for g, w, name in zip(got, want, NAMES):
        error = ((g.double() - w).norm() / w.norm()).item()
        assert error < TOLERANCE[dtype], (name, error)


CASES = {
    "dense": {},
    "window": {"window": 100},
    "documents+window": {"documents": True, "window": 64},
    "dropout": {"dropout": True},
    "documents+dropout": {"documents": True, "dropout": True},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_cuda_path_equals_the_float64_reference(case, dtype):
    """dense: SDPA (bf16: flash / cuDNN; fp32: heads expanded, memory-efficient);
    window, documents: compiled flex_attention; dropout: tiles of keys."""
    q, k, v, dout = _inputs(dtype)
    window = CASES[case].get("window", 0)
    documents = _documents() if CASES[case].get("documents") else None
    keep = None
    if CASES[case].get("dropout"):
        context = ForwardContext(seed=1, step=3, first_sample=0)
        keep = ScaledDotProductAttention(0.2, "blocks.0.attn.weights")._keep(q, T, context)
    with sdpa_kernel(FUSED):
        got = _run(
            lambda q, k, v: attention(q, k, v, window=window, documents=documents, keep=keep),
            q,
            k,
            v,
            dout,
        )
    mask = _allowed(window, documents)
    if keep is None:

        def reference(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        additive = torch.zeros(mask.shape, dtype=torch.float64, device="cuda").masked_fill(
            ~mask, float("-inf")
        )

        def reference(q, k, v):
            return explicit_attention(q, k, v, True, keep, additive)

    want = _run(reference, *(t.double() for t in (q, k, v, dout)))
    _close(got, want, dtype)


@pytest.mark.parametrize(
    "dtype, window",
    [(torch.float32, 0), (torch.bfloat16, 0), (torch.bfloat16, 1024)],
    ids=["fp32", "bf16", "bf16-window"],
)
def test_a_llama_layer_at_4096_tokens_needs_no_math_backend(dtype, window):
    cfg = LlamaConfig(
        n_layer=1,
        n_head=8,
        n_kv_head=2,
        d_model=512,
        ffn_hidden_size=1024,
        block_size=4096,
        sliding_window=window,
    )
    model = Llama(cfg).init_weights(0).to("cuda", dtype)
    tokens = torch.randint(0, cfg.vocab_size, (2, 4096), device="cuda")
    with sdpa_kernel(FUSED):
        model(tokens).float().square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def _peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


@pytest.mark.parametrize(
    "dtype, documents",
    [(torch.float32, False), (torch.bfloat16, True)],
    ids=["fp32-gqa", "bf16-documents"],
)
def test_attention_at_4096_tokens_keeps_no_score_matrix(dtype, documents):
    """B x H x T x T scores would take 4.3 GB in fp32 (2.1 GB in bf16) here: the
    forward and backward together stay under a quarter of that."""
    B, H, G, length = 2, 32, 8, 4096
    q, k, v, dout = _inputs(dtype, B, H, G, length)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    masks = _documents([[1000, 3000, 96], [length]]) if documents else None

    def step():
        with sdpa_kernel(FUSED):
            attention(q, k, v, documents=masks).backward(dout)

    step()  # compiles flex_attention (documents) before the measured call
    for t in (q, k, v):
        t.grad = None
    scores = B * H * length * length * dtype.itemsize
    assert _peak_bytes(step) < scores / 4


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents+window"])
def test_ring_blocks_on_cuda_equal_the_plain_formulation(dtype, masked):
    """cp 2 over 200 tokens: blocks of 100 and 50 queries and keys (neither a multiple
    of the memory-efficient kernel's alignments); bf16 causal blocks run the flash
    kernel, the rest the memory-efficient one; float64 runs the plain formulation."""
    length, cp = 200, 2
    q, k, v, dout = _inputs(dtype, length=length)
    documents = _documents([[30, 1, 120, 49], [length]]).documents if masked else None
    window = 40 if masked else 0
    scale = 1 / math.sqrt(q.shape[-1])

    def ring_of(tensors):
        def rank(ring):
            mine = [zigzag_slice(t, 2, ring.rank, cp) for t in tensors]
            plan = RingBlocks(
                ring.rank,
                cp,
                length // cp,
                documents,
                documents.ids.cpu().numpy() if masked else None,
                window,
                q.device,
            )
            out, lse = ring_forward(*mine[:3], ring, scale, blocks_of=plan)
            return (out,) + ring_backward(mine[3], *mine[:3], out, lse, ring, scale, blocks_of=plan)

        per_rank = run_ring(cp, rank)
        return [unzigzag([r[i] for r in per_rank]) for i in range(4)]

    want = ring_of([t.double() for t in (q, k, v, dout)])
    _close(ring_of([q, k, v, dout]), want, dtype)
