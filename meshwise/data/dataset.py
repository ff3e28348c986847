"""Token files and deterministic global batches: ``TokenDataset`` memory-maps the file
``resolve_data`` built, and global batch ``step`` is a pure function of (seed, step), so
any layout and a resumed run read the same batches.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

# Re-exported: building and finding token files is part of this module's interface.
from meshwise.data.order import window_offsets
from meshwise.data.sources import build_with_progress, default_cache_dir, resolve_data  # noqa: F401

# Re-exported: the token-file format is part of this module's interface.
from meshwise.data.token_files import (  # noqa: F401
    ACCEPTED,
    BYTE_VOCAB_SIZE,
    TOKEN_DTYPE,
    largest_id,
    read_meta,
    recorded_tokenizer,
    resolve_vocab_size,
    sidecar_path,
)
from meshwise.data.token_files import token_dtype as dtype_of

logger = logging.getLogger("meshwise")

SPLITS = {"train": 0, "val": 1}
VAL_MIN_SEQUENCES = 4  # the validation split holds at least this many windows


Rows = TypeVar("Rows", torch.Tensor, np.ndarray)  # a batch as a tensor, or a host array


def rank_slice(batch: Rows, rank: int, num_ranks: int) -> Rows:
    """Rows ``[rank * B/num_ranks, (rank + 1) * B/num_ranks)`` of a global batch (a view)."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
    if batch.shape[0] % num_ranks:
        raise ValueError(f"batch size {batch.shape[0]} is not divisible by {num_ranks} ranks")
    rows = batch.shape[0] // num_ranks
    return batch[rank * rows : (rank + 1) * rows]


class TokenDataset:
    """Windows of ``seq_len + 1`` tokens from a memory-mapped token file, in ``data_order``
    (validation: random windows); ``token_dtype`` for a file without a sidecar.

    The last ``val_fraction`` of the tokens (at least ``VAL_MIN_SEQUENCES`` windows; none
    at 0) is the validation split, which no train window overlaps. Opening is cheap, and
    pickling reopens the file instead of copying it.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        val_fraction: float = 0.01,
        vocab_size: int = 0,
        token_dtype: str | None = None,
        data_order: str = "random-windows",
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.path = Path(path)
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        self.data_order = data_order  # of the train split (meshwise.data.order)
        meta = read_meta(self.path, token_dtype)
        # Every load checks the largest id against the vocabulary (a cached scan):
        # an id past it would train on garbage under some layouts and crash others.
        meta = {**meta, "max_token": largest_id(self.path, meta)}
        self.vocab_size: int = resolve_vocab_size(meta, vocab_size, self.path)
        self.dtype = dtype_of(meta)
        self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        window = seq_len + 1
        num_tokens = len(self._tokens)
        num_val = 0
        if val_fraction > 0:
            num_val = max(int(num_tokens * val_fraction), VAL_MIN_SEQUENCES * window)
        self.num_train_tokens = num_tokens - num_val
        self.num_val_tokens = num_val
        if self.num_train_tokens < window:
            need = window + (VAL_MIN_SEQUENCES * window if val_fraction > 0 else 0)
            raise ValueError(
                f"the corpus {meta.get('source') or str(self.path)!r} has {num_tokens} tokens; "
                f"--seq-len {seq_len} needs at least {need} ({VAL_MIN_SEQUENCES} held-out "
                f"windows and one training window of seq_len + 1 tokens)"
            )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_tokens"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")

    def _split_range(self, split: str) -> tuple[int, int]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
        if split == "train":
            return 0, self.num_train_tokens
        if self.num_val_tokens == 0:
            raise ValueError("no validation split: this dataset has val_fraction=0")
        return self.num_train_tokens, self.num_train_tokens + self.num_val_tokens

    def window_starts(
        self, step: int, batch_size: int, seed: int, split: str = "train"
    ) -> np.ndarray:
        """Token offsets of the ``batch_size`` windows of global batch ``step``."""
        for name, value in (("step", step), ("seed", seed)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        lo, hi = self._split_range(split)
        order = self.data_order if split == "train" else "random-windows"
        return lo + window_offsets(
            order, step, batch_size, seed, SPLITS[split], hi - lo, self.seq_len
        )

    def global_batch(
        self, step: int, batch_size: int, seed: int, split: str = "train"
    ) -> torch.Tensor:
        """Global batch ``step`` as an int64 tensor of shape (batch_size, seq_len + 1).

        Inputs are ``batch[:, :-1]`` and targets ``batch[:, 1:]``. Only the chosen
        windows are read from the memmap.
        """
        return torch.from_numpy(self.global_windows(step, batch_size, seed, split))

    def global_windows(
        self, step: int, batch_size: int, seed: int, split: str = "train"
    ) -> np.ndarray:
        """``global_batch`` as a host array (int64)."""
        starts = self.window_starts(step, batch_size, seed, split)
        window = self.seq_len + 1
        rows = np.empty((batch_size, window), dtype=np.int64)  # (B, T + 1)
        for row, start in enumerate(starts):
            rows[row] = self._tokens[start : start + window]
        return rows
