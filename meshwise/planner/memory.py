"""Peak memory of one rank (its first backward after the most forwards) from the model's
shapes and the layout: model state, ZeRO's buffers, activations times micro-batches in
flight, logits, the runtime (docs/choosing-a-layout.md "What the prediction counts").
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwise.pipeline.schedules import SPLIT_BACKWARD
from meshwise.planner.experts import expert_dp
from meshwise.planner.layout import Layout
from meshwise.planner.lora import DEQUANTIZE_WORKING_BYTES, NF4_BYTES_PER_PARAM, rank_lora_params
from meshwise.planner.shapes import ModelShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Settings:
    """What besides the layout decides memory and time."""

    seq_len: int
    batch_size: int
    dtype: str = "fp32"
    grad_reduce_dtype: str = "fp32"
    bucket_mb: float = 25.0


@dataclass
class MemoryBreakdown:
    """Bytes one rank holds at its peak, by what holds them."""

    rank: int  # the pipeline rank (the worst one)
    params: int  # parameters this rank holds (its shard of the model before ZeRO)
    model_state: float  # kept between steps: the metrics' model_state_bytes
    pipeline_state: float  # ZeRO-2/3 under a pipeline: full gradients (and parameters)
    buffers: float  # buckets, gathered units, messages in flight
    activations: float
    logits: float
    overhead: float
    in_flight: int  # micro-batches whose activations are kept at once
    frozen: float | None = None  # LoRA: the frozen weights' part of the model state

    @property
    def total(self) -> float:
        return (
            self.model_state
            + self.pipeline_state
            + self.buffers
            + self.activations
            + self.logits
            + self.overhead
        )

    def parts(self) -> dict[str, float]:
        state = {"model state": self.model_state}
        if self.frozen is not None:
            state = {"frozen weights": self.frozen, "adapters": self.model_state - self.frozen}
        return {
            **state,
            "pipeline ZeRO": self.pipeline_state,
            "buffers": self.buffers,
            "activations": self.activations,
            "logits and loss": self.logits,
            "runtime": self.overhead,
        }


def model_state_bytes_per_param(zero: int, n: int, dtype: str, grad_reduce_dtype: str) -> float:
    """The README's table: parameters, gradients and AdamW state kept between steps, per
    parameter, at ZeRO ``zero`` over ``n`` ranks (Rajbhandari et al. 2019, section 5)."""
    if zero == 3:
        return 16 / n
    if dtype == "fp32":
        return {0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n}[zero]
    grad = 2 if grad_reduce_dtype == "bf16" else 4
    return {0: 2 + grad + 12, 1: 2 + grad + 12 / n, 2: 2 + 16 / n}[zero]


def rank_params(shape: ModelShape, layout: Layout, rank: int) -> tuple[int, int, int]:
    """(parameters of rank ``rank``'s layers, of its first-stage modules, of its
    last-stage modules), each this tp rank's shard (its layers' routed experts: its
    ``1 / ep`` of them, ``rank_expert_params``)."""
    t = layout.tp
    layers = shape.n_layer // layout.pp * (shape.layer_split // t + shape.layer_replicated)
    layers = round(layers + rank_expert_params(shape, layout))
    v_shape = layout.schedule in ("zbv", "dualpipev") and layout.pp > 1
    first = (shape.embed_split // t + shape.embed_replicated) if rank == 0 else 0
    is_last = rank == (0 if v_shape else layout.pp - 1)
    head = 0 if (shape.tied and layout.pp == 1) or (shape.tied and v_shape) else shape.head_split
    last = (shape.final_replicated + head // t) if is_last else 0
    return layers, first, last


def rank_expert_params(shape: ModelShape, layout: Layout) -> float:
    """Routed expert parameters one rank holds: its stage's share of the MoE layers, of
    each its ``1 / ep`` of the experts (whole over tp)."""
    return shape.moe_layers * shape.expert_params / (layout.pp * layout.ep)


def activation_bytes_per_token(shape: ModelShape, layout: Layout, dtype: str) -> dict[str, float]:
    """Bytes one transformer layer keeps for its backward per token of a micro-batch on one
    rank, by checkpointing mode (Korthikanti et al. 2022, section 4, counted for meshwise's
    own layers): ``none`` all autograd saves, ``selective`` the input and the outputs of
    matmuls and attention, ``full`` the input.
    """
    # Per layer, a bytes per element, t tp, s tp under --sp (else 1). GPT: the residual
    # input, LayerNorm outputs and the residual after attention, 4 d / s; inside the tp
    # region q/k/v (3 d), attention's output and its reshaped copy (2 d), the MLP's two
    # 4 d hidden tensors: 13 d / t. Llama: each RMSNorm's fp32 input, normalised value and
    # output (3 d each) / s; the rotated q, k, v, attention output and its copy, the
    # SwiGLU's gate, up and product: (3 q + 2 kv + 3 f) / t. Attention keeps an fp32
    # log-sum-exp per head, never the (T, T) scores (flash attention; the cp ring alike).
    a, t = DTYPE_BYTES[dtype], layout.tp
    s = t if layout.sp else 1
    d, lse = shape.d_model, 4.0 * shape.n_head / t
    # selective keeps each matmul's and attention's output: the column layers' and
    # attention's are split over tp, the row layers' two (before their reduction) are not
    if shape.family == "gpt":
        between, inside = 4 * d * a, (3 * d + 2 * d + 2 * shape.ffn) * a
        kept = (3 * d + d + shape.ffn) * a
    else:
        norm = 3 * a if dtype == "fp32" else 4 + 2 * a  # bf16: an fp32 copy of the input
        between = 2 * d * norm
        inside = (3 * shape.q_width + 2 * shape.kv_width + 3 * shape.ffn) * a
        kept = (2 * shape.q_width + 2 * shape.kv_width + 2 * shape.ffn) * a
    return {
        "none": between / s + inside / t + lse,
        "selective": d * a / s + kept / t + 2 * d * a + lse,
        "full": d * a / s,
    }


def peak_memory(
    shape: ModelShape,
    layout: Layout,
    settings: Settings,
    in_flight: list[int],
    overhead_bytes: float,
    given_gradient_bytes: float = 0.0,
    checkpointing_bytes: float = 0.0,
) -> MemoryBreakdown:
    """The worst rank's peak. ``in_flight[r]``: (micro-batch, chunk) activations pipeline
    rank r keeps at most at once (the simulator's count; ``[1]`` without a pipeline);
    ``overhead_bytes``, ``given_gradient_bytes``, ``checkpointing_bytes``: the device
    profile's (what checkpointing loads includes what a given gradient does)."""
    worst, seen = None, set()
    for rank in range(layout.pp):
        role = (rank == 0, rank == layout.pp - 1, in_flight[rank])
        if role in seen:
            continue  # the same memory as a rank already counted
        seen.add(role)
        loaded = max(
            given_gradient_bytes * _backward_from_gradient(layout, rank),
            checkpointing_bytes * (layout.activation_checkpointing != "none"),
        )
        overhead = overhead_bytes + loaded
        b = _rank_memory(shape, layout, settings, rank, in_flight[rank], overhead)
        if worst is None or b.total > worst.total:
            worst = b
    assert worst is not None, "a layout has at least one pipeline rank"
    return worst


def _backward_from_gradient(layout: Layout, rank: int) -> bool:
    """Whether pipeline ``rank`` runs a backward from a received gradient (a chunk before
    the last stage) or a W pass (a split backward's weight gradients)."""
    if layout.pp == 1:
        return False
    return layout.schedule in SPLIT_BACKWARD or layout.virtual_stages > 1 or rank < layout.pp - 1


def _rank_memory(
    shape, layout: Layout, st: Settings, rank: int, in_flight: int, overhead: float
) -> MemoryBreakdown:
    layers, first, last = rank_params(shape, layout, rank)
    params = layers + first + last
    n, a = layout.shard_size * layout.cp, DTYPE_BYTES[st.dtype]  # ZeRO's ranks
    frozen, trained = model_state(shape, layout, st, params, last > 0)
    state = frozen + trained
    adapters, quantized = rank_lora_params(shape, layout, last > 0)
    grads = adapters if shape.lora else params  # what has a gradient
    pipeline = 0.0
    if layout.pp > 1 and layout.zero >= 2 and n > 1:
        pipeline = grads * 4 * (1 - 1 / n)  # the stage's full fp32 gradients
        if layout.zero == 3:  # and its gathered parameters (NF4 is held whole)
            pipeline += (params - quantized) * a
    tokens = (
        st.batch_size
        // (layout.dp * layout.grad_accum * layout.micro_batches)
        * st.seq_len
        // layout.cp
    )  # of one micro-batch on this rank
    per_layer = activation_bytes_per_token(shape, layout, st.dtype)
    mode = layout.activation_checkpointing
    layers_per_chunk = shape.n_layer // (layout.pp * layout.virtual_stages)
    kept = per_layer[mode] * tokens * layers_per_chunk * in_flight
    # The layer whose backward runs: its activations whole again under checkpointing,
    # and its gradients of them (about one layer's worth).
    working = per_layer["none"] * tokens * (2 if mode != "none" else 1)
    buffers = _buffers(shape, layout, st, layers, first + last, n, grads / max(params, 1)) + (
        2 * tokens * shape.d_model * a if layout.pp > 1 else 0
    )
    if quantized:  # the layer dequantising: its fp32 values and int32 indices
        largest = shape.lora.nf4_largest / layout.tp
        buffers += largest * DEQUANTIZE_WORKING_BYTES
    is_last = last > 0
    logits = 0.0
    if is_last:
        vocab = -(-shape.vocab // layout.tp)
        # logits in the compute dtype, their fp32 log-softmax kept for the backward, and
        # its gradient; under a pipeline the last rank keeps one micro-batch's at a time.
        logits = tokens * vocab * (a + 4 + 4)
    return MemoryBreakdown(
        rank,
        params,
        state,
        pipeline,
        buffers,
        kept + working,
        logits,
        overhead,
        in_flight,
        frozen if shape.lora else None,
    )


def model_state(
    shape: ModelShape, layout: Layout, st: Settings, params: float, is_last: bool
) -> tuple[float, float]:
    """(frozen, trained) bytes of model state a rank holding ``params`` parameters keeps.
    Full training: nothing frozen, the README's table (routed experts sharded over their
    expert data parallel ranks). LoRA: the frozen weights in the compute dtype (ZeRO-3
    shards them, not the experts' nor NF4's, held whole) or as NF4, and the adapters'
    state sharded as a trained parameter's."""
    n = layout.shard_size * layout.cp  # ZeRO's ranks
    experts = rank_expert_params(shape, layout)
    if shape.lora is None:
        n_expert = expert_dp(layout.dp, layout.cp, layout.ep)
        return 0.0, (params - experts) * model_state_bytes_per_param(
            layout.zero, n, st.dtype, st.grad_reduce_dtype
        ) + experts * model_state_bytes_per_param(
            layout.zero, n_expert, st.dtype, st.grad_reduce_dtype
        )
    a = DTYPE_BYTES[st.dtype]
    adapters, quantized = rank_lora_params(shape, layout, is_last)
    dense = params - experts - quantized
    frozen = dense * a / (n if layout.zero == 3 else 1) + experts * a
    frozen += quantized * NF4_BYTES_PER_PARAM
    per_adapter = model_state_bytes_per_param(layout.zero, n, st.dtype, st.grad_reduce_dtype)
    return frozen, adapters * per_adapter


def _buffers(
    shape: ModelShape,
    layout: Layout,
    st: Settings,
    layer_params: int,
    root_params: int,
    n: int,
    trained: float = 1.0,
) -> float:
    """Gradient buckets and ZeRO-3's gathered units (transient, reused across steps);
    ``trained``: the share of the parameters with a gradient (LoRA: the adapters)."""
    if n == 1:
        return 0.0
    a = DTYPE_BYTES[st.dtype]
    bucket = st.bucket_mb * 2**20
    grads = (layer_params + root_params) * 4 * trained
    if layout.zero < 3:
        # a bucket being reduced (gloo and NCCL work on a copy) and, at stage 2, the one
        # being filled
        return min(bucket, grads) * (2 if layout.zero == 2 else 1)
    layers_here = shape.n_layer // layout.pp
    per_layer = layer_params / max(layers_here, 1)
    unit_layers = max(1, min(layers_here, int(bucket // max(per_layer * 4, 1))))
    unit = per_layer * unit_layers
    if layout.pp > 1:
        return unit * 4 * trained  # one unit's reduce-scatter buffer
    # the root unit, the unit running and the one prefetched, one unit's full gradient
    return root_params * a + 2 * unit * a + unit * 4 * trained
