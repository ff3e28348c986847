"""Which tokens of a sequence a rank holds (pure): cp rank ``r`` of ``N`` chunks ``r`` and
``2N - 1 - r`` of ``2N`` (Megatron-LM's and Llama 3's zigzag, Meta 2024, section 3.3.2),
split again over tp under ``--sp`` (Korthikanti et al. 2022). The one place the split is
worked out: batches, positions, dropout keys and the ring's blocks all ask it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def zigzag_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 cp_size``) that cp rank ``cp_rank`` holds, in order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_positions(local_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens cp rank ``cp_rank`` holds (int64)."""
    if cp_size == 1:
        return torch.arange(local_len, device=device)
    if local_len % 2:
        raise ValueError(
            f"a context-parallel rank holds two equal chunks; {local_len} tokens "
            "do not split in two"
        )
    chunk = local_len // 2
    first, second = zigzag_chunks(cp_rank, cp_size)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def zigzag_slice(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The tokens of ``x`` (whole sequences along ``dim``) that cp rank ``cp_rank`` holds."""
    if cp_size == 1:
        return x
    length = x.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(f"{length} tokens do not split into 2 x cp = {2 * cp_size} chunks")
    chunk = length // (2 * cp_size)
    first, second = zigzag_chunks(cp_rank, cp_size)
    return torch.cat(
        [x.narrow(dim, first * chunk, chunk), x.narrow(dim, second * chunk, chunk)], dim=dim
    )


def position_owner(position: int, seq_len: int, cp_size: int) -> tuple[int, int]:
    """``(cp_rank, local index)`` of global ``position`` in a sequence of ``seq_len``."""
    if cp_size == 1:
        return 0, position
    chunk = seq_len // (2 * cp_size)
    index = position // chunk
    if index < cp_size:
        return index, position - index * chunk
    return 2 * cp_size - 1 - index, chunk + position - index * chunk


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def sequence_run(x: torch.Tensor, dim: int, sp_rank: int, sp_size: int) -> torch.Tensor:
    """Sequence parallelism's run of ``x`` along ``dim`` (a rank's tokens in their local
    order): the ``sp_rank``-th of ``sp_size`` contiguous runs."""
    length = x.shape[dim] // sp_size
    return x.narrow(dim, sp_rank * length, length)


@dataclass(frozen=True)
class SequenceShard:
    """The part of every sequence one rank holds: cp rank and size (zigzag chunks), and
    with sequence parallelism its tp rank and size (``sp_size`` 1: no split)."""

    cp_rank: int = 0
    cp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1

    @property
    def tokens_divisor(self) -> int:
        """What a sequence's length must be a multiple of for this layout: 2 x cp zigzag
        chunks, and each cp rank's tokens in ``sp_size`` runs."""
        chunks = 2 * self.cp_size if self.cp_size > 1 else 1
        return math.lcm(chunks, self.cp_size * self.sp_size)

    def cut(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The tokens of ``x`` (whole sequences along ``dim``) this rank is fed: its cp
        chunks (sequence parallelism splits them inside the model)."""
        return zigzag_slice(x, dim, self.cp_rank, self.cp_size)

    def padded(self, window: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``window`` (B, n) padded after its end to a length this layout splits, and its
        length: under the causal mask no token sees the padding, so the real tokens'
        logits are those of the unpadded window."""
        n = window.shape[1]
        length = padded_length(n, self.tokens_divisor)
        if length != n:
            window = torch.cat([window, window.new_zeros(window.shape[0], length - n)], dim=1)
        return window, length

    def local_positions(self, local_len: int, device=None) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens where the sequence is
        whole across tp (attention, the tensor-parallel layers)."""
        return zigzag_positions(local_len, self.cp_rank, self.cp_size, device)

    def stream_positions(self, stream_len: int, device=None) -> torch.Tensor:
        """Global positions of the ``stream_len`` tokens this rank holds between the
        tensor-parallel layers (the residual stream: its sp run of the local ones)."""
        local = self.local_positions(stream_len * self.sp_size, device)
        return sequence_run(local, 0, self.sp_rank, self.sp_size)
