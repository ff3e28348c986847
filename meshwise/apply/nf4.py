"""QLoRA's frozen base (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized
LLMs", section 3): each frozen linear weight stored as 4-bit NormalFloat (NF4) codes in
blocks of 64 values of the row-major weight, one fp32 absmax scale per block, in
bitsandbytes' layout (two codes a byte, the first in the high nibble; no double
quantisation of the scales). The layer dequantises its weight for each forward and again
for its backward (saved-tensor hooks keep the codes, never the dense copy), so a dense
weight lives only while its own layer computes.

Blocks never straddle a row, so a tensor-parallel shard (whole rows, or a slice of each row
that is a whole number of blocks) holds exactly the codes of the full weight's blocks:
every layout stores the same 4-bit values.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from meshwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from meshwise.tensor_parallel.mappings import tp_size_of

QUANTIZE_BASE = ("none", "nf4")
BLOCK_SIZE = 64
# The 16 NF4 values: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero (QLoRA
# section 3; the same fp32 values as bitsandbytes' code book).
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
LINEAR_TYPES = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
LinearLayer = nn.Linear | ColumnParallelLinear | RowParallelLinear
HELD_AS = "nf4_weight"  # the attribute of a quantised layer that holds its NF4Weight


def nf4_code(device=None) -> torch.Tensor:
    """The code book, fp32, on ``device``."""
    return torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)


@torch.no_grad()
def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of ``weight`` (its numel a multiple of 64): uint8 codes, two
    a byte, and an fp32 absmax per block of 64 consecutive row-major values."""
    if weight.numel() % BLOCK_SIZE:
        raise ValueError(
            f"NF4 takes blocks of {BLOCK_SIZE} values; a weight of shape "
            f"{tuple(weight.shape)} has {weight.numel()}"
        )
    blocks = weight.detach().float().reshape(-1, BLOCK_SIZE)  # (num_blocks, 64)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-1.0, 1.0)
    code = nf4_code(weight.device)
    # The nearest code value (ties to the lower one): a search among the midpoints.
    midpoints = (code[1:] + code[:-1]) / 2
    index = torch.bucketize(scaled, midpoints).to(torch.uint8)  # (num_blocks, 64) in 0..15
    codes = (index[:, 0::2] << 4) | index[:, 1::2]  # (num_blocks, 32)
    return codes.reshape(-1), absmax


# Code bytes looked up at a time on a CPU, where every transient counts in the process's
# RSS and a loop costs no kernel launch; an accelerator looks a weight up in one go.
CPU_LOOKUP_BYTES = 1 << 16


@torch.no_grad()
def dequantize_nf4(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    code: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight of ``shape`` in ``dtype`` that ``codes`` and ``absmax`` stand for (the
    product taken in fp32, then cast)."""
    code = nf4_code(codes.device) if code is None else code
    # a byte's two values, high nibble first: the lookup's index is one int32 per byte
    byte_values = torch.stack((code.repeat_interleave(16), code.repeat(16)), dim=1)
    values = torch.empty(codes.numel(), 2, dtype=torch.float32, device=codes.device)
    step = CPU_LOOKUP_BYTES if codes.device.type == "cpu" else max(codes.numel(), 1)
    for start in range(0, codes.numel(), step):
        index = codes[start : start + step].int()
        torch.index_select(byte_values, 0, index, out=values[start : start + step])
    blocks = values.view(-1, BLOCK_SIZE)  # scaled in place: no second buffer of the layer
    return blocks.mul_(absmax.unsqueeze(1)).reshape(shape).to(dtype)


@dataclass
class NF4Weight:
    """A frozen weight held as NF4: what a layer dequantises for compute."""

    codes: torch.Tensor  # uint8, numel / 2
    absmax: torch.Tensor  # fp32, numel / 64
    code: torch.Tensor  # the code book on the codes' device
    shape: tuple[int, ...]
    dtype: torch.dtype  # the compute dtype

    @classmethod
    def of(cls, weight: torch.Tensor, dtype: torch.dtype) -> NF4Weight:
        codes, absmax = quantize_nf4(weight)
        return cls(codes, absmax, nf4_code(weight.device), tuple(weight.shape), dtype)

    def dense(self) -> torch.Tensor:
        return dequantize_nf4(self.codes, self.absmax, self.shape, self.dtype, self.code)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.absmax.nbytes


def local_in_features(module: LinearLayer) -> int:
    """The length of a row of ``module``'s weight on this rank (a row-parallel layer
    holds a slice of each row)."""
    if isinstance(module, RowParallelLinear):
        return module.in_features // tp_size_of(module.tp_group)
    return module.in_features


def quantizable_layers(chunk: nn.Module, skip=()) -> list[tuple[str, LinearLayer]]:
    """``(path, module)`` of each linear layer whose weight NF4 holds: every one but the
    modules in ``skip`` (the output head, as bitsandbytes' 4-bit loading leaves it)."""
    return [
        (path, m)
        for path, m in chunk.named_modules()
        if isinstance(m, LINEAR_TYPES) and path not in skip
    ]


def quantize_layer(module: LinearLayer, weight: torch.Tensor, dtype: torch.dtype) -> NF4Weight:
    """Hold ``module``'s frozen weight as NF4 codes of ``weight`` (this rank's values of
    it): the parameter goes, and each forward computes with the weight dequantised."""
    if local_in_features(module) % BLOCK_SIZE:
        raise ValueError(
            f"--quantize-base nf4: a row of {module} holds {local_in_features(module)} values "
            f"on this rank, not a whole number of {BLOCK_SIZE}-value blocks"
        )
    state = NF4Weight.of(weight, dtype)
    del module.weight  # the parameter: no full-precision copy stays
    placeholder = torch.empty(state.shape, dtype=dtype, device="meta")
    module.weight = placeholder  # shape and dtype for whoever asks, no storage
    setattr(module, HELD_AS, state)
    forward = partial(_forward_dequantized, module, module.forward, state, placeholder)
    module.forward = forward  # type: ignore[method-assign]
    return state


def _forward_dequantized(module, forward, state: NF4Weight, placeholder, *args, **kwargs):
    dense = state.dense()
    pack = partial(_pack, state=state, storage=dense.untyped_storage().data_ptr())
    module.weight = dense
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            return forward(*args, **kwargs)
    finally:
        module.weight = placeholder


def _pack(tensor: torch.Tensor, *, state: NF4Weight, storage: int):
    """A view of the dense weight is saved as the codes and the view's geometry."""
    if tensor.untyped_storage().data_ptr() != storage:
        return tensor
    return state, tuple(tensor.shape), tensor.stride(), tensor.storage_offset()


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    state, shape, stride, offset = packed
    return state.dense().as_strided(shape, stride, offset)


@torch.no_grad()
def quantize_frozen(model, values, dtype: torch.dtype, device, skip=()) -> int:
    """Hold every frozen linear weight of ``model`` (a ``ParallelModel`` whose frozen
    weights no engine holds yet) as NF4, quantised from ``values``' fp32 values of this
    rank's piece. Returns the number of weights quantised."""
    names = {id(p): name for name, p in model.named_parameters()}
    count = 0
    for chunk in model.chunks:
        for _, module in quantizable_layers(chunk, skip):
            p = module.weight
            if p.requires_grad or p.device.type != "meta":
                continue
            full = values(names[id(p)], 0, p.numel()).view(p.shape)
            quantize_layer(module, full.to(device=device, dtype=torch.float32), dtype)
            count += 1
    return count


def quantized_bytes(chunks: list[nn.Module]) -> int:
    """Bytes of the NF4 codes and scales held in ``chunks``."""
    held = [getattr(m, HELD_AS, None) for c in chunks for m in c.modules()]
    return sum(state.nbytes for state in held if isinstance(state, NF4Weight))
