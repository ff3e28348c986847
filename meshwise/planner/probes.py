"""Short measurements of this machine for the CPU profile (``meshwise plan --calibrate``),
each on one thread in its own CPU time, the least of several runs: matmuls, attention,
bandwidth, dispatch, AdamW, a layer of each family, links and drift between ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from meshwise.comm.allreduce.algorithms import Topology
from meshwise.comm.allreduce.allreducer import probe


def _best(fn, runs: int = 7) -> float:
    """The least CPU time of this thread over ``runs`` calls: what ``fn`` costs on a core of
    its own, whatever else the machine runs meanwhile (every probe runs on one thread)."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(runs):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return max(best, 1e-9)


def matmul_rate(dtype: torch.dtype, tokens: int = 2048, width: int = 512) -> float:
    x = torch.randn(tokens, width).to(dtype)
    w = torch.randn(3 * width, width).to(dtype)
    return 2.0 * tokens * width * 3 * width / _best(lambda: x @ w.t())


def attention_efficiency(rate: float, heads: int = 8, seq: int = 512, head_dim: int = 64) -> float:
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    took = _best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), runs=15)
    flops = 2.0 * seq * seq * heads * head_dim  # 4 T^2 h d, half of it under the causal mask
    return flops / took / rate


def memory_bandwidth(numel: int = 8 * 2**20) -> float:
    a, b = torch.ones(numel), torch.ones(numel)
    out = torch.empty(numel)
    return 3 * 4 * numel / _best(lambda: torch.add(a, b, out=out))


def op_overhead() -> float:
    x = torch.ones(8, requires_grad=True)

    def ops():
        y = x
        for _ in range(100):
            y = y * 1.0
        return y

    return _best(ops) / 100


def optimizer_seconds_per_param(numel: int = 2**21) -> float:
    from meshwise.sharding.adamw import AdamWConfig, adamw_update

    param, grad = torch.randn(numel), torch.randn(numel)
    m, v = torch.zeros(numel), torch.zeros(numel)

    def step():
        adamw_update([param], [grad], [m], [v], 1, 1e-3, AdamWConfig())

    return _best(step, runs=3) / numel


# One layer of each family, timed whole (forward and backward) at these sizes.
LAYER_SIZES: dict[str, dict[str, Any]] = {
    "gpt": {"preset": "tiny", "n_head": 4, "d_model": 256},
    "llama": {
        "preset": "llama-tiny",
        "n_head": 4,
        "n_kv_head": 2,
        "d_model": 256,
        "ffn_hidden_size": 768,
    },
}
LAYER_TOKENS = 512


def layer_seconds(family_name: str, compiled: bool = False) -> float:
    """Forward and backward of one layer of the family's own code on ``LAYER_TOKENS`` tokens
    (the fastest of several runs); ``compiled``: as ``--compile`` runs it (the warm-up
    compiles)."""
    from meshwise.apply.compile import compile_blocks
    from meshwise.models.gpt import Block, GPTConfig
    from meshwise.models.llama import DecoderLayer, LlamaConfig, Rotary

    sizes = {k: v for k, v in LAYER_SIZES[family_name].items() if k != "preset"}
    x = torch.randn(1, LAYER_TOKENS, sizes["d_model"], requires_grad=True)
    if family_name == "gpt":
        block: torch.nn.Module = Block(GPTConfig(n_layer=1, block_size=LAYER_TOKENS, **sizes), 0)
        args: tuple = (x,)
    else:
        cfg = LlamaConfig(n_layer=1, block_size=LAYER_TOKENS, **sizes)
        block, rotary = DecoderLayer(cfg), Rotary(cfg)
        # one function for every call: a new one each call would recompile a compiled block
        args = (x, lambda n, device, dtype: rotary(torch.arange(n), dtype))
    if compiled:
        compile_blocks([block])
    return _best(lambda: block(*args).sum().backward(), runs=5)


def compiled_layer_ratios() -> dict[str, float]:
    """Each family's layer time compiled by inductor over eager, on one thread (for the
    planner's ``--compile`` profile; one inductor compile of a block per family)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            name: layer_seconds(name, compiled=True) / layer_seconds(name) for name in LAYER_SIZES
        }
    finally:
        torch.set_num_threads(threads)


def layer_time_factors(values: dict) -> dict[str, float]:
    """Each family's measured layer time over what the roofline predicts for it with these
    probe values: what eager PyTorch's many small kernels cost beyond the roofline."""
    from meshwise.planner.compute import action_costs
    from meshwise.planner.devices import cpu_profile
    from meshwise.planner.layout import Layout
    from meshwise.planner.memory import Settings
    from meshwise.planner.shapes import model_shape
    from meshwise.train.config import TrainConfig

    device = cpu_profile({**values, "layer_time_factor": {}})
    factors = {}
    for family_name, sizes in LAYER_SIZES.items():
        cfg = TrainConfig()
        for field, value in sizes.items():
            setattr(cfg.model, field, value)
        costs = action_costs(
            model_shape(cfg),
            Layout(),
            Settings(LAYER_TOKENS, 1),
            device,
            1,
            first=False,
            last=False,
        )
        factors[family_name] = layer_seconds(family_name) / costs.compute
    return factors


def local_probes() -> dict:
    """Every probe but communication, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = matmul_rate(torch.float32)
        values = {
            "matmul_flops": {"fp32": fp32, "bf16": matmul_rate(torch.bfloat16)},
            "attention_efficiency": attention_efficiency(fp32),
            "memory_bandwidth": memory_bandwidth(),
            "op_overhead_s": op_overhead(),
            "optimizer_s_per_param": optimizer_seconds_per_param(),
        }
        values["layer_time_factor"] = layer_time_factors(values)
        return values
    finally:
        torch.set_num_threads(threads)


class OthersShare:
    """The share of this machine's CPU that processes other than this one's children took
    from its creation to ``measured()`` (Linux ``/proc/stat``): other jobs on a shared
    machine, which a wall-clock time measured meanwhile includes."""

    def __init__(self):
        self.busy, self.ours, self.wall = _busy_cpu_s(), _children_cpu_s(), time.perf_counter()

    def measured(self) -> float:
        import os

        wall = time.perf_counter() - self.wall
        others = (_busy_cpu_s() - self.busy) - (_children_cpu_s() - self.ours)
        return min(max(others / (len(os.sched_getaffinity(0)) * wall), 0.0), 0.95)


def _busy_cpu_s() -> float:
    import os

    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def comm_probe() -> dict:
    """On every rank of the world: alpha-beta of a link and of the native all-reduce
    (``bench comm``'s probe), and how far the ranks drift apart between collectives
    (``rank_drift``), the same on every rank (a collective)."""
    from meshwise.comm import ops

    group = ops.world_group(timeout_s=120.0)
    model = probe(
        group, Topology.of(tuple(range(group.size)), group.size), large=8 * 2**20, repeats=7
    )
    link, native = model.links["intra"], model.native
    assert native is not None, "probe measures the native all-reduce"
    return {
        "size": group.size,
        "link": {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte},
        "all_reduce": {"alpha_s": native.alpha_s, "beta_s_per_byte": native.beta_s_per_byte},
        "drift": rank_drift(group),
    }


def rank_drift(group, repeats: int = 40) -> float:
    """What a rank waits at a collective for peers whose compute ran slower, in seconds per
    square root of the seconds of that compute (independent noise grows as its root).

    Each call all-reduces after about 20 ms of matmuls; its wait is its time less the
    quickest call's. Returns the slowest rank's mean wait over the root of the mean compute.
    """
    from meshwise.comm import ops
    from meshwise.device.clocks import synchronize

    weights = torch.randn(512, 512, device=group.device)
    waits, computes = [], []
    ops.barrier(group)
    for call in range(repeats + 1):
        start = time.perf_counter()
        y = weights
        for _ in range(8):
            y = weights @ y
        x = y[0, :64] * 1.0
        synchronize(group.device)
        reached = time.perf_counter()
        ops.all_reduce(x, group, category="probe")
        synchronize(group.device)
        if call:  # the first call sets up the connection's buffers
            computes.append(reached - start)
            waits.append(time.perf_counter() - reached)
    quickest = min(waits)
    drift = (sum(waits) / len(waits) - quickest) / (sum(computes) / len(computes)) ** 0.5
    agreed = torch.tensor([drift], dtype=torch.float64, device=group.device)
    ops.all_reduce(agreed, group, op="max", category="probe")
    return agreed.item()
