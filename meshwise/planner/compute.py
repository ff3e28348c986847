"""The time of one micro-batch's forward and backward on one rank, by action.

Each layer is a list of work a device rates separately (a roofline per kind of
work, as vTrain and Proteus time operators): matrix multiplies at the device's
matmul rate, attention at that rate times its efficiency (causal blocks
skipped, so half the ``T x T`` product), element-wise work at the memory
bandwidth, and each kernel a fixed launch or dispatch cost. The backward splits
as the zero-bubble schedules split it: ``B`` the input gradients (attention's
whole backward, about 2.5 forwards of it, FlashAttention-2's count), ``W`` the
weight gradients (one more pass of the matmuls). Activation recomputation adds
a forward (``full``) or its element-wise part (``selective``) to ``B``.

Tensor parallelism adds two all-reduces of the layer's activations to each
forward and backward (Megatron-LM; with ``--sp`` an all-gather and a
reduce-scatter in their place, and the backward's re-gather of the column
layers' inputs; a recompute repeats the forward's up to the last one it needs),
and at each a wait for the other tp ranks (``sync_wait_s``); context
parallelism passes key/value blocks around the ring ``cp - 1`` times (their
gradients too in the backward, and again in a recompute), hidden behind
attention where the device overlaps communication, else exposed with a wait for
the ring's neighbours at each exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwise.planner.collectives import collective_s, link_kind, p2p_s, sync_wait_s
from meshwise.planner.devices import DeviceProfile
from meshwise.planner.layout import Layout
from meshwise.planner.memory import DTYPE_BYTES, Settings, activation_bytes_per_token
from meshwise.planner.shapes import ModelShape

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

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.weights


def micro_batch_tokens(layout: Layout, st: Settings) -> int:
    """Tokens of one micro-batch on one rank."""
    sequences = st.batch_size // (layout.dp * layout.grad_accum * layout.micro_batches)
    return sequences * st.seq_len // layout.cp


def action_costs(shape: ModelShape, layout: Layout, st: Settings, device: DeviceProfile,
                 layers: int, first: bool, last: bool) -> ActionCosts:
    """Costs of a rank holding ``layers`` layers (and the embedding / head)."""
    n = micro_batch_tokens(layout, st)
    t, a = layout.tp, DTYPE_BYTES[st.dtype]
    rate = device.matmul_rate(st.dtype)
    matmul = 2.0 * n * shape.layer_matmul / t / rate
    attention = 2.0 * n * st.seq_len * shape.q_width / t / (rate * device.attention_efficiency)
    act = activation_bytes_per_token(shape, layout, st.dtype)["none"] * n
    elementwise = ELEMENTWISE_PASSES * act / device.memory_bandwidth
    kernels = KERNELS_PER_LAYER.get(shape.family, 30) * device.op_overhead_s
    forward = matmul + attention + elementwise + kernels
    backward = matmul + 2.5 * attention + 2 * elementwise + 2 * kernels
    mode = layout.activation_checkpointing
    backward += forward if mode == "full" else (elementwise + kernels if mode == "selective"
                                                else 0.0)
    weights = matmul
    factor = device.layer_time_factor.get(shape.family, 1.0)
    layer_compute = factor * (forward + backward + weights)
    f, b, w = (layers * factor * x for x in (forward, backward, weights))
    if first:
        f += n * shape.d_model * a * 2 / device.memory_bandwidth
    if last:
        vocab = -(-shape.vocab // t)
        head = 2.0 * n * shape.d_model * vocab / rate
        loss = n * vocab * 4 * 6 / device.memory_bandwidth  # log-softmax and its gradient
        f, b, w = f + head + loss / 2, b + head + loss / 2, w + head
    tp = layers * _tp_per_layer(shape, layout, st, device, n, layer_compute)
    cp = layers * _cp_per_layer(shape, layout, st, device, n, attention, layer_compute)
    return ActionCosts(f, b, w, tp, cp)


def _tp_per_layer(shape, layout: Layout, st: Settings, device: DeviceProfile, n: int,
                  layer_compute: float) -> float:
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
    moved = sum(k * collective_s(device, kind, nbytes, layout.tp, link)
                for kind, k in counts.items())
    return moved + sync_wait_s(device, layout.tp, sum(counts.values()), layer_compute,
                               layout.world_size)


def _cp_per_layer(shape, layout: Layout, st: Settings, device: DeviceProfile, n: int,
                  attention: float, layer_compute: float) -> float:
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
    if device.overlap:
        return max(0.0, total - 3.5 * attention)
    exchanges = (layout.cp - 1) * (2 + recompute) + 1  # the keys' gradients come home
    return total + sync_wait_s(device, layout.cp, exchanges, layer_compute,
                               layout.world_size)
