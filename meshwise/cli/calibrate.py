"""``meshwise plan --calibrate``: measure this machine once (probes, all-reduces and drift on
2 and 4 gloo ranks, short training runs measured from outside, what a first backward
loads) and store it in ``CACHE/planner-calibration.json`` for ``--device cpu``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshwise.cli import launch
from meshwise.planner.devices import save_calibration

# The run the runtime's memory and the optimizer's cost are measured on.
RUN_FLAGS = [
    "--model",
    "tiny",
    "--n-layer",
    "4",
    "--d-model",
    "256",
    "--n-head",
    "4",
    "--seq-len",
    "128",
    "--batch-size",
    "8",
    "--dp",
    "2",
    "--steps",
    "4",
    "--eval-batches",
    "1",
    "-q",
]
RUN_WORLD = 2


def calibrate(cache_dir: str | None = None) -> str:
    """Measure, store, and say what was measured (one line per kind)."""
    from meshwise.planner.probes import local_probes

    start = time.perf_counter()
    values = local_probes()
    values["compiled_layer_ratio"] = _compiled_ratios()
    values["all_reduce"], values["drift"], values["links"] = _comm()
    values.update(_training_run(values))
    values["given_gradient_bytes"] = given_gradient_memory()
    values["checkpointing_bytes"] = checkpointing_memory()
    values["when"] = time.strftime("%Y-%m-%d %H:%M")
    path = save_calibration(values, Path(cache_dir) if cache_dir else None)
    mm = values["matmul_flops"]
    ar = ", ".join(
        f"{size} ranks {c['alpha_s'] * 1e6:.0f} us + {1 / c['beta_s_per_byte'] / 1e9:.2f} GB/s"
        for size, c in values["all_reduce"].items()
    )
    return "\n".join(
        [
            f"matmul fp32 {mm['fp32'] / 1e9:.1f} GFLOP/s, bf16 {mm['bf16'] / 1e9:.1f} GFLOP/s "
            f"(one thread); attention at {values['attention_efficiency']:.2f} of it",
            f"memory {values['memory_bandwidth'] / 1e9:.1f} GB/s, op dispatch "
            f"{values['op_overhead_s'] * 1e6:.1f} us, optimizer step "
            f"{values['optimizer_fixed_s'] * 1e3:.1f} ms + "
            f"{values['optimizer_s_per_param'] * 1e9:.1f} ns per parameter",
            f"all-reduce: {ar}; after 1 s of compute a collective waits for drifting peers "
            + ", ".join(f"{k * 1e3:.0f} ms ({size} ranks)" for size, k in values["drift"].items())
            + " (as the square root of the compute)",
            f"runtime memory per rank {values['overhead_bytes'] / 2**20:.0f} MiB, "
            f"+{values['given_gradient_bytes'] / 2**20:.0f} MiB on a rank that runs a backward "
            f"from a given gradient, +{values['checkpointing_bytes'] / 2**20:.0f} MiB with "
            "activation checkpointing",
            "--compile's layer time over eager: "
            + (
                ", ".join(f"{f} {r:.2f}" for f, r in values["compiled_layer_ratio"].items())
                or "not measured (no compiler here)"
            ),
            f"stored in {path} ({time.perf_counter() - start:.0f} s)",
        ]
    )


def _compiled_ratios() -> dict[str, float]:
    """The planner's compiled profile, where inductor can compile here (else none: the
    planner prices --compile as eager)."""
    from meshwise.apply.compile import compiler_problem
    from meshwise.planner.probes import compiled_layer_ratios

    return {} if compiler_problem("cpu") else compiled_layer_ratios()


def _comm() -> tuple[dict, dict, dict]:
    all_reduce, drift, link = {}, {}, None
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as out:
            launch.launch(_probe_rank, (out,), world, "cpu", 120.0)
            result = json.loads((Path(out) / "probe.json").read_text())
        all_reduce[str(world)], drift[str(world)] = result["all_reduce"], result["drift"]
        link = link or result["link"]
    return all_reduce, drift, {"intra": link}


def _probe_rank(out: str) -> None:
    from meshwise.planner.probes import comm_probe

    result = comm_probe()
    if int(os.environ.get("RANK", 0)) == 0:
        (Path(out) / "probe.json").write_text(json.dumps(result))


def _run_config(flags: list[str] = RUN_FLAGS):
    """The configuration ``meshwise train FLAGS`` runs."""
    import argparse

    from meshwise.cli.train_flags import add_train_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    parser.add_argument("-q", action="store_true")
    return config_from_args(parser.parse_args(flags))[0].validate()


def _training_run(values: dict) -> dict:
    """The fixed memory of a rank and AdamW's cost, from real runs measured outside:
    memory with ``MALLOC_MMAP_THRESHOLD_`` (freed memory returned, so the peak is what is
    live), time without it, as users run, at two model sizes (the optimizer phase has a
    part that does not grow with the parameters: the norm's and the step's fixed calls)."""
    from meshwise.planner.devices import cpu_profile

    memory = train_records(RUN_FLAGS, live_peak=True)
    ranks_per_core = max(1.0, RUN_WORLD / (cpu_profile(values).cores or 1))
    (small, t_small), (large, t_large) = (
        _optimizer_phase(flags) for flags in (RUN_FLAGS, [*RUN_FLAGS, *LARGER])
    )
    per_param = max(t_large - t_small, 0.0) / (large - small) / ranks_per_core
    return {
        "overhead_bytes": runtime_memory(memory[-1]["peak_rss_bytes"], values),
        "optimizer_s_per_param": per_param,
        "optimizer_fixed_s": max(t_small / ranks_per_core - per_param * small, 0.0),
    }


LARGER = ["--d-model", "512", "--n-head", "8"]  # the second size: about four times the parameters


def _optimizer_phase(flags: list[str]) -> tuple[int, float]:
    """(parameters, median seconds of the trainer's optimizer phase) of a run of ``flags``,
    the share of the CPU other jobs took meanwhile taken out of its clock."""
    from meshwise.planner.probes import OthersShare
    from meshwise.planner.shapes import model_shape

    share = OthersShare()
    timed = train_records(flags, live_peak=False)
    available = 1.0 - share.measured()
    seconds = available * statistics.median(r["time_breakdown"]["optimizer"] for r in timed[1:])
    return model_shape(_run_config(flags)).num_params, seconds


def train_records(flags: list[str], live_peak: bool, env: dict | None = None) -> list[dict]:
    """The metrics records of one ``meshwise train FLAGS`` job. ``live_peak``: with
    ``MALLOC_MMAP_THRESHOLD_=65536``, so that glibc returns what is freed and the peak RSS
    is the live bytes' (a memory measurement); else without it, as users run (a timing:
    that setting makes every large tensor fresh pages, about 40% more time per step)."""
    env = dict(os.environ if env is None else env)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if live_peak:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "meshwise", "train", *flags, "--metrics", str(metrics)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def runtime_memory(peak_rss_bytes: float, values: dict) -> float:
    """A rank's fixed memory (libraries, allocator, buffers): the peak RSS of the run of
    ``RUN_FLAGS``, measured outside, less what the planner predicts for its model."""
    from meshwise.planner.devices import cpu_profile
    from meshwise.planner.layout import Layout
    from meshwise.planner.memory import peak_memory
    from meshwise.planner.search import settings_of
    from meshwise.planner.shapes import model_shape
    from meshwise.planner.step_time import step_time

    cfg = _run_config()
    shape, layout = model_shape(cfg), Layout.of(cfg)
    device = cpu_profile({**values, "overhead_bytes": 0})
    _, flights = step_time(shape, layout, settings_of(cfg, device), device)
    return peak_rss_bytes - peak_memory(shape, layout, settings_of(cfg, device), flights, 0.0).total


# Two things a rank does that make PyTorch load code it had not loaded yet, each run in a
# fresh process after a plain backward (what every rank runs anyway).
_PLAIN_BACKWARD = """
import torch
from meshwise.train.memory import status_kib
x = torch.ones(4, requires_grad=True)
(x * 2).sum().backward()
before = status_kib("VmRSS")
"""
_GIVEN_GRADIENT = (
    _PLAIN_BACKWARD
    + """
y = x * 2
torch.autograd.backward(y, torch.ones(4))
print((status_kib("VmRSS") - before) * 1024)
"""
)
_CHECKPOINTED = (
    _PLAIN_BACKWARD
    + """
from torch import nn
from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
blocks = nn.ModuleList([nn.Linear(4, 4)])
apply_activation_checkpointing(blocks, "full")
blocks[0](x).sum().backward()
print((status_kib("VmRSS") - before) * 1024)
"""
)


def given_gradient_memory() -> float:
    """The resident bytes a fresh process gains on its first backward from a given
    gradient (``torch.autograd.backward(y, grad)``: PyTorch's symbolic-shape code), as
    the OS counts them."""
    return _gained(_GIVEN_GRADIENT, "a backward from a given gradient")


def checkpointing_memory() -> float:
    """The resident bytes a fresh process gains on its first checkpointed backward
    (``torch.utils.checkpoint`` loads the compiler's front end, the symbolic-shape code
    with it), as the OS counts them."""
    return _gained(_CHECKPOINTED, "a checkpointed backward")


def _gained(script: str, what: str) -> float:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if done.returncode:
        raise ValueError(f"--calibrate: measuring {what} failed: {done.stderr[-500:]}")
    return float(done.stdout.split()[-1])
