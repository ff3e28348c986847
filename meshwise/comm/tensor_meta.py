"""A tensor's shape and dtype as a small fixed-size message, sent ahead of the tensor.

A receiver must allocate before it receives (nanotron's pipeline p2p sends metadata
first too). int64 layout: ``[MAGIC, dtype code, ndim, sizes..., 0 ...]``, ``MESSAGE_LEN``
entries; the magic number catches two peers out of step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_DIMS = 8
MESSAGE_LEN = 3 + MAX_DIMS
_MAGIC = 0x6D657461  # "meta"
# Codes are positions in this tuple: append only, never reorder (both ends must agree).
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate a tensor: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tuple(tensor.shape), tensor.dtype)

    def empty(self, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of this shape and dtype, to receive into."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def to_message(self, device: torch.device) -> torch.Tensor:
        """The header, (MESSAGE_LEN,) int64 on ``device``."""
        if len(self.shape) > MAX_DIMS:
            raise ValueError(
                f"cannot send a {len(self.shape)}-d tensor {self}: pipeline "
                f"messages carry at most {MAX_DIMS} dims"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"cannot send a tensor of dtype {self.dtype}; supported: "
                f"{', '.join(str(d) for d in _DTYPES)}"
            )
        padding = [0] * (MAX_DIMS - len(self.shape))
        values = [_MAGIC, _DTYPES.index(self.dtype), len(self.shape), *self.shape, *padding]
        return torch.tensor(values, dtype=torch.int64, device=device)

    @classmethod
    def from_message(cls, message: torch.Tensor) -> "TensorMeta":
        """Read a header back (one device-to-host copy)."""
        magic, code, ndim, *sizes = message.tolist()
        if magic != _MAGIC or not 0 <= code < len(_DTYPES) or not 0 <= ndim <= MAX_DIMS:
            raise RuntimeError(
                f"received a malformed tensor header {message.tolist()}: the "
                "peers' messages are out of step"
            )
        return cls(tuple(sizes[:ndim]), _DTYPES[code])

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {self.dtype}"


def empty_message(device: torch.device) -> torch.Tensor:
    """A buffer to receive one header into."""
    return torch.empty(MESSAGE_LEN, dtype=torch.int64, device=device)
