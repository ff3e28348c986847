"""The bytes a layer's eager element-wise ops move, counted from the families' own code.

The GPU profiles of ``meshwise plan`` price the element-wise work of a layer
(norms, rotary positions, activations, residual adds, the casts between them)
by the bytes its kernels read and write (``meshwise.planner.traffic``). This
script counts them: a one- and a two-layer model of the family run forward and
backward on the CPU at two sequence lengths under a ``TorchDispatchMode`` that
adds up, for every ATen op that is neither a matrix multiply nor attention nor
a view, the bytes of its input and output tensors (a kernel reads each input
and writes each output once); the differences leave the bytes of one layer per
token. Each tensor is counted where tensor parallelism leaves it: an activation
of ``d_model`` features per token lies between the tp regions (split by tp only
under ``--sp``), any other inside them (split by tp). Llama's traffic is fitted
as ``c_d d + c_q q + c_kv kv + c_f f`` over configurations that vary each width.

    python benchmarks/planner_traffic.py   # prints the table for meshwise/planner/traffic.py
"""

from __future__ import annotations

import collections

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.models.llama import Llama, LlamaConfig

MATMUL = {"mm", "addmm", "bmm", "linear", "matmul"}
NO_KERNEL = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "expand",
    "unsqueeze",
    "squeeze",
    "permute",
    "slice",
    "select",
    "split",
    "chunk",
    "as_strided",
    "alias",
    "detach",
    "split_with_sizes",
    "unbind",
    "_reshape_alias",
    "lift_fresh",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class OpBytes(TorchDispatchMode):
    """Bytes and kernels of the element-wise ops run inside, by phase and region."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model, self.phase = d_model, "forward"
        self.bytes: collections.Counter = collections.Counter()
        self.kernels: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        kind = (
            "matmul"
            if name in MATMUL
            else "attention"
            if "attention" in name
            else None
            if name in NO_KERNEL
            else "elementwise"
        )
        if kind is None:
            return out
        self.kernels[(self.phase, kind)] += 1
        if kind == "elementwise":
            tensors = [
                t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)
            ]
            for t in tensors:
                region = "between" if t.dim() >= 2 and t.shape[-1] == self.d_model else "inside"
                self.bytes[(self.phase, region)] += t.numel() * t.element_size()
        return out


def _llama(sizes: dict, tokens: int, layers: int, dtype):
    cfg = LlamaConfig(n_layer=layers, block_size=tokens, vocab_size=64, **sizes)
    model = Llama(cfg).to(dtype)
    model.embed_tokens = model.norm = model.lm_head = None
    return model, list(model.layers.values()), cfg.d_model


def _gpt(sizes: dict, tokens: int, layers: int, dtype):
    cfg = GPTConfig(n_layer=layers, block_size=tokens, vocab_size=64, **sizes)
    model = GPT(cfg).to(dtype)
    model.wte = model.wpe = model.ln_f = model.lm_head = None
    return model, list(model.blocks.values()), cfg.d_model


BUILDERS = {"llama": _llama, "gpt": _gpt}


def _run(family: str, sizes: dict, tokens: int, layers: int, mode: str, dtype) -> OpBytes:
    torch.manual_seed(0)
    model, blocks, d_model = BUILDERS[family](sizes, tokens, layers, dtype)
    apply_activation_checkpointing(blocks, mode)
    x = torch.randn(1, tokens, d_model, dtype=dtype, requires_grad=True)
    counter = OpBytes(d_model)
    with counter:
        y = model(x)
        counter.phase = "backward"
        y.backward(torch.ones_like(y))
    return counter


def layer_bytes(family: str, sizes: dict, mode: str, dtype: str) -> dict:
    """``{(phase, region): bytes}`` one layer's element-wise ops move per token."""
    runs = {
        (t, n): _run(family, sizes, t, n, mode, DTYPES[dtype]) for t in (32, 64) for n in (1, 2)
    }
    keys = set().union(*(r.bytes for r in runs.values()))
    return {
        k: (
            (runs[64, 2].bytes[k] - runs[32, 2].bytes[k])
            - (runs[64, 1].bytes[k] - runs[32, 1].bytes[k])
        )
        / 32
        for k in keys
    }


def layer_kernels(family: str, sizes: dict, mode: str) -> dict:
    """``{(phase, kind): kernels}`` of one layer."""
    one, two = (_run(family, sizes, 32, n, mode, torch.float32) for n in (1, 2))
    return {k: two.kernels[k] - one.kernels[k] for k in set(one.kernels) | set(two.kernels)}


LLAMA_FITS = [  # d_model, query heads, key/value heads, head size, MLP width
    (256, 4, 2, 48, 512),
    (384, 4, 2, 48, 512),
    (256, 8, 2, 48, 512),
    (256, 8, 4, 48, 512),
    (256, 4, 2, 48, 1024),
]


def llama_coefficients(mode: str, dtype: str) -> dict:
    """Per phase: ``(c_d, c_q, c_kv, c_f)``, bytes per token per element of each width
    (c_d from the tensors between the tp regions, the rest from those inside)."""
    rows, between, inside = [], collections.defaultdict(list), collections.defaultdict(list)
    for d, heads, kv_heads, head_size, ffn in LLAMA_FITS:
        sizes = {
            "d_model": d,
            "n_head": heads,
            "n_kv_head": kv_heads,
            "head_size": head_size,
            "ffn_hidden_size": ffn,
        }
        counted = layer_bytes("llama", sizes, mode, dtype)
        rows.append([heads * head_size, kv_heads * head_size, ffn])
        for phase in ("forward", "backward"):
            between[phase].append(counted.get((phase, "between"), 0.0) / d)
            inside[phase].append(counted.get((phase, "inside"), 0.0))
    out = {}
    for phase in ("forward", "backward"):
        c_qkf = np.linalg.lstsq(np.array(rows, float), np.array(inside[phase]), rcond=None)[0]
        out[phase] = (float(np.mean(between[phase])), *map(float, c_qkf))
    return out


def gpt_coefficients(mode: str, dtype: str) -> dict:
    """Per phase: ``(c_between, c_inside)`` bytes per token per element of d_model."""
    d = 256
    counted = layer_bytes("gpt", {"d_model": d, "n_head": 4}, mode, dtype)
    return {
        phase: (counted.get((phase, "between"), 0.0) / d, counted.get((phase, "inside"), 0.0) / d)
        for phase in ("forward", "backward")
    }


def main() -> None:
    for dtype in DTYPES:
        for mode in ("none", "selective"):
            llama = llama_coefficients(mode, dtype)
            gpt = gpt_coefficients(mode, dtype)
            print(
                f"{dtype} {mode}: llama (c_d, c_q, c_kv, c_f) "
                + ", ".join(f"{p} ({', '.join(f'{c:.1f}' for c in v)})" for p, v in llama.items())
                + "; gpt (between, inside) "
                + ", ".join(f"{p} ({', '.join(f'{c:.1f}' for c in v)})" for p, v in gpt.items())
            )
    for family, sizes in (
        ("llama", {"d_model": 256, "n_head": 4, "n_kv_head": 2, "ffn_hidden_size": 512}),
        ("gpt", {"d_model": 256, "n_head": 4}),
    ):
        for mode in ("none", "selective", "full"):
            kernels = dict(sorted(layer_kernels(family, sizes, mode).items()))
            print(f"{family} {mode} kernels per layer: {kernels}")


if __name__ == "__main__":
    main()
