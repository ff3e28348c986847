"""A Hugging Face weights folder (``model.safetensors`` or an index of shards), read slice
by slice: checking reads only headers, and a ``Piece`` reads just its rows' bytes.

The files are read, not memory-mapped: pages of a mapping that stay resident count in
every rank's RSS for as long as it lives, so a rank holding a quarter of a model (ZeRO-3,
tensor parallelism, 4-bit codes) would look as large as the whole file.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from meshwise.geometry.pieces import Piece

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors' dtype names
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsDir:
    """The tensors of one folder, by name; ``read`` gives any piece of one."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index, single = self.directory / INDEX, self.directory / SINGLE
        if index.is_file():
            try:
                self.weight_map: dict[str, str] | None = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise ValueError(
                    f"--init-from {index}: not a readable index with a weight_map ({exc})"
                ) from None
        elif single.is_file():
            self.weight_map = None  # every tensor in the one file; names from its header
        else:
            raise ValueError(f"--init-from {self.directory}: neither {SINGLE} nor {INDEX} is there")
        self._headers: dict[str, tuple[dict, int]] = {}

    def _file(self, name: str) -> str:
        if self.weight_map is None:
            return SINGLE
        if name not in self.weight_map:
            raise ValueError(f"--init-from {self.directory}: {INDEX} lists no tensor {name}")
        return self.weight_map[name]

    def _header(self, file: str) -> tuple[dict, int]:
        """The file's header (name -> dtype, shape, data_offsets) and where its data starts."""
        if file not in self._headers:
            path = self.directory / file
            if not path.is_file():
                raise ValueError(
                    f"--init-from {self.directory}: the shard {file} that {INDEX} names is missing"
                )
            try:
                with path.open("rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(length))
                header.pop("__metadata__", None)
                for entry in header.values():
                    entry["dtype"] = DTYPES[entry["dtype"]]
            except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
                raise ValueError(
                    f"--init-from {path}: not a readable safetensors file ({exc!r})"
                ) from None
            self._headers[file] = header, 8 + length
        return self._headers[file]

    def _entry(self, name: str) -> dict:
        file = self._file(name)
        header, _ = self._header(file)
        if name not in header:
            raise ValueError(f"--init-from {self.directory}: no tensor {name} in {file}")
        return header[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (from its file's header)."""
        return tuple(self._entry(name)["shape"])

    def check(self, expected: dict[str, tuple[int, ...]], optional: tuple[str, ...] = ()) -> None:
        """Every ``expected`` tensor is there with its shape (``optional`` ones may be absent).

        Raises ValueError naming the first missing shard or tensor, or the first
        shape that config.json does not explain."""
        for name, shape in expected.items():
            stored = self.shape(name)
            if stored != tuple(shape):
                raise ValueError(
                    f"--init-from {self.directory}: {name} is stored as "
                    f"{list(stored)} but config.json implies {list(shape)}"
                )
        for name in optional:
            if self.has(name):
                self.shape(name)

    def has(self, name: str) -> bool:
        if self.weight_map is not None:
            return name in self.weight_map
        return name in self._header(SINGLE)[0]

    def read(self, name: str, piece: Piece) -> torch.Tensor:
        """The elements of ``piece`` of stored tensor ``name``, flat, in float32.

        Only the rows (along dim 0) that the piece's flat run touches are read,
        each cut to the box along the other dims."""
        if piece.numel == 0:
            return torch.zeros(0)
        inner = math.prod(piece.box_sizes[1:])  # elements per row of the box
        first, last = piece.flat_start // inner, -(-piece.flat_end // inner)
        rows = slice(piece.box_offsets[0] + first, piece.box_offsets[0] + last)
        rest = tuple(slice(o, o + s) for o, s in zip(piece.box_offsets[1:], piece.box_sizes[1:]))
        block = self._rows(name, rows)[(slice(None), *rest)]  # (rows, *box)
        start = piece.flat_start - first * inner
        return block.reshape(-1)[start : start + piece.numel].float()

    def _rows(self, name: str, rows: slice) -> torch.Tensor:
        """Rows ``rows`` of stored tensor ``name``: one read of their bytes."""
        entry, file = self._entry(name), self._file(name)
        shape, dtype = entry["shape"], entry["dtype"]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        start = self._header(file)[1] + entry["data_offsets"][0] + rows.start * row_bytes
        data = bytearray((rows.stop - rows.start) * row_bytes)
        with (self.directory / file).open("rb") as f:
            f.seek(start)
            if f.readinto(data) != len(data):
                raise ValueError(f"--init-from {self.directory / file}: {name} is cut short")
        if not data:
            return torch.zeros(0, *shape[1:], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).view(-1, *shape[1:])
