"""Watching a run: FLOPs, MFU, where each step's time went, loggers and the profiler.

Adds ``tflops``, ``mfu``, ``hfu`` and the logging rank's ``time_breakdown`` (compute, exposed
communication per axis, optimizer, other; phases timed on the device) to each step's
record, and feeds the loggers. See docs/watching.md.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager

import torch

from meshwise.apply.compile import compile_seconds
from meshwise.comm import ops
from meshwise.device import ranges
from meshwise.device.clocks import Stopwatch
from meshwise.train import flops
from meshwise.train.loggers import ExperimentLog, parse_log_to, run_names
from meshwise.train.profiling import StepProfiler, parse_steps

AXIS_CATEGORIES = {"dp": ("grad", "param"), "tp": ("tp",), "pp": ("p2p",)}
PHASES = ("forward_backward", "grad_sync", "optimizer")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class RunObserver:
    """FLOPs, time breakdown, loggers and profiler of one rank's run."""

    def __init__(
        self,
        cfg,
        run,
        mesh,
        device,
        whole_model,
        layers,
        config_dict: dict,
        d_model: int | None = None,
    ):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        d_model = d_model or cfg.model.resolved().d_model
        # Selective recomputes element-wise ops only: no matmul FLOPs again.
        recomputed = cfg.runtime.activation_checkpointing == "full"
        self.model_flops, self.hardware_flops = flops.flops_per_token(
            whole_model, layers, len(layers), d_model, cfg.data.seq_len, recomputed
        )
        self.peak_flops, self.peak_source = self._peak(cfg.runtime)
        self._watches = {name: Stopwatch(device) for name in PHASES}
        self._counters = mesh.world_group.counters
        self._waits = self._wait_totals()
        self._compiled_s = compile_seconds()  # --compile: the part of compute spent compiling
        self.mfus: list[float] = []
        self.breakdowns: list[dict] = []
        r = cfg.runtime
        self.profiler = StepProfiler(
            parse_steps(r.profile_steps), run.profile_dir or "profile", mesh.rank, device
        )
        self.loggers = None
        names = parse_log_to(r.log_to)
        if names and mesh.rank == 0:
            # The launcher named the run; a run made in Python is named here, by the one
            # rank that logs.
            where = run_names(run, cfg.checkpoint.save)
            self.loggers = ExperimentLog(
                names, where["log_dir"], where["run_name"], r.project, config_dict, r.log_errors
            )

    def _peak(self, runtime) -> tuple[float, str]:
        """The world's peak FLOP/s and where it comes from."""
        if runtime.peak_tflops:
            return runtime.peak_tflops * 1e12 * self.mesh.world_group.size, "--peak-tflops"
        ops.barrier(self.mesh.world_group)  # every rank measures at once, sharing the cores
        peak, source = flops.device_peak(self.device, DTYPES[runtime.dtype])
        total = torch.tensor([peak], dtype=torch.float64, device=self.device)
        ops.all_reduce(total, self.mesh.world_group, category="metrics")
        return total.item(), source

    # ---------------------------------------------------------------- a step
    def start_step(self, step: int) -> None:
        self.profiler.step(step)
        for watch in self._watches.values():
            watch.reset()

    @contextmanager
    def phase(self, name: str):
        with ranges.named(name), self._watches[name].measure():
            yield

    def record(self, record: dict) -> None:
        """Add FLOP rates and this rank's time breakdown to ``record``.

        Called after the step's host read, which waited for the device: the phase
        stopwatches (device events on a GPU) are complete, so no phase reads as 0.
        The breakdown is the logging rank's own: one rank's step adds up."""
        seconds = record["step_time_s"]
        record["tflops"] = self.model_flops * record["tokens"] / seconds / 1e12
        record["mfu"] = record["tflops"] * 1e12 / self.peak_flops
        record["hfu"] = self.hardware_flops * record["tokens"] / seconds / self.peak_flops
        phases = {name: watch.seconds() for name, watch in self._watches.items()}
        totals = self._wait_totals()
        waits = {axis: totals[axis] - self._waits[axis] for axis in AXIS_CATEGORIES}
        self._waits = totals
        worked = phases["forward_backward"] + phases["grad_sync"]
        compiling = compile_seconds() - self._compiled_s
        self._compiled_s += compiling
        compute = max(0.0, worked - sum(waits.values()) - compiling)
        breakdown = {"compute": compute, **waits, "optimizer": phases["optimizer"]}
        if self.cfg.runtime.compile:
            breakdown["compile"] = compiling
        breakdown["other"] = max(0.0, seconds - sum(breakdown.values()))
        record["time_breakdown"] = breakdown
        self.mfus.append(record["mfu"])
        self.breakdowns.append(breakdown)

    def log(self, record: dict) -> None:
        if self.loggers is not None:
            self.loggers.log(record)

    # ---------------------------------------------------------------- the end
    def summary(self) -> str:
        """``MFU ...; step time: 61% compute, ...`` over the steps after the first."""
        kept = self.breakdowns[1:] or self.breakdowns
        if not kept:
            return ""
        parts = {k: statistics.median(b[k] for b in kept) for k in kept[0]}
        total = sum(parts.values()) or 1.0
        shares = ", ".join(f"{v / total:.0%} {k}" for k, v in parts.items() if v / total >= 0.005)
        mfu = statistics.median(self.mfus[1:] or self.mfus)
        return (
            f"MFU {mfu:.1%} (model FLOPs {self.model_flops / 1e6:.1f}M per token; peak "
            f"{self.peak_flops / 1e12:.2f} TFLOP/s over {self.mesh.dims.world_size} ranks, "
            f"{self.peak_source}); step time: {shares}"
        )

    def close(self) -> None:
        self.profiler.finish()
        if self.loggers is not None:
            self.loggers.close()

    def _wait_totals(self) -> dict[str, float]:
        return {
            axis: sum(self._counters.exposed_s(c) for c in categories)
            for axis, categories in AXIS_CATEGORIES.items()
        }
