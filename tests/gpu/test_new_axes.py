"""Mixture of experts, LoRA and ``--compile`` on one CUDA device: each matches its
CPU (or eager) curve in fp32 and trains in bf16 (``--dtype auto``)."""

import pytest

from tests.e2e.test_moe_cli import MOE
from tests.gpu.test_gpu import FP32, LLAMA, _same_curve, _train, pytestmark  # noqa: F401

LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all-linear")


@pytest.mark.parametrize(
    "name, model, flags",
    [("moe", MOE, ()), ("lora", LLAMA, LORA)],
)
def test_cuda_matches_cpu_in_fp32(tmp_path, corpus, name, model, flags):
    cpu = _train(tmp_path, corpus, f"{name}-cpu", "--device", "cpu", *FP32, *flags, model=model)
    gpu = _train(tmp_path, corpus, f"{name}-cuda", "--device", "cuda", *FP32, *flags, model=model)
    _same_curve(cpu, gpu)


@pytest.mark.parametrize(
    "name, model, flags",
    [("moe", MOE, ()), ("lora", LLAMA, LORA), ("compile", LLAMA, ("--compile",))],
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
