"""NF4 (QLoRA's 4-bit NormalFloat) on one process: the code book against the quantiles of
N(0, 1) it is built from, the block scales, the round-trip bound, bitsandbytes' codes and
values where it runs, tensor-parallel shards holding the full weight's codes, a quantised
layer's forward and backward, and the refusals."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshwise.apply.lora import LoraConfig
from meshwise.apply.nf4 import (
    BLOCK_SIZE,
    NF4_VALUES,
    dequantize_nf4,
    nf4_code,
    quantize_layer,
    quantize_nf4,
    quantized_bytes,
)


def _weight(rows=12, cols=256, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_the_code_book_is_normal_quantiles_scaled_to_one():
    # QLoRA (Dettmers et al. 2023) section 3: 8 positive and 7 negative quantiles of
    # N(0, 1) between offset and 1/2, and an exact zero, normalised by the largest (the
    # published values are fp32, rounded from a 7-digit offset).
    offset = 0.5 * (1 / 32 + 1 / 30)
    positive = torch.special.ndtri(torch.linspace(1 - offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(1 - offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    values = values / values.abs().max()
    torch.testing.assert_close(
        torch.tensor(NF4_VALUES, dtype=torch.float64), values, atol=1e-6, rtol=0
    )
    assert NF4_VALUES[0] == -1.0 and NF4_VALUES[7] == 0.0 and NF4_VALUES[-1] == 1.0


def test_one_scale_per_block_and_the_block_maximum_comes_back_exactly():
    w = _weight()
    codes, absmax = quantize_nf4(w)
    blocks = w.reshape(-1, BLOCK_SIZE)  # (num_blocks, 64)
    assert codes.dtype == torch.uint8 and codes.numel() == w.numel() // 2
    assert torch.equal(absmax, blocks.abs().amax(1))
    back = dequantize_nf4(codes, absmax, w.shape).reshape(-1, BLOCK_SIZE)
    at = blocks.abs().argmax(1, keepdim=True)
    assert torch.equal(back.gather(1, at), blocks.gather(1, at))  # the code +-1 times absmax


def test_round_trip_within_half_the_widest_gap_of_each_block():
    w = _weight(rows=64, cols=512)
    back = dequantize_nf4(*quantize_nf4(w), w.shape)
    code = nf4_code()
    half_gap = ((code[1:] - code[:-1]).max() / 2).item()
    absmax = w.reshape(-1, BLOCK_SIZE).abs().amax(1, keepdim=True)
    error = (back - w).reshape(-1, BLOCK_SIZE).abs()
    assert (error <= absmax * half_gap * (1 + 1e-6)).all()
    # the nearest code: no other value of the code book is closer
    scaled = (w.reshape(-1, BLOCK_SIZE) / absmax).unsqueeze(-1)
    nearest = (scaled - code).abs().amin(-1)
    assert (error <= absmax * (nearest + 1e-6)).all()  # to fp32 round-off
    assert error.max() > 0  # lossy, as NF4 is


def test_values_are_the_code_of_each_nibble_times_its_block_scale_across_lookups():
    from meshwise.apply.nf4 import CPU_LOOKUP_BYTES

    w = _weight(rows=5, cols=CPU_LOOKUP_BYTES + 128)  # two codes a byte: 2.5 lookups
    codes, absmax = quantize_nf4(w)
    nibbles = torch.stack((codes >> 4, codes & 0xF), dim=1).reshape(-1, BLOCK_SIZE).long()
    want = (nf4_code()[nibbles] * absmax.unsqueeze(1)).reshape(w.shape)
    assert torch.equal(dequantize_nf4(codes, absmax, w.shape), want)
    half = dequantize_nf4(codes, absmax, w.shape, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, want.bfloat16())


def test_codes_and_values_equal_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes.functional")
    w = _weight(rows=16, cols=192, seed=3)
    w[0, :BLOCK_SIZE] = 0.0  # a block of zeros: scale 0
    codes, state = bnb.quantize_4bit(w, blocksize=BLOCK_SIZE, quant_type="nf4")
    ours, absmax = quantize_nf4(w)
    assert torch.equal(codes.reshape(-1), ours) and torch.equal(state.absmax, absmax)
    assert torch.equal(state.code, nf4_code())
    assert torch.equal(bnb.dequantize_4bit(codes, state), dequantize_nf4(ours, absmax, w.shape))


def test_a_tensor_parallel_shard_holds_the_full_weight_s_codes():
    w = _weight(rows=8, cols=256)
    codes, absmax = quantize_nf4(w)
    codes, absmax = codes.view(8, 128), absmax.view(8, 4)  # per row: 128 bytes, 4 scales
    for tp in (2, 4):
        for rank in range(tp):
            rows = slice(rank * 8 // tp, (rank + 1) * 8 // tp)  # column-parallel: whole rows
            assert torch.equal(quantize_nf4(w[rows])[0], codes[rows].reshape(-1))
            cols = slice(rank * 256 // tp, (rank + 1) * 256 // tp)  # row-parallel: a slice of each
            piece_codes, piece_absmax = quantize_nf4(w[:, cols].contiguous())
            byte = slice(cols.start // 2, cols.stop // 2)
            block = slice(cols.start // BLOCK_SIZE, cols.stop // BLOCK_SIZE)
            assert torch.equal(piece_codes, codes[:, byte].reshape(-1))
            assert torch.equal(piece_absmax, absmax[:, block].reshape(-1))


def test_a_quantised_layer_computes_with_the_dequantised_weight_forward_and_backward():
    torch.manual_seed(0)
    layer = nn.Linear(128, 32)
    w = layer.weight.detach().clone()
    layer.weight.requires_grad_(False)
    state = quantize_layer(layer, w, torch.float32)
    assert [n for n, _ in layer.named_parameters()] == ["bias"]  # no dense weight kept
    assert quantized_bytes([layer]) == 128 * 32 // 2 + 128 * 32 // BLOCK_SIZE * 4
    dense = dequantize_nf4(state.codes, state.absmax, (32, 128))
    x = torch.randn(3, 5, 128, requires_grad=True)
    saved = []

    def keep(t):  # what the graph keeps for backward
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        y = layer(x)
    assert not any(isinstance(t, torch.Tensor) and t.shape == (32, 128) for t in saved)
    y.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    F.linear(x_ref, dense, layer.bias).square().sum().backward()
    torch.testing.assert_close(y, F.linear(x_ref, dense, layer.bias), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    assert layer.weight.device.type == "meta"  # between forwards: shape only


def test_quantising_under_activation_checkpointing_dequantises_again():
    torch.manual_seed(1)
    layer = nn.Linear(64, 16, bias=False)
    layer.weight.requires_grad_(False)
    state = quantize_layer(layer, layer.weight.detach().clone(), torch.float32)
    dense = dequantize_nf4(state.codes, state.absmax, (16, 64))
    x = torch.randn(4, 64, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    y.sum().backward()
    torch.testing.assert_close(x.grad, dense.sum(0).expand(4, 64), rtol=0, atol=0)


def test_refusals_name_the_bad_value():
    with pytest.raises(ValueError, match="--quantize-base 'int4'; valid: none, nf4"):
        LoraConfig(lora_rank=2, quantize_base="int4").check()
    with pytest.raises(ValueError, match="valid: with --lora-rank > 0, or --quantize-base none"):
        LoraConfig(quantize_base="nf4").check()
    with pytest.raises(ValueError, match="not a whole number of 64-value blocks"):
        quantize_layer(nn.Linear(96, 8), torch.zeros(8, 96), torch.float32)


def test_compile_is_refused_from_the_config():
    from meshwise.cli.main import build_parser
    from meshwise.cli.train import train_config

    argv = ["train", "--model", "llama-tiny", "--lora-rank", "4", "--quantize-base", "nf4"]
    with pytest.raises(ValueError, match="--quantize-base nf4 with --compile is not supported"):
        train_config(build_parser().parse_args([*argv, "--compile"]))
    train_config(build_parser().parse_args([*argv, "--dp", "2", "--zero", "3"]))  # served


def test_a_tp_splitting_rows_into_partial_blocks_lists_the_valid_tp():
    from meshwise.train.config import TrainConfig
    from meshwise.train.lora_setup import check_lora

    cfg = TrainConfig()
    cfg.model.preset, cfg.model.n_kv_head = "llama-tiny", 4
    cfg.lora.lora_rank, cfg.lora.quantize_base, cfg.parallel.tp = 4, "nf4", 4
    with pytest.raises(
        ValueError,
        match=r"--tp 4: a row of layers.0.self_attn.o_proj holds 128 / tp 4 = 32 values per "
        r"rank, not whole 64-value NF4 blocks; valid: --tp 1, 2",
    ):
        check_lora(cfg, 256)
    cfg.parallel.tp = 2
    check_lora(cfg, 256)
