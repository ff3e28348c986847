"""What a device computes and moves per second: profiles for the cost model.

A GPU's profile is its data sheet times efficiencies stated and justified at
``EAGER_BANDWIDTH`` below; the CPU's is measured by ``meshwise plan --calibrate`` and
cached, with defaults measured the same way on a 2-core machine (docs/choosing-a-layout.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshwise.comm.allreduce.allreducer import LinkCost

CALIBRATION_FILE = "planner-calibration.json"
GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """One rank's device as the cost model sees it.

    ``matmul_flops``: achieved FLOP/s per dtype; ``cores``: CPU cores a machine's ranks share
    (None: a device per rank); ``links``: alpha-beta per ring-step message, ``intra`` and
    ``inter`` node; ``collective_factor``: slowdown against a ring over them (gloo; 1 on NCCL);
    ``overhead_bytes``: the process beside the model; ``given_gradient_bytes`` and
    ``checkpointing_bytes``: host memory PyTorch loads on a first backward from a given
    gradient (symbolic shapes) or a first checkpointed one (the compiler's front end).
    """

    name: str
    memory_bytes: float
    matmul_flops: dict[str, float]
    attention_efficiency: float
    memory_bandwidth: float
    op_overhead_s: float
    links: dict[str, LinkCost]
    ranks_per_node: int
    overhead_bytes: float
    overlap: bool  # communication overlaps compute (separate engines on a GPU)
    source: str
    cores: int | None = None
    collective_factor: dict[str, float] = field(default_factory=dict)
    peak_flops: dict[str, float] = field(default_factory=dict)  # data sheet, for MFU
    memory_per_node: bool = False  # memory_bytes is the machine's, shared by its ranks
    # measured all-reduces by group size (gloo), and whether reduce-scatter and
    # all-gather run as all-reduces (meshwise.comm.policy on gloo)
    all_reduce: dict[int, LinkCost] = field(default_factory=dict)
    collectives_as_all_reduce: bool = False
    given_gradient_bytes: float = 0.0
    checkpointing_bytes: float = 0.0  # what a first checkpointed backward loads (host memory)
    optimizer_s_per_param: float = 0.0  # AdamW over one owned parameter (0: memory-bound)
    optimizer_fixed_s: float = 0.0  # the optimizer phase's part that no parameter adds to
    # a family's measured layer time over the roofline's (CPU: --calibrate; GPU: 1)
    layer_time_factor: dict[str, float] = field(default_factory=dict)
    # --compile: a family's layer time compiled over eager (CPU: --calibrate's probe of one
    # block compiled by inductor; none measured: 1, the eager estimate)
    compiled_layer_ratio: dict[str, float] = field(default_factory=dict)
    # by group size: seconds a rank waits at a blocking collective for peers that computed
    # slower since the last one, per square root of the seconds of that compute
    # (--calibrate's rank_drift; 0 on GPUs, whose kernels keep a steadier pace than a
    # shared CPU's and whose collectives overlap compute)
    drift: dict[int, float] = field(default_factory=dict)
    # element-wise work priced by the bytes eager kernels move (meshwise.planner.traffic)
    # rather than by passes over the kept activations
    counted_traffic: bool = False
    # how much slower compute runs while a collective overlaps it (GPU: shared SMs and HBM)
    overlap_slowdown: float = 0.0

    def matmul_rate(self, dtype: str) -> float:
        return self.matmul_flops[dtype]

    def link(self, kind: str) -> LinkCost:
        return self.links.get(kind) or self.links["intra"]

    def drift_at(self, size: int) -> tuple[float, int]:
        """The drift measured with the most ranks up to ``size``, and how many that was
        ((0, 1) with none)."""
        below = [n for n in self.drift if n <= size]
        if size <= 1 or not below:
            return 0.0, 1
        return self.drift[max(below)], max(below)


def _gpu(
    name: str,
    memory_gb: float,
    bf16_tflops: float,
    fp32_tflops: float,
    hbm_tbs: float,
    nvlink_gbs: float,
    nic_gbs: float,
    matmul_eff: float,
    attention_eff: float,
) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        memory_bytes=memory_gb * 2**30,
        matmul_flops={
            "bf16": bf16_tflops * 1e12 * matmul_eff,
            "fp32": fp32_tflops * 1e12 * matmul_eff,
        },
        peak_flops={"bf16": bf16_tflops * 1e12, "fp32": fp32_tflops * 1e12},
        attention_efficiency=attention_eff / matmul_eff,
        memory_bandwidth=hbm_tbs * 1e12 * EAGER_BANDWIDTH,
        op_overhead_s=4e-6,
        links={
            "intra": LinkCost(10e-6, 1 / (nvlink_gbs * GB * 0.8)),
            "inter": LinkCost(20e-6, 1 / (nic_gbs * GB * 0.9)),
        },
        ranks_per_node=8,
        overhead_bytes=1.5 * 2**30,
        overlap=True,
        counted_traffic=True,
        overlap_slowdown=OVERLAP_SLOWDOWN,
        source=f"{name} data sheet x stated efficiencies (meshwise.planner.devices)",
    )


# Efficiencies, for eager PyTorch as meshwise runs it (each checked against published runs
# in tests/unit/test_planner_published.py):
# - matmuls: the best-shaped bf16 matmul reaches 86.9% of an A100's peak and 80.3% of an
#   H100's (the "maximum achievable matmul FLOPS" table of Bekman's ML Engineering,
#   compute/accelerator); for a transformer's forward, input-gradient and weight-gradient
#   shapes, at a clock the power limit holds, about 7/8 of that: 0.75 and 0.70.
# - attention (FLOPs as FlashAttention counts them, causal blocks skipped):
#   FlashAttention-2, which PyTorch's SDPA runs, reaches 50-73% of an A100's peak forward
#   and less backward (Dao 2023, section 4.1): 0.55. On Hopper it uses little of the new
#   tensor cores: 298-335 TFLOP/s forward and 291-322 backward at head size 128, causal,
#   2k-16k tokens, on an H100 SXM5 (Shah et al. 2024, FlashAttention-3, figures 5-6): 0.32.
# - memory-bound work (norms, rotary, activations, residual adds, casts, the loss, AdamW),
#   priced by the bytes its eager kernels move (meshwise.planner.traffic): 60% of HBM
#   bandwidth. A plain copy reaches about 90%; broadcasts, bf16/fp32 casts, the norms'
#   row reductions and small kernels less. Fitted to one measurement: a plain PyTorch loop
#   of llama-1b's shapes with fused AdamW on one H200 (seq 2048, batch 4, vocabulary
#   32,000: 50,421 tokens/s) is predicted within 1%.
# - collectives beside compute slow it by 18.9% on average (A100 and H100, GPT and Llama
#   training; arXiv 2507.03114, "Characterizing compute-communication overlap in
#   GPU-accelerated distributed deep learning"): hidden time costs that much.
# - links: NCCL's ring all-reduce bus bandwidth is about 80% of the per-direction NVLink
#   figure and about 90% of an InfiniBand/RoCE NIC's line rate (nccl-tests on DGX
#   systems); alpha is NCCL's per-step latency, about 10 us inside a node, 20 across.
EAGER_BANDWIDTH = 0.6  # of HBM, for the eager element-wise kernels (see above)
OVERLAP_SLOWDOWN = 0.19  # compute slowed while collectives run beside it (see above)
# Data sheets (SXM parts): dense bf16 and fp32 (non-tensor) TFLOP/s, HBM TB/s, NVLink per
# direction GB/s, one 400 (HDR: 200) Gb/s NIC per GPU; then the matmul and attention
# efficiencies. overhead: CUDA context, NCCL buffers. "h100-hbm2e": the H100 of Meta's
# Grand Teton hosts that torchtitan's published runs used (96 GB of HBM2e at 2.4 TB/s,
# a 500 W power limit), whose peak torchtitan puts between the SXM part's and the NVL
# part's (835 TFLOP/s) without knowing it: the profile takes the NVL figure, so as not
# to promise more than those GPUs were measured to give.
GPU_PROFILES = {
    "h100": _gpu("h100", 80, 989, 67, 3.35, 450, 50, 0.70, 0.32),
    "h200": _gpu("h200", 141, 989, 67, 4.8, 450, 50, 0.70, 0.32),
    "a100": _gpu("a100", 80, 312, 19.5, 2.04, 300, 25, 0.75, 0.55),
    "a100-40gb": _gpu("a100-40gb", 40, 312, 19.5, 1.56, 300, 25, 0.75, 0.55),
    "h100-hbm2e": _gpu("h100-hbm2e", 96, 835, 60, 2.4, 450, 50, 0.70, 0.32),
}

# This kind of machine (2 x86 cores, torch 2.13 CPU, gloo), measured by --calibrate on it
# (medians of three calibrations): used until a machine's own calibration is stored.
CPU_DEFAULTS = {
    "matmul_flops": {"fp32": 89e9, "bf16": 203e9},
    "attention_efficiency": 0.41,
    "memory_bandwidth": 19e9,
    "op_overhead_s": 4.9e-6,
    "links": {"intra": {"alpha_s": 280e-6, "beta_s_per_byte": 1 / 2.6e9}},
    "overhead_bytes": 199 * 2**20,
    "given_gradient_bytes": 35 * 2**20,
    "checkpointing_bytes": 77 * 2**20,
    "collective_factor": {},
    "all_reduce": {
        "2": {"alpha_s": 410e-6, "beta_s_per_byte": 1 / 1.23e9},
        "4": {"alpha_s": 1.54e-3, "beta_s_per_byte": 1 / 0.56e9},
    },
    "optimizer_s_per_param": 6.8e-9,
    "optimizer_fixed_s": 0.0079,
    "layer_time_factor": {"gpt": 1.10, "llama": 1.05},
    # one calibration's probe (2 cores, inductor, one thread's CPU time)
    "compiled_layer_ratio": {"gpt": 0.99, "llama": 0.87},
    "drift": {"2": 0.023, "4": 0.080},
}


def known_devices() -> list[str]:
    return ["cpu", *GPU_PROFILES]


def device_profile(
    name: str,
    cache_dir: Path | None = None,
    cores: int | None = None,
    memory_bytes: float | None = None,
) -> DeviceProfile:
    """The profile of ``name`` (ValueError listing the known ones); for ``cpu`` this
    machine's calibration from ``cache_dir`` when one is stored."""
    if name in GPU_PROFILES:
        profile = GPU_PROFILES[name]
    elif name == "cpu":
        profile = cpu_profile(load_calibration(cache_dir), cores)
    else:
        raise ValueError(f"--device {name!r} has no profile; valid: {', '.join(known_devices())}")
    if memory_bytes is not None:
        profile = replace(profile, memory_bytes=memory_bytes)
    return profile


def cpu_profile(calibration: dict | None, cores: int | None = None) -> DeviceProfile:
    """This machine's CPU: its cores, memory and the calibration's rates (else the
    defaults). Its memory is the machine's, shared by the ranks it runs."""
    values = {**CPU_DEFAULTS, **(calibration or {})}
    links = {
        kind: LinkCost(c["alpha_s"], c["beta_s_per_byte"]) for kind, c in values["links"].items()
    }
    source = (
        f"calibrated here ({calibration.get('when', 'meshwise plan --calibrate')})"
        if calibration
        else "defaults of a 2-core machine (run meshwise plan --calibrate)"
    )
    return DeviceProfile(
        name="cpu",
        memory_bytes=machine_memory_bytes(),
        matmul_flops=values["matmul_flops"],
        peak_flops=values["matmul_flops"],
        attention_efficiency=values["attention_efficiency"],
        memory_bandwidth=values["memory_bandwidth"],
        op_overhead_s=values["op_overhead_s"],
        links=links,
        ranks_per_node=0,
        overhead_bytes=values["overhead_bytes"],
        overlap=False,
        source=source,
        cores=cores or len(os.sched_getaffinity(0)),
        collective_factor=values["collective_factor"],
        memory_per_node=True,
        all_reduce={
            int(size): LinkCost(c["alpha_s"], c["beta_s_per_byte"])
            for size, c in values["all_reduce"].items()
        },
        collectives_as_all_reduce=True,
        given_gradient_bytes=values["given_gradient_bytes"],
        checkpointing_bytes=values["checkpointing_bytes"],
        optimizer_s_per_param=values["optimizer_s_per_param"],
        optimizer_fixed_s=values.get("optimizer_fixed_s", 0.0),
        layer_time_factor=values.get("layer_time_factor", {}),
        compiled_layer_ratio=values.get("compiled_layer_ratio", {}),
        drift={int(size): k for size, k in values["drift"].items()},
    )


def compiled_profile(profile: DeviceProfile) -> DeviceProfile:
    """``profile`` as a ``--compile`` run sees it: each family's layer time scaled by its
    measured compiled ratio (the head, loss and collectives as eager)."""
    ratio, factor = profile.compiled_layer_ratio, profile.layer_time_factor
    return replace(
        profile,
        layer_time_factor={f: factor.get(f, 1.0) * ratio.get(f, 1.0) for f in {*factor, *ratio}},
        source=f"{profile.source}, compiled layers",
    )


def machine_memory_bytes() -> float:
    """This machine's memory (its cgroup's limit when lower)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return float(total)


def calibration_path(cache_dir: Path | None = None) -> Path:
    from meshwise.data.dataset import default_cache_dir

    return Path(cache_dir or default_cache_dir()) / CALIBRATION_FILE


def load_calibration(cache_dir: Path | None = None) -> dict | None:
    """The stored calibration of this machine, or None."""
    path = calibration_path(cache_dir)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def save_calibration(values: dict, cache_dir: Path | None = None) -> Path:
    path = calibration_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values, indent=1) + "\n")
    tmp.replace(path)
    return path
