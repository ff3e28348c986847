"""Which keys each query sees (causal, a sliding window as Beltagy et al. 2020 and Mistral,
documents), as boolean masks and as ``flex_attention`` ``BlockMask``s (Dong et al. 2024)
built block by block, never from the (T, T) mask; ``DocumentMask`` makes each once.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from meshwise.geometry.documents import Documents, additive_mask

BLOCK_SIZE = 128  # flex_attention's sparse block (queries and keys)


def window_mask(num_queries: int, num_keys: int, window: int, device):
    """Which keys each query sees under a sliding window: itself and the ``window - 1``
    before it, the queries being the last positions; None when the window covers
    every key. (T, P + T) bool."""
    if not window or num_keys <= window:
        return None
    first = num_keys - num_queries  # the queries are the last positions
    positions = torch.arange(num_keys, device=device)
    return keys_seen(positions[first:], positions, window)[0, 0]


def keys_seen(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    window: int = 0,
    documents: Documents[torch.Tensor] | None = None,
) -> torch.Tensor:
    """(B or 1, 1, Lq, Lk) bool: the keys at ``k_positions`` (Lk,) that the queries at
    ``q_positions`` (Lq,) see: at or before them, inside ``window`` (0: no window)
    and, with ``documents``, in their own document."""
    before = k_positions[None, :] <= q_positions[:, None]  # (Lq, Lk)
    if window:
        before = before & (q_positions[:, None] - k_positions[None, :] < window)
    if documents is None:
        return before[None, None]
    return documents.allowed(q_positions, k_positions, causal=False) & before


def mask_mod(window: int = 0, ids: torch.Tensor | None = None):
    """The same rule as ``keys_seen`` for ``flex_attention``, one (query, key) pair at a time.
    ``ids``: (B, T) document ids, or None."""

    def seen(b, h, q, k):
        allowed = k <= q
        if window:
            allowed = allowed & (q - k < window)
        if ids is not None:
            allowed = allowed & (ids[b, q] == ids[b, k])
        return allowed

    return seen


def block_mask(
    length: int,
    window: int = 0,
    ids: torch.Tensor | None = None,
    block_size: int = BLOCK_SIZE,
    device=None,
):
    """The ``BlockMask`` of causal attention over ``length`` tokens with a ``window``
    (0: none) and, with ``ids`` ((B, T) document ids, never decreasing along a
    row), inside each document; without ids its batch dim broadcasts."""
    from torch.nn.attention.flex_attention import BlockMask

    device = ids.device if ids is not None else device
    num_blocks = math.ceil(length / block_size)
    first = torch.arange(num_blocks, device=device) * block_size  # each block's first position
    last = (first + block_size - 1).clamp(max=length - 1)
    whole = first + block_size <= length  # no padding past the sequence in it
    q_first, q_last, k_first, k_last = first[:, None], last[:, None], first[None], last[None]
    some = k_first <= q_last  # (nq, nk): a key at or before a query
    every = (k_last <= q_first) & whole[:, None] & whole[None, :]  # every key before every query
    if window:  # some pair, or every pair, less than the window apart
        some = some & (q_first - k_last < window)
        every = every & (q_last - k_first < window)
    some, every = some[None], every[None]  # (1, nq, nk)
    if ids is not None:
        low, high = _id_range(ids, num_blocks, block_size)  # (B, n) each
        # Ids never decrease, so two blocks share a document when their id ranges
        # meet, and hold one document only when both ranges are that one id. With
        # the causal mask and the window this is exact: a shared document's closest
        # pair is the query block's first token and the key block's last.
        some = some & (low[:, :, None] <= high[:, None, :]) & (low[:, None, :] <= high[:, :, None])
        every = (
            every & (low[:, :, None] == high[:, None, :]) & (high[:, :, None] == low[:, None, :])
        )
    partial = some & ~every
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(every),
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod(window, ids),
        seq_lengths=(length, length),
    )


def _id_range(ids: torch.Tensor, num_blocks: int, block_size: int):
    """Smallest and largest document id of each block of each row ((B, n) each); the
    last block's padding repeats the row's last id."""
    pad = num_blocks * block_size - ids.shape[1]
    padded = torch.cat([ids, ids[:, -1:].expand(-1, pad)], dim=1)
    blocks = padded.view(ids.shape[0], num_blocks, block_size)  # (B, n, block)
    return blocks.amin(-1), blocks.amax(-1)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) of each query block's key blocks, as ``BlockMask`` stores them:
    (B, 1, nq) and (B, 1, nq, nk) int32, the listed blocks first, in order."""
    dense = dense[:, None].to(torch.int32)  # (B, 1, nq, nk): the head dim broadcasts
    count = dense.sum(-1).to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count.contiguous(), indices.contiguous()


@functools.lru_cache(maxsize=16)
def window_block_mask(length: int, window: int, device: torch.device, block_size: int = BLOCK_SIZE):
    """``block_mask`` of a sliding window alone, made once per shape and device."""
    return block_mask(length, window, None, block_size, device)


class DocumentMask:
    """The documents of one forward's whole sequences, as attention and positions read them.

    ``documents``: ids and positions on the device (never read on the host); ``lengths``:
    each row's document lengths as host integers, or None; ``host_ids``: the ids as a host
    array, or None (for the ring's skipped blocks). Masks made from them are shared by
    every layer and by the recompute under activation checkpointing.
    """

    def __init__(
        self,
        documents: Documents[torch.Tensor],
        lengths: list[list[int]] | None = None,
        host_ids=None,
    ):
        self.documents, self.lengths, self.host_ids = documents, lengths, host_ids
        self._made: dict = {}

    @classmethod
    def of(cls, host: Documents[np.ndarray], on_device: Documents[torch.Tensor]) -> DocumentMask:
        """The same documents as host arrays and on the device (rows of a copy made once
        per step): the lengths and ids a host decision reads come from the first."""
        return cls(on_device, document_lengths(host.ids), host.ids)

    def positions(self, held: torch.Tensor) -> torch.Tensor:
        """(B, T) each token's place in its document, for the tokens at global positions
        ``held`` (T,)."""
        return self.documents.positions[:, held]

    def seen(self, q_positions, k_positions, window: int = 0) -> torch.Tensor:
        """(B, 1, Lq, Lk) bool: ``keys_seen`` inside the documents."""
        return keys_seen(q_positions, k_positions, window, self.documents)

    def additive(self, length: int, window: int, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, T, T) additive mask of whole sequences (the explicit weights' form)."""

        def make():
            positions = torch.arange(length, device=self.documents.ids.device)
            return additive_mask(self.seen(positions, positions, window), dtype)

        return self._once(("additive", length, window, dtype), make)

    def block_mask(self, length: int, window: int = 0, block_size: int = BLOCK_SIZE):
        """``block_mask`` of these documents (and a window)."""
        return self._once(
            ("block", length, window, block_size),
            lambda: block_mask(length, window, self.documents.ids, block_size),
        )

    def _once(self, key, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


def document_lengths(ids) -> list[list[int]]:
    """Each row's document lengths, in order, from (B, T) ids on the host (numpy)."""
    return [
        np.diff(np.append(np.flatnonzero(np.diff(row, prepend=-1)), len(row))).tolist()
        for row in ids
    ]
