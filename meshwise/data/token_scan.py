"""Scans of a token file's ids: its largest id, and whether its dtype is settled.

One chunked pass over a memory map, cached on path, size and mtime. Read as uint16, a
uint32 file of ids below 2**20 shows every other id small and mostly zero; such a file
without a sidecar is ambiguous and needs ``--token-dtype`` (docs/data.md).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

SCAN_CHUNK = 1 << 24  # ids per chunk
_HIGH_HALF_LIMIT = 16  # uint32 ids below 2**20 have high halves below this


@lru_cache(maxsize=16)
def max_token(path: str, size: int, mtime_ns: int, dtype: str) -> int:
    """The largest id of the token file ``path`` of ``dtype`` (``"<u2"`` or ``"<u4"``);
    ``size`` and ``mtime_ns`` key the cache."""
    tokens = np.memmap(path, dtype=dtype, mode="r")
    largest = 0
    for start in range(0, len(tokens), SCAN_CHUNK):
        largest = max(largest, int(tokens[start : start + SCAN_CHUNK].max()))
    return largest


@lru_cache(maxsize=16)
def uint32_share(path: str, size: int, mtime_ns: int) -> float:
    """How strongly the file reads as uint32: the share of its uint16 odd positions that
    are zero when they are all small and more often zero than the even ones, else 0."""
    if size % 4:
        return 0.0
    halves = np.memmap(path, dtype="<u2", mode="r")
    zero_low = zero_high = 0
    high_max = 0
    for start in range(0, len(halves), 2 * SCAN_CHUNK):
        chunk = halves[start : start + 2 * SCAN_CHUNK].reshape(-1, 2)  # (pairs, [low, high])
        high_max = max(high_max, int(chunk[:, 1].max()))
        if high_max >= _HIGH_HALF_LIMIT:
            return 0.0  # ids of 2**20 and more: not a tokenizer's
        zero_low += int(np.count_nonzero(chunk[:, 0] == 0))
        zero_high += int(np.count_nonzero(chunk[:, 1] == 0))
    pairs = len(halves) // 2
    share = zero_high / pairs
    return share if share >= 0.5 and zero_high >= 2 * zero_low else 0.0
