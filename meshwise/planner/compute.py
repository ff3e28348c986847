"""The time of one micro-batch's forward and backward on one rank, by action: a roofline
per kind of work (as vTrain and Proteus time operators), the backward split into B and
W as zero-bubble schedules split it, recomputation added to B, and tp's and cp's
communication per layer with the waits for their peers.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwise.planner.collectives import collective_s, link_kind, p2p_s, sync_wait_s
from meshwise.planner.devices import DeviceProfile
from meshwise.planner.experts import PASSES, RECOMPUTE_PASSES, all_to_all_s
from meshwise.planner.layout import Layout
from meshwise.planner.lora import dequantize_s
from meshwise.planner.memory import DTYPE_BYTES, Settings, activation_bytes_per_token
from meshwise.planner.shapes import ModelShape
from meshwise.planner.traffic import LOSS_BACKWARD, LOSS_FORWARD, collect_bytes, layer_traffic

# Kernels per layer in the forward (counted in the families' code: norms, projections,
# reshapes, attention, activations, residual adds); the backward runs about twice as many.
KERNELS_PER_LAYER = {"gpt": 22, "llama": 34}
ELEMENTWISE_PASSES = 3  # each kept activation is written once and read about twice


@dataclass
class ActionCosts:
    """One micro-batch on one rank, seconds: compute of F, B, W, and the exposed tp and cp
    communication inside F and B."""

    forward: float
    backward: float  # input gradients, recomputation included
    weights: float
    tp: float
    cp: float
    ep: float = 0.0  # the experts' all-to-alls

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.weights

    @property
    def comm(self) -> float:
        return self.tp + self.cp + self.ep


def micro_batch_tokens(layout: Layout, st: Settings) -> int:
    """Tokens of one micro-batch on one rank."""
    sequences = st.batch_size // (layout.dp * layout.grad_accum * layout.micro_batches)
    return sequences * st.seq_len // layout.cp


def action_costs(
    shape: ModelShape,
    layout: Layout,
    st: Settings,
    device: DeviceProfile,
    layers: int,
    first: bool,
    last: bool,
) -> ActionCosts:
    """Costs of a rank holding ``layers`` layers (and the embedding / head)."""
    n = micro_batch_tokens(layout, st)
    t, a = layout.tp, DTYPE_BYTES[st.dtype]
    rate = device.matmul_rate(st.dtype)
    matmul = 2.0 * n * shape.layer_matmul / t / rate
    attention = 2.0 * n * st.seq_len * shape.q_width / t / (rate * device.attention_efficiency)
    ew_forward, ew_backward, ew_recompute = _elementwise_s(shape, layout, st, device, n)
    kernels = KERNELS_PER_LAYER.get(shape.family, 30) * device.op_overhead_s
    forward = matmul + attention + ew_forward + kernels
    # attention's backward: about 2.5 forwards of it (FlashAttention-2's count)
    backward = matmul + 2.5 * attention + ew_backward + 2 * kernels
    weights = matmul + _collect_s(shape.layer_split / t + shape.layer_replicated, st, device)
    if shape.lora is not None:  # frozen weights: their input gradients only
        forward, backward, weights = _lora_layer(shape, layout, st, device, n, forward, backward)
    mode = layout.activation_checkpointing
    backward += (
        forward if mode == "full" else (ew_recompute + kernels if mode == "selective" else 0.0)
    )
    factor = device.layer_time_factor.get(shape.family, 1.0)
    layer_compute = factor * (forward + backward + weights)
    f, b, w = (layers * factor * x for x in (forward, backward, weights))
    trains_root = shape.lora is None  # LoRA: embedding, norms and head frozen
    if first:
        f += n * shape.d_model * a * 2 / device.memory_bandwidth
        if trains_root:
            w += _collect_s(shape.embed_split / t + shape.embed_replicated, st, device)
    if last:
        vocab = -(-shape.vocab // t)
        head = 2.0 * n * shape.d_model * vocab / rate
        loss_f, loss_b = _loss_s(st, device, n * vocab)
        f, b = f + head + loss_f, b + head + loss_b
        if trains_root:
            w += head + _collect_s(shape.final_replicated + shape.head_split / t, st, device)
    tp = layers * _tp_per_layer(shape, layout, st, device, n, layer_compute)
    cp = layers * _cp_per_layer(shape, layout, st, device, n, attention, layer_compute)
    ep = layers * _ep_per_layer(shape, layout, st, device, n, layer_compute)
    return ActionCosts(f, b, w, tp, cp, ep)


def _lora_layer(
    shape, layout: Layout, st: Settings, device: DeviceProfile, n: int, forward, backward
) -> tuple[float, float, float]:
    """One LoRA layer's F, B and W: the frozen weights' input gradients in B and no weight
    gradient (so B + W about one forward, not two), the adapters' two small matmuls in
    each, their gradients collected; under QLoRA each pass dequantises the weights (the
    backward again: the graph keeps the codes, ``meshwise.apply.nf4``)."""
    lora = shape.lora
    adapters = lora.adapter_split / layout.tp + lora.adapter_replicated
    adapter = 2.0 * n * adapters / device.matmul_rate(st.dtype)
    dequantize = dequantize_s(shape, layout, st.dtype, device)
    weights = adapter + _collect_s(adapters, st, device)
    return forward + adapter + dequantize, backward + adapter + dequantize, weights


def _elementwise_s(
    shape, layout: Layout, st: Settings, device: DeviceProfile, n: int
) -> tuple[float, float, float]:
    """Seconds of one layer's element-wise work on ``n`` tokens: forward, backward, and
    what checkpointing's recompute adds. With ``counted_traffic`` (GPU profiles) the
    bytes the family's eager kernels move (``meshwise.planner.traffic``); else passes
    over the activations a layer keeps (the CPU's calibration measured against these)."""
    if device.counted_traffic:
        traffic = layer_traffic(shape, layout, st.dtype)
        forward, backward, recompute = (
            traffic[phase] * n / device.memory_bandwidth
            for phase in ("forward", "backward", "recompute")
        )
        return forward, backward, recompute
    act = activation_bytes_per_token(shape, layout, st.dtype)["none"] * n
    forward = ELEMENTWISE_PASSES * act / device.memory_bandwidth
    return forward, 2 * forward, forward


def _collect_s(params: float, st: Settings, device: DeviceProfile) -> float:
    """Seconds to gather ``params`` parameters' gradients of one micro-batch into the
    engines' flat buffers (read in the compute dtype, written or added in the reduce
    dtype: ``meshwise.sharding``'s gradient hooks), where traffic is counted."""
    if not device.counted_traffic:
        return 0.0
    return params * collect_bytes(st.dtype, st.grad_reduce_dtype) / device.memory_bandwidth


def _loss_s(st: Settings, device: DeviceProfile, logits: int) -> tuple[float, float]:
    """Seconds of the loss over ``logits`` logits (this rank's vocabulary slice): the
    log-softmax forward, and its gradient."""
    if device.counted_traffic:
        return (
            logits * LOSS_FORWARD[st.dtype] / device.memory_bandwidth,
            logits * LOSS_BACKWARD[st.dtype] / device.memory_bandwidth,
        )
    both = logits * 4 * 6 / device.memory_bandwidth
    return both / 2, both / 2


def _tp_per_layer(
    shape, layout: Layout, st: Settings, device: DeviceProfile, n: int, layer_compute: float
) -> float:
    """Exposed tp communication of one layer, forward and backward, and the waits for the
    other tp ranks at each of its collectives (``layer_compute``: the layer's seconds)."""
    if layout.tp == 1:
        return 0.0
    nbytes = n * shape.d_model * DTYPE_BYTES[st.dtype]
    link = link_kind(1, layout.tp, device.ranks_per_node)
    recompute = layout.activation_checkpointing != "none"
    if layout.sp:
        # forward: a gather before each pair of column layers, a reduce-scatter after each
        # row layer; backward: their transposes, and the column layers' inputs gathered
        # again; a recompute repeats the forward up to the MLP's gather (its input is the
        # last thing the backward needs, so the recompute stops there)
        counts = {"all_gather": 6 + 2 * recompute, "reduce_scatter": 4 + recompute}
    else:  # after each row layer, and its transpose before each pair of column layers
        counts = {"all_reduce": 4 + recompute}
    moved = sum(
        k * collective_s(device, kind, nbytes, layout.tp, link) for kind, k in counts.items()
    )
    if layout.sp and device.counted_traffic and n * layout.cp > st.seq_len:
        # Several sequences per micro-batch: a gather (scatter) along the sequence puts
        # the ranks' blocks in (out of) place with a copy of the whole activation
        # (meshwise.tensor_parallel.mappings); one sequence needs none.
        moved += sum(counts.values()) * 2 * nbytes / device.memory_bandwidth
    return moved + sync_wait_s(
        device, layout.tp, sum(counts.values()), layer_compute, layout.world_size
    )


def _ep_per_layer(
    shape, layout: Layout, st: Settings, device: DeviceProfile, n: int, layer_compute: float
) -> float:
    """The experts' all-to-alls of one layer (an MoE layer's, times the share of layers
    that are), forward and backward, exposed (each waits for the tokens it moves), and the
    waits for the ep group's peers at each."""
    if layout.ep == 1 or not shape.moe_layers:
        return 0.0
    passes = PASSES + RECOMPUTE_PASSES * (layout.activation_checkpointing != "none")
    held = n * shape.experts_per_token * shape.d_model * DTYPE_BYTES[st.dtype]  # token copies
    # ep ranks borrowed from dp x cp: neighbours tp x pp ranks apart
    link = link_kind(layout.tp * layout.pp, layout.ep, device.ranks_per_node)
    moved = passes * all_to_all_s(device, held, layout.ep, link)
    waits = sync_wait_s(device, layout.ep, passes, layer_compute, layout.world_size)
    return (moved + waits) * shape.moe_layers / shape.n_layer


def _cp_per_layer(
    shape,
    layout: Layout,
    st: Settings,
    device: DeviceProfile,
    n: int,
    attention: float,
    layer_compute: float,
) -> float:
    """Exposed ring-attention communication of one layer, forward and backward, and the
    waits for the ring's neighbours at each exchange where it is not hidden."""
    if layout.cp == 1:
        return 0.0
    kv = n * 2 * shape.kv_width // layout.tp * DTYPE_BYTES[st.dtype]
    link = link_kind(layout.tp, layout.cp, device.ranks_per_node)
    ring = (layout.cp - 1) * p2p_s(device, kv, link)
    recompute = layout.activation_checkpointing != "none"
    # keys and values around the ring; in the backward their gradients too; a recompute
    # passes the keys and values around again
    total = ring * (3 + recompute)
    if device.overlap:  # hidden behind attention, which it slows meanwhile
        window = 3.5 * attention
        return max(0.0, total - window) + device.overlap_slowdown * min(total, window)
    exchanges = (layout.cp - 1) * (2 + recompute) + 1  # the keys' gradients come home
    return total + sync_wait_s(device, layout.cp, exchanges, layer_compute, layout.world_size)
