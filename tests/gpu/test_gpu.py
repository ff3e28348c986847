"""One rank on one GPU with NCCL, as users train: every model family, precision, ZeRO
stage, activation checkpointing, checkpoints and generation, under NCCL's rules.

Each test runs ``meshwise train --device cuda`` as a subprocess (the CPU suite's
e2e helpers). The CUDA loss curve must match the CPU's to 1e-4 in fp32 over 10
steps, and the metrics' ``peak_mem_bytes`` comes from the CUDA allocator.
"""

import pytest
import torch

from tests.e2e.conftest import SMALL, read_metrics, run_cli

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: the GPU suite runs where there is one "
                                        "(python -m pytest tests/gpu)")]
STEPS = 10
LLAMA = ["--model", "llama-tiny", "--n-layer", "2", "--seq-len", "32", "--batch-size", "8",
         "--warmup-steps", "2", "--lr", "3e-3", "-q"]


def _train(tmp_path, corpus, name, *flags, model=SMALL):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_cli("train", "--data", corpus, "--steps", STEPS, "--dp", "1",
                     "--metrics", metrics, *model, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return records


def _same_curve(reference, other, rtol=1e-4):
    for ref, got in zip(reference, other, strict=True):
        assert abs(got["loss"] - ref["loss"]) <= rtol * abs(ref["loss"]), (ref, got)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_cuda_matches_cpu_in_fp32(tmp_path, corpus, family):
    model = SMALL if family == "gpt" else LLAMA
    cpu = _train(tmp_path, corpus, f"{family}-cpu", "--device", "cpu", model=model)
    gpu = _train(tmp_path, corpus, f"{family}-cuda", "--device", "cuda", model=model)
    _same_curve(cpu, gpu)
    peak = gpu[-1]["peak_mem_bytes"]
    assert 0 < peak <= torch.cuda.get_device_properties(0).total_memory


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_bf16_trains(tmp_path, corpus, family):
    model = SMALL if family == "gpt" else LLAMA
    fp32 = _train(tmp_path, corpus, f"{family}-fp32", "--device", "cuda", model=model)
    bf16 = _train(tmp_path, corpus, f"{family}-bf16", "--device", "cuda", "--dtype", "bf16",
                  model=model)
    assert bf16[-1]["loss"] < bf16[0]["loss"]
    assert abs(bf16[-1]["loss"] - fp32[-1]["loss"]) < 0.02 * fp32[-1]["loss"]


@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_every_zero_stage_at_dp1(tmp_path, corpus, zero):
    base = _train(tmp_path, corpus, "zero0", "--device", "cuda")
    _same_curve(base, _train(tmp_path, corpus, f"zero{zero}", "--device", "cuda",
                             "--zero", zero))


def test_activation_checkpointing(tmp_path, corpus):
    base = _train(tmp_path, corpus, "plain", "--device", "cuda")
    _same_curve(base, _train(tmp_path, corpus, "ckpt", "--device", "cuda",
                             "--activation-checkpointing", "full"))


def test_save_resume_and_generate(tmp_path, corpus):
    save = tmp_path / "ckpt"
    whole = _train(tmp_path, corpus, "whole", "--device", "cuda", "--save", save,
                   "--save-every", 5)
    metrics = tmp_path / "resumed.jsonl"
    run = run_cli("train", "--data", corpus, "--steps", STEPS, "--dp", "1", "--device", "cuda",
                  "--resume", save / "step-00000005", "--metrics", metrics, *SMALL, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    resumed = read_metrics(metrics)
    assert [r["step"] for r in resumed] == list(range(6, STEPS + 1))
    for ref, got in zip(whole[5:], resumed, strict=True):
        assert got["loss"] == ref["loss"], (ref, got)  # the same layout resumes bit-exactly
    out = run_cli("generate", "--checkpoint", save, "--prompt", "def ", "--max-new-tokens", 8,
                  "--temperature", 0, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def ")
