"""Mixture of experts, LoRA, QLoRA and ``--compile`` on one CUDA device: each matches
its CPU (or eager) curve in fp32 and trains in bf16 (``--dtype auto``); NF4 codes and
their dequantised values are the CPU's bit for bit."""

import pytest
import torch

from tests.e2e.test_moe_cli import MOE
from tests.gpu.test_gpu import FP32, LLAMA, _same_curve, _train, pytestmark  # noqa: F401

LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all-linear")
QLORA = (*LORA, "--quantize-base", "nf4")


@pytest.mark.parametrize(
    "name, model, flags",
    [("moe", MOE, ()), ("lora", LLAMA, LORA), ("qlora", LLAMA, QLORA)],
)
def test_cuda_matches_cpu_in_fp32(tmp_path, corpus, name, model, flags):
    cpu = _train(tmp_path, corpus, f"{name}-cpu", "--device", "cpu", *FP32, *flags, model=model)
    gpu = _train(tmp_path, corpus, f"{name}-cuda", "--device", "cuda", *FP32, *flags, model=model)
    _same_curve(cpu, gpu)


@pytest.mark.parametrize(
    "name, model, flags",
    [
        ("moe", MOE, ()),
        ("lora", LLAMA, LORA),
        ("qlora", LLAMA, QLORA),
        ("compile", LLAMA, ("--compile",)),
    ],
)
def test_bf16_trains(tmp_path, corpus, name, model, flags):
    records = _train(tmp_path, corpus, f"{name}-bf16", "--device", "cuda", *flags, model=model)
    assert records[-1]["loss"] < records[0]["loss"]


def test_compile_matches_eager_in_fp32(tmp_path, corpus):
    eager = _train(tmp_path, corpus, "eager", "--device", "cuda", *FP32, model=LLAMA)
    compiled = _train(
        tmp_path, corpus, "compiled", "--device", "cuda", *FP32, "--compile", model=LLAMA
    )
    _same_curve(eager, compiled)


def test_nf4_on_cuda_is_the_cpus_bit_for_bit():
    from meshwise.apply.nf4 import dequantize_nf4, quantize_nf4

    w = torch.randn(384, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    codes, absmax = quantize_nf4(w)
    cuda_codes, cuda_absmax = quantize_nf4(w.cuda())
    assert torch.equal(cuda_codes.cpu(), codes) and torch.equal(cuda_absmax.cpu(), absmax)
    for dtype in (torch.float32, torch.bfloat16):
        dense = dequantize_nf4(cuda_codes, cuda_absmax, w.shape, dtype)
        assert torch.equal(dense.cpu(), dequantize_nf4(codes, absmax, w.shape, dtype))
