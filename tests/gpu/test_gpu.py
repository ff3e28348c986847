"""One rank per GPU with NCCL, as users train: every model family, precision, ZeRO
stage, activation checkpointing, checkpoints and generation, under NCCL's rules.

Most tests run ``meshwise train --device cuda`` as a subprocess (the CPU suite's
e2e helpers). The CUDA loss curve must match the CPU's to 1e-4 in fp32 over 10
steps, and the metrics' ``peak_mem_bytes`` comes from the CUDA allocator. Tests
of two ranks (tp 2, pp 2) need two GPUs and say so where there is one.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.conftest import SMALL, read_metrics, run_cli

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not GPUS,
        reason="no CUDA device: the GPU suite runs where there is one (python -m pytest tests/gpu)",
    ),
]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, {GPUS} visible")
STEPS = 10
LLAMA = [
    "--model",
    "llama-tiny",
    "--n-layer",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--warmup-steps",
    "2",
    "--lr",
    "3e-3",
    "-q",
]
FP32 = ("--dtype", "fp32")


def _train(tmp_path, corpus, name, *flags, model=SMALL, dp=1):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_cli(
        "train",
        "--data",
        corpus,
        "--steps",
        STEPS,
        "--dp",
        dp,
        "--metrics",
        metrics,
        *model,
        *flags,
        cwd=tmp_path,
    )
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
    cpu = _train(tmp_path, corpus, f"{family}-cpu", "--device", "cpu", *FP32, model=model)
    gpu = _train(tmp_path, corpus, f"{family}-cuda", "--device", "cuda", *FP32, model=model)
    _same_curve(cpu, gpu)
    peak = gpu[-1]["peak_mem_bytes"]
    assert 0 < peak <= torch.cuda.get_device_properties(0).total_memory


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_dtype_auto_is_bf16_on_cuda_and_trains(tmp_path, corpus, family):
    model = SMALL if family == "gpt" else LLAMA
    fp32 = _train(tmp_path, corpus, f"{family}-fp32", "--device", "cuda", *FP32, model=model)
    auto = _train(tmp_path, corpus, f"{family}-auto", "--device", "cuda", model=model)
    bf16 = _train(
        tmp_path, corpus, f"{family}-bf16", "--device", "cuda", "--dtype", "bf16", model=model
    )
    config = json.loads((tmp_path / f"{family}-auto.jsonl.config.json").read_text())
    assert config["config"]["runtime"]["dtype"] == "bf16"
    _same_curve(bf16, auto, rtol=2e-3)  # the same run, up to CUDA's unordered sums
    assert bf16[-1]["loss"] < bf16[0]["loss"]
    assert abs(bf16[-1]["loss"] - fp32[-1]["loss"]) < 0.02 * fp32[-1]["loss"]


@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_every_zero_stage_at_dp1(tmp_path, corpus, zero):
    base = _train(tmp_path, corpus, "zero0", "--device", "cuda", *FP32)
    _same_curve(
        base, _train(tmp_path, corpus, f"zero{zero}", "--device", "cuda", *FP32, "--zero", zero)
    )


def test_bf16_zero3_matches_bf16_zero0(tmp_path, corpus):
    # The same bf16 values meet the same fp32 master weights: only the order of
    # fp32 sums may differ.
    base = _train(
        tmp_path, corpus, "bf16-zero0", "--device", "cuda", "--dtype", "bf16", model=LLAMA
    )
    zero3 = _train(
        tmp_path,
        corpus,
        "bf16-zero3",
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        "--zero",
        "3",
        model=LLAMA,
    )
    _same_curve(base, zero3, rtol=2e-3)


def test_activation_checkpointing(tmp_path, corpus):
    base = _train(tmp_path, corpus, "plain", "--device", "cuda", *FP32)
    _same_curve(
        base,
        _train(
            tmp_path,
            corpus,
            "ckpt",
            "--device",
            "cuda",
            *FP32,
            "--activation-checkpointing",
            "full",
        ),
    )


def test_save_resume_and_generate(tmp_path, corpus):
    save = tmp_path / "ckpt"
    whole = _train(tmp_path, corpus, "whole", "--device", "cuda", "--save", save, "--save-every", 5)
    metrics = tmp_path / "resumed.jsonl"
    run = run_cli(
        "train",
        "--data",
        corpus,
        "--steps",
        STEPS,
        "--dp",
        "1",
        "--device",
        "cuda",
        "--resume",
        save / "step-00000005",
        "--metrics",
        metrics,
        *SMALL,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    resumed = read_metrics(metrics)
    assert [r["step"] for r in resumed] == list(range(6, STEPS + 1))
    for ref, got in zip(whole[5:], resumed, strict=True):
        assert got["loss"] == ref["loss"], (ref, got)  # the same layout resumes bit-exactly
    out = run_cli(
        "generate",
        "--checkpoint",
        save,
        "--prompt",
        "def ",
        "--max-new-tokens",
        8,
        "--temperature",
        0,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def ")


@two_gpus
@pytest.mark.parametrize(
    "layout",
    [["--tp", "2"], ["--tp", "2", "--sp"], ["--pp", "2", "--micro-batches", "4"], ["--zero", "3"]],
)
def test_two_ranks_match_one(tmp_path, corpus, layout):
    dp = 2 if layout == ["--zero", "3"] else 1
    one = _train(tmp_path, corpus, "one", "--device", "cuda", *FP32, model=LLAMA)
    two = _train(tmp_path, corpus, "two", "--device", "cuda", *FP32, *layout, model=LLAMA, dp=dp)
    _same_curve(one, two)


def test_time_breakdown_adds_up_to_the_step(tmp_path, corpus):
    """The phases are timed with CUDA events and read after the step's host read:
    what they leave unexplained ("other") is under 10% of the step."""
    # Big enough that the device's work, not the host's, sets the step's length.
    model = [
        "--model",
        "llama-1b",
        "--n-layer",
        "2",
        "--seq-len",
        "512",
        "--batch-size",
        "32",
        "--warmup-steps",
        "2",
        "-q",
    ]
    records = _train(tmp_path, corpus, "breakdown", "--device", "cuda", model=model)
    for r in records[2:]:
        parts = r["time_breakdown"]
        assert parts["compute"] > 0.5 * r["step_time_s"], r
        assert parts["other"] < 0.1 * r["step_time_s"], r
        assert sum(parts.values()) == pytest.approx(r["step_time_s"], rel=0.1), r


def _count_syncs(cfg, data_path: str, out: str) -> None:
    """In a rank: the CUDA operations that make the host wait during one step after
    the first, as ``torch.cuda.set_sync_debug_mode`` reports them (autograd replays
    its device thread's warnings on the thread that called backward)."""
    import warnings

    from meshwise.train.trainer import Trainer

    trainer = Trainer(cfg, data_path)
    trainer.train_step(1)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_step(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [
        str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()
    ]
    Path(out).write_text(json.dumps(syncs))


@pytest.mark.parametrize("layout", [{}, {"zero": 3}, {"activation_checkpointing": "full"}])
def test_a_step_waits_for_the_device_once(tmp_path, layout):
    from meshwise.cli import launch
    from meshwise.data.token_files import _write_meta
    from meshwise.train.config import TrainConfig

    data = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 50_000).astype(np.uint16).tofile(data)
    _write_meta(
        data,
        {
            "num_tokens": 50_000,
            "vocab_size": 256,
            "max_token": None,
            "source": str(data),
            "dtype": "uint16",
        },
    )
    cfg = TrainConfig()
    cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head = 2, 64, 4
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = str(data), 32, 8
    cfg.optim.steps, cfg.runtime.device, cfg.runtime.quiet = 3, "cuda", True
    cfg.runtime.peak_tflops = 1.0
    for key, value in layout.items():
        section = cfg.parallel if hasattr(cfg.parallel, key) else cfg.runtime
        setattr(section, key, value)
    out = tmp_path / "syncs.json"
    launch.launch(_count_syncs, (cfg.validate(), str(data), str(out)), 1, "cuda", 120)
    syncs = json.loads(out.read_text())
    assert len(syncs) == 1, syncs  # the metrics' one read
