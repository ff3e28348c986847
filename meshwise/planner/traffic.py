"""Bytes the eager element-wise kernels of a step move per token and layer, counted from
meshwise's own ops by ``benchmarks/planner_traffic.py`` and held to the code by
``tests/unit/test_planner_traffic.py``. (An RMSNorm as PyTorch ops moves about 36 bytes
per element in bf16 forward, where a fused kernel would move 6.)
"""

from __future__ import annotations

from meshwise.planner.layout import Layout
from meshwise.planner.shapes import ModelShape

# (family, dtype, mode) -> phase -> coefficients. Llama: (c_d, c_q, c_kv, c_f), bytes per
# token per element of d_model (between the tp regions), of the query width, of the
# key/value width and of the MLP width (inside). GPT: (between, inside) per element of
# d_model. "recompute": what selective and full checkpointing add to the backward (the
# element-wise forward again). Counted in torch 2.13.
LAYER_TRAFFIC: dict[tuple[str, str], dict[str, tuple[float, ...]]] = {
    ("llama", "bf16"): {
        "forward": (84.0, 20.5, 20.7, 10.3),
        "backward": (222.0, 24.5, 24.7, 24.3),
        "recompute": (78.0, 20.6, 20.7, 10.4),
    },
    ("llama", "fp32"): {
        "forward": (80.0, 41.0, 41.3, 20.6),
        "backward": (252.0, 49.0, 49.3, 48.6),
        "recompute": (68.0, 41.0, 41.4, 20.6),
    },
    ("gpt", "bf16"): {"forward": (20.0, 16.0), "backward": (28.0, 62.0), "recompute": (14.0, 16.1)},
    ("gpt", "fp32"): {
        "forward": (40.0, 32.1),
        "backward": (56.0, 124.1),
        "recompute": (28.0, 32.0),
    },
}
# The loss over the vocabulary, bytes per logit: the logits cast to fp32, log-softmax,
# the picked log-probabilities, and their gradients (vocab_parallel_cross_entropy).
LOSS_FORWARD = {"bf16": 18.0, "fp32": 12.0}
LOSS_BACKWARD = {"bf16": 26.0, "fp32": 20.0}
# AdamW on one owned fp32 parameter as the engines run it: PyTorch's fused kernel reads
# the parameter, its gradient and both moments and writes all four back, the gradient
# scaled by the clipping factor (grad_scale): 32 bytes.
ADAMW_BYTES = 32.0


def layer_traffic(shape: ModelShape, layout: Layout, dtype: str) -> dict[str, float]:
    """Bytes per token of one layer on one rank: ``forward``, ``backward`` (input and
    weight gradients) and ``recompute`` (added to the backward under checkpointing)."""
    table = LAYER_TRAFFIC.get((shape.family, dtype)) or LAYER_TRAFFIC[("llama", dtype)]
    t = layout.tp
    s = t if layout.sp else 1
    d = shape.d_model
    out = {}
    for phase, c in table.items():
        if len(c) == 2:  # GPT: both regions scale with d_model
            out[phase] = c[0] * d / s + c[1] * d / t
        else:
            out[phase] = (
                c[0] * d / s + (c[1] * shape.q_width + c[2] * shape.kv_width + c[3] * shape.ffn) / t
            )
    return out


def collect_bytes(dtype: str, grad_reduce_dtype: str) -> float:
    """Bytes per parameter to put one micro-batch's gradient into a flat buffer: the
    gradient read in the compute dtype, the buffer read and written in the reduce
    dtype (an accumulating add; the first micro-batch's copy moves less)."""
    reduce = 2 if dtype == "bf16" and grad_reduce_dtype == "bf16" else 4
    return (2 if dtype == "bf16" else 4) + 2 * reduce
