"""A Hugging Face weights folder (``model.safetensors`` or an index of shards), read slice
by slice: checking reads only headers, and a ``Piece`` asks ``get_slice`` for just its rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from meshwise.geometry.pieces import Piece

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


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
        self._open: dict[str, object] = {}

    def _file(self, name: str) -> str:
        if self.weight_map is None:
            return SINGLE
        if name not in self.weight_map:
            raise ValueError(f"--init-from {self.directory}: {INDEX} lists no tensor {name}")
        return self.weight_map[name]

    def _handle(self, file: str):
        if file not in self._open:
            from safetensors import safe_open

            path = self.directory / file
            if not path.is_file():
                raise ValueError(
                    f"--init-from {self.directory}: the shard {file} that {INDEX} names is missing"
                )
            try:
                self._open[file] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise ValueError(
                    f"--init-from {path}: not a readable safetensors file ({exc})"
                ) from None
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (from its file's header)."""
        handle = self._handle(self._file(name))
        if name not in handle.keys():
            raise ValueError(
                f"--init-from {self.directory}: no tensor {name} in {self._file(name)}"
            )
        return tuple(handle.get_slice(name).get_shape())

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
        return name in self._handle(SINGLE).keys()

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
        block = self._handle(self._file(name)).get_slice(name)[(rows, *rest)]  # (rows, *box)
        start = piece.flat_start - first * inner
        return block.reshape(-1)[start : start + piece.numel].float()
