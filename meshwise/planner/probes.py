"""Short measurements of this machine for the CPU profile (``meshwise plan --calibrate``).

Each probe times the work the cost model rates, on one thread as a rank of a
many-rank job runs (``meshwise.cli.launch``), and keeps the fastest of several
runs (the least disturbed by other work on the machine):

- ``matmul``: FLOP/s of the matrix multiplies of a transformer layer's sizes
  (tokens x width x 3 width), fp32 and bf16;
- ``attention``: causal ``scaled_dot_product_attention`` forward, as a fraction of
  the matmul rate at its FLOPs (half of the ``T x T`` product);
- ``memory_bandwidth``: bytes/s of an element-wise add of 32 MiB tensors (read
  two, write one);
- ``op_overhead``: seconds of a tiny op with autograd recording (a kernel's
  dispatch, which dominates small element-wise work on a CPU);
- ``optimizer``: seconds per parameter of meshwise's own AdamW over a flat buffer;
- ``comm_probe``: on every rank of a group, ``meshwise.comm.allreducer.probe``'s
  alpha-beta of a point-to-point link and of the native all-reduce.
"""

from __future__ import annotations

import time

import torch

from meshwise.comm.allreducer import probe
from meshwise.comm.algorithms import Topology


def _best(fn, runs: int = 7) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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
    from meshwise.sharding.adamw import AdamWConfig, adamw_update, chunk_numel

    param, grad = torch.randn(numel), torch.randn(numel)
    m, v = torch.zeros(numel), torch.zeros(numel)
    chunk = chunk_numel(param.device)

    def step():
        for start in range(0, numel, chunk):
            s = slice(start, start + chunk)
            adamw_update(param[s], grad[s], m[s], v[s], 1, 1e-3, AdamWConfig())

    return _best(step, runs=3) / numel


def local_probes() -> dict:
    """Every probe but communication, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = matmul_rate(torch.float32)
        return {"matmul_flops": {"fp32": fp32, "bf16": matmul_rate(torch.bfloat16)},
                "attention_efficiency": attention_efficiency(fp32),
                "memory_bandwidth": memory_bandwidth(), "op_overhead_s": op_overhead(),
                "optimizer_s_per_param": optimizer_seconds_per_param()}
    finally:
        torch.set_num_threads(threads)


def comm_probe() -> dict:
    """On every rank of the world: alpha-beta of a link and of the native all-reduce,
    the same on every rank (a collective)."""
    from meshwise.comm import ops

    group = ops.world_group(timeout_s=120.0)
    model = probe(group, Topology.of(tuple(range(group.size)), group.size), large=8 * 2**20,
                  repeats=7)
    link = model.links["intra"]
    return {"size": group.size,
            "link": {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte},
            "all_reduce": {"alpha_s": model.native.alpha_s,
                           "beta_s_per_byte": model.native.beta_s_per_byte}}
