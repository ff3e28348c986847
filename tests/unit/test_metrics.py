"""What a run prints and writes per step: progress, evaluations, strict JSON."""

import io
import json
import math

import pytest
import torch

from meshwise.train.metrics import MetricsLog, strict_json


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _record(step, **extra):
    return {"step": step, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, **extra}


def test_a_terminal_keeps_evaluation_lines():
    out = Terminal()
    log = MetricsLog(None, total_steps=4, log_every=10, stream=out)
    for step in range(1, 5):
        log.write(_record(step, **({"val_loss": 1.5} if step == 2 else {})))
    lines = out.getvalue().split("\n")
    assert any("step     2/4" in line and "val_loss 1.5000" in line for line in lines[:-2])
    assert "val_loss" not in lines[-1]  # the rest is rewritten in place


def test_quiet_prints_no_progress(tmp_path):
    out = io.StringIO()
    log = MetricsLog(tmp_path / "m.jsonl", total_steps=2, log_every=1, stream=out, quiet=True)
    log.write(_record(1))
    log.write(_record(2))
    log.close()
    assert out.getvalue() == ""
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


def test_non_finite_values_are_strict_json():
    line = json.dumps(strict_json(_record(3, loss=math.nan, grad_norm=math.inf)), allow_nan=False)
    back = json.loads(line)
    assert back["loss"] is None and back["grad_norm"] is None
    assert back["non_finite"] == ["loss", "grad_norm"]


def test_step_peak_is_measured_by_the_os_and_reset_each_step():
    from meshwise.train.memory import PeakMemory, status_kib

    memory = PeakMemory(torch.device("cpu"))
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del big  # above glibc's largest mmap threshold: returned at once
    memory.start_step()
    if not memory.per_step:
        pytest.skip("/proc/self/clear_refs cannot be written here")
    after_reset = memory.step_peak_bytes()
    assert memory.run_peak_rss_bytes() >= after_reset + 60 * 2**20  # the run kept its peak
    # 48 MiB, above glibc's largest mmap threshold (32 MiB): fresh pages whatever the
    # process freed before (a smaller block may reuse resident heap and add nothing)
    held = torch.ones(48 * 2**20 // 4)
    assert memory.step_peak_bytes() >= after_reset + 46 * 2**20
    assert status_kib("VmHWM", "VmRSS:\t10 kB\nVmHWM:\t  12 kB\n") == 12
    del held


def test_a_step_without_a_labelled_token_reports_no_loss_not_zero(tmp_path):
    from types import SimpleNamespace

    from meshwise.train.run_records import step_record

    trainer = SimpleNamespace(
        global_tokens=64,
        cfg=SimpleNamespace(
            data=SimpleNamespace(data_order="random-windows"), parallel=SimpleNamespace(zero=0)
        ),
        comm_stats=SimpleNamespace(record=lambda combined: {}),
        observer=SimpleNamespace(record=lambda record: None),
    )
    combined = dict.fromkeys(
        ["loss", "sq_norm", "grad_sync_bytes", "model_state_bytes", "peak_rss_bytes"], 0.0
    )
    combined["peak_mem_bytes"] = 0.0
    record = step_record(trainer, 1, 1e-3, 0, combined, 0.5)
    assert record["loss"] is None and record["labelled_tokens"] == 0
    out = io.StringIO()
    log = MetricsLog(tmp_path / "m.jsonl", total_steps=1, log_every=1, stream=out)
    log.write(record)
    log.close()
    assert "loss - (no labelled token)" in out.getvalue()
    assert json.loads((tmp_path / "m.jsonl").read_text())["loss"] is None
    assert "loss - (no labelled token) (step 1)" in log.summary(None)
