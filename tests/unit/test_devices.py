"""Device helpers: nothing here may need an accelerator to run."""

import pytest
import torch

from meshwise.device.choice import resolve_dtype, takes_bf16
from meshwise.device.clocks import synchronize


def test_synchronize_is_a_no_op_on_cpu_and_rejects_unknown_devices():
    synchronize(torch.device("cpu"))
    synchronize("meta")
    with pytest.raises(ValueError, match="cannot wait for device"):
        synchronize("xla")


def test_dtype_auto_is_bf16_only_on_cuda_devices_that_take_it():
    asked = []

    def ready(answer):
        return lambda: asked.append(answer) or answer

    assert resolve_dtype("auto", "cpu", ready(True)) == "fp32"
    assert asked == []  # the GPUs are not asked about for a CPU run
    assert resolve_dtype("auto", "cuda", ready(True)) == "bf16"
    assert resolve_dtype("auto", "cuda", ready(False)) == "fp32"
    assert resolve_dtype("fp32", "cuda", ready(True)) == "fp32"
    assert resolve_dtype("bf16", "cpu", ready(False)) == "bf16"
    assert takes_bf16([(9, 0), (8, 0)], (2, 21, 5))
    assert takes_bf16([(8, 6)], None)
    assert not takes_bf16([(9, 0), (7, 5)], (2, 21, 5))  # a V100 in the job
    assert not takes_bf16([(9, 0)], (2, 7, 8))  # an NCCL without bfloat16


def test_train_resolves_dtype_auto_before_the_ranks(monkeypatch):
    from meshwise.cli import train
    from meshwise.train.config import TrainConfig

    monkeypatch.setattr(
        train.choice,
        "gpu_facts",
        lambda: {"gpus": [{"name": "H100", "capability": [9, 0]}], "nccl": (2, 21, 5)},
    )
    for device, expected in (("cpu", "fp32"), ("cuda", "bf16")):
        cfg, origins = TrainConfig(), {}
        cfg.runtime.device = device
        assert cfg.runtime.dtype == "auto"
        train.apply_launch_defaults(cfg, origins)
        assert cfg.runtime.dtype == expected
        assert ("dtype" in origins) == (expected == "bf16")
