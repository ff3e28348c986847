"""Compressors on one process: round trips, error-feedback bookkeeping, bytes moved."""

import pytest
import torch

from meshwise.comm.compression.compressor import LocalComm
from meshwise.comm.compression.compressors import (
    CastCompressor,
    Int8Compressor,
    TopKCompressor,
    build_compressor,
    dequantize_int8,
    parse_compress,
    quantize_int8,
)
from meshwise.comm.compression.powersgd import PowerSGDCompressor, orthogonalize


class CountingComm(LocalComm):
    """A group of one that counts the bytes each collective would move."""

    def __init__(self):
        self.moved = 0

    def all_reduce(self, tensor):
        self.moved += tensor.numel() * tensor.element_size()

    def all_gather(self, out, inp):
        self.moved += inp.numel() * inp.element_size()
        super().all_gather(out, inp)

    def all_to_all(self, sends, recvs):
        self.moved += sum(s.numel() * s.element_size() for s in sends)
        super().all_to_all(sends, recvs)


def grads(n=4096, steps=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * (1 + torch.arange(n) % 7) for _ in range(steps)]


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("none", "none"),
        ("fp16", "fp16"),
        ("bf16", "bf16"),
        ("int8", "int8"),
        ("topk:0.01", "topk:0.01"),
        ("powersgd:4", "powersgd:4"),
    ],
)
def test_parse_valid(spec, expected):
    assert str(parse_compress(spec)) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "zip",
        "topk:0",
        "topk:1.5",
        "topk:1",
        "topk:x",
        "topk",
        "powersgd:0",
        "powersgd:1.5",
        "powersgd",
        "int8:3",
        "fp32",
    ],
)
def test_parse_invalid_names_valid_values(spec):
    with pytest.raises(ValueError, match="valid: none, fp16, bf16, int8, topk:FRACTION"):
        parse_compress(spec)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_round_trip_and_half_the_bytes(dtype):
    x = grads(1000, 1)[0]
    out, comm = x.clone(), CountingComm()
    CastCompressor(dtype).reduce("b", out, comm)
    assert torch.equal(out, x.to(dtype).float())
    assert comm.moved == x.numel() * 2


def test_int8_quantisation_error_is_bounded_per_chunk():
    x = grads(3000, 1)[0]
    q, s = quantize_int8(x, 1024)
    assert q.dtype == torch.int8 and s.numel() == 3
    err = (dequantize_int8(q, s, 1024) - x).abs()
    for c in range(3):
        chunk = slice(c * 1024, (c + 1) * 1024)
        assert err[chunk].max() <= x[chunk].abs().max() / 127 / 2 + 1e-6


def test_int8_moves_a_quarter_and_carries_what_it_did_not_send():
    comp, comm = Int8Compressor(), CountingComm()
    total_in, total_out = torch.zeros(4096), torch.zeros(4096)
    for g in grads():
        out = g.clone()
        comp.reduce("b", out, comm)
        total_in += g
        total_out += out
    # Error feedback: applied + held back (own residual, and the owner's) == given.
    held = comp.errors["b"] + comp.owner_errors["b"]
    torch.testing.assert_close(total_out + held, total_in, atol=1e-4, rtol=0)
    per_step = comm.moved / 5
    assert per_step == 2 * (4096 + 4 * 4)  # int8 values + fp32 scales, two phases
    assert per_step / (2 * 4096 * 4) < 0.26


def test_without_error_feedback_nothing_is_carried():
    comp = Int8Compressor(error_feedback=False)
    out = grads(4096, 1)[0]
    comp.reduce("b", out, LocalComm())
    assert comp.errors == {} and comp.owner_errors == {}


def test_topk_sends_k_pairs_with_indices_counted():
    comp, comm = TopKCompressor(0.01, warmup_steps=0, ramp_steps=0), CountingComm()
    g = grads(10000, 1)[0]
    out = g.clone()
    comp.reduce("b", out, comm)
    k = 100
    assert comm.moved == k * (4 + 4)  # fp32 value + int32 index per entry
    assert int((out != 0).sum()) == k
    largest = g.abs().topk(k).indices
    torch.testing.assert_close(out[largest], g[largest])
    # What was not sent is carried, exactly.
    torch.testing.assert_close(comp.errors["b"] + out, g)


def test_topk_error_feedback_sends_everything_eventually():
    comp = TopKCompressor(0.1, warmup_steps=0, ramp_steps=0)
    g = torch.arange(1.0, 11.0)  # one entry per step leaves, the rest waits
    total = torch.zeros(10)
    for _ in range(60):
        out = g.clone()
        comp.reduce("b", out, LocalComm())
        total += out
    torch.testing.assert_close(total + comp.errors["b"], 60 * g)
    assert (total > 0).all(), "every entry was sent at least once"


def test_topk_warms_up_uncompressed_then_ramps_density_down():
    comp, n = TopKCompressor(0.01, warmup_steps=2, ramp_steps=4), 10000
    g = grads(n, 1)[0]
    sent = []
    for _ in range(8):
        comm, out = CountingComm(), g.clone()
        comp.reduce("b", out, comm)
        sent.append(comm.moved // 8 if comp.step >= 2 else None)
        if comp.step < 2:  # warm-up: the plain sum, nothing carried
            assert torch.equal(out, g) and comp.errors == {} and comm.moved == 4 * n
        comp.end_step()
    # 25%, then exponentially down to 1%, then 1% for good: (0.25 / 0.01) ** (1/4) per step.
    assert sent[2:] == [2500, 1119, 500, 224, 100, 100]


def test_orthogonalize_gives_orthonormal_columns():
    m = torch.randn(50, 4)
    orthogonalize(m)
    torch.testing.assert_close(m.t() @ m, torch.eye(4), atol=1e-5, rtol=0)


def _powersgd(rank=2, warmup=0, **kw):
    comp = PowerSGDCompressor(rank, warmup_steps=warmup, **kw)
    # a 64x48 matrix, a vector, a 3x3 matrix (too small to compress), padding
    comp.set_layout("b", [(0, (64, 48)), (3072, (48,)), (3120, (3, 3))])
    return comp


def test_powersgd_low_rank_exact_and_residual_carried():
    comp, comm = _powersgd(rank=2), CountingComm()
    u, v = torch.randn(64, 2), torch.randn(2, 48)
    g = torch.randn(3132)
    g[:3072] = (u @ v).view(-1)  # rank 2: recovered exactly after one power iteration
    out = g.clone()
    comp.reduce("b", out, comm)
    torch.testing.assert_close(out, g, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(comp.errors["b"] + out, g, atol=1e-5, rtol=0)
    # P (64x2) + vectors (48 + 9 + 3) in one call, Q (48x2) in another, fp32.
    assert comm.moved == 4 * (64 * 2 + 60 + 48 * 2)


def test_powersgd_warmup_is_uncompressed_and_warm_start_converges():
    comp = _powersgd(rank=1, warmup=2)
    g = torch.randn(3132)
    for _ in range(2):
        out = g.clone()
        comp.reduce("b", out, LocalComm())
        assert torch.equal(out, g) and comp.errors == {}
        comp.end_step()
    # Compressed: error feedback keeps the running sum honest step after step.
    total = torch.zeros(3132)
    for _ in range(30):
        out = g.clone()
        comp.reduce("b", out, LocalComm())
        total += out
        comp.end_step()
    torch.testing.assert_close(total + comp.errors["b"], 30 * g, atol=1e-3, rtol=0)
    # Vectors and the small matrix are exact every step.
    torch.testing.assert_close(out[3072:], g[3072:])


def test_powersgd_without_error_feedback_keeps_no_residual():
    comp = _powersgd(error_feedback=False)
    out = torch.randn(3132)
    comp.reduce("b", out, LocalComm())
    assert comp.errors == {}


@pytest.mark.parametrize("spec", ["int8", "topk:0.05", "powersgd:2"])
def test_state_tensors_restore_a_compressor_exactly(spec):
    def fresh():
        comp = build_compressor(spec, warmup_steps=1, topk_ramp_steps=4)
        if hasattr(comp, "set_layout"):
            comp.set_layout(0, [(0, (64, 48)), (3072, (60,))])
        return comp

    comm = LocalComm()  # int8 re-quantises the owned sum here too: both errors are kept
    steps = grads(3132, 6)
    first = fresh()
    for g in steps[:3]:
        first.reduce(0, g.clone(), comm)
        first.end_step()
    saved = {name: t.clone() for name, t in first.state_tensors().items()}
    kinds = {name.split(".")[0] for name in saved}
    assert (
        kinds
        == {"int8": {"error", "owner_error"}, "topk:0.05": {"error"}, "powersgd:2": {"error", "q"}}[
            spec
        ]
    )
    second = fresh()
    second.step = first.step
    second.load_state_tensors(saved, "cpu")
    for g in steps[3:]:
        a, b = g.clone(), g.clone()
        first.reduce(0, a, comm)
        second.reduce(0, b, comm)
        first.end_step()
        second.end_step()
        assert torch.equal(a, b)
