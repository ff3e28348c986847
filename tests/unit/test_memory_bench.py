"""The pure parts of ``benchmarks/memory.py``: reading /proc status, merging ranks."""

from pathlib import Path

import pytest

from benchmarks.memory import summarize
from benchmarks.memory_runners import process_memory
from meshwise.train.memory import status_kib

STATUS = "Name:\tpython\nVmPeak:\t 2000000 kB\nVmHWM:\t   20480 kB\nVmRSS:\t   10240 kB\n"


def test_status_kib_reads_kib_fields_by_exact_name():
    assert status_kib("VmHWM", STATUS) == 20480
    assert status_kib("VmRSS", STATUS) == 10240
    assert status_kib("VmHW", STATUS) is None  # a prefix of VmHWM is not VmHWM
    with pytest.raises(ValueError, match="unit"):
        status_kib("VmHWM", "VmHWM:\t 3 MB\n")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_process_memory_reads_this_process():
    mem = process_memory()
    assert 0 < mem["rss"] <= mem["hwm"]


def test_summarize_takes_each_ranks_peak_above_its_own_baseline_and_the_slowest_steps():
    mib = 2**20
    ranks = [
        {
            "baseline_rss": 100 * mib,
            "built_rss": 150 * mib,
            "hwm": 190 * mib,
            "step_s": [9.0, 1.0, 2.0, 3.0],
            "losses": [4.0, 3.0, 2.0, 1.0],
            "peak_was_reset": True,
            "num_params": mib,
        },
        {
            "baseline_rss": 120 * mib,
            "built_rss": 160 * mib,
            "hwm": 200 * mib,
            "step_s": [8.0, 1.5, 1.0, 1.0],
            "losses": [4.0, 3.0, 2.0, 1.0],
            "peak_was_reset": True,
            "num_params": mib,
        },
    ]
    got = summarize(ranks, warmup=1, world_size=2, stage=3)
    assert got["peak_bytes"] == 90 * mib  # rank 0: 190 - 100 (rank 1 only 80)
    assert got["built_bytes"] == 50 * mib
    assert got["bytes_per_param"] == 90
    assert got["step_s"] == 2.0  # median of the slowest rank per step: 1.5, 2.0, 3.0
    assert got["formula_bytes_per_param"] == 8.0  # 16 / N
