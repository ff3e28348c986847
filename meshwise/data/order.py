"""Which windows global batch ``step`` reads, a pure function of (seed, step): random
windows, or every window once per epoch in a permutation computed per index (a Feistel
network with cycle walking, Black & Rogaway 2002), nothing stored. See docs/data.md.
"""

from __future__ import annotations

import numpy as np

DATA_ORDERS = ("random-windows", "epochs")
_ROUNDS = 4
_EPOCH_KEY = 0x65706F6368  # keeps an epoch's keys apart from the batches' streams


def window_offsets(
    order: str, step: int, batch_size: int, seed: int, split_id: int, num_tokens: int, seq_len: int
) -> np.ndarray:
    """Offsets in the split (of ``num_tokens`` tokens) of global batch ``step``'s
    ``batch_size`` windows of ``seq_len + 1`` tokens."""
    if order == "random-windows":
        rng = np.random.default_rng([seed, step, split_id])
        # A window [s, s + seq_len] must end inside the split: s <= num_tokens - seq_len - 1.
        return rng.integers(0, num_tokens - seq_len, size=batch_size)
    if order != "epochs":
        raise ValueError(f"data order {order!r} is not valid; valid: {', '.join(DATA_ORDERS)}")
    if step < 1:
        raise ValueError(f"step must be >= 1 for --data-order epochs (1-based), got {step}")
    count = num_windows(num_tokens, seq_len)
    # The p-th window of the run is window permuted(p mod count) of epoch p // count, so
    # a batch may straddle two epochs.
    positions = (step - 1) * batch_size + np.arange(batch_size, dtype=np.int64)
    epochs, index = np.divmod(positions, count)
    windows = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        mine = epochs == epoch
        windows[mine] = permuted(index[mine], count, seed, int(epoch))
    return windows * seq_len


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Whole windows of ``seq_len + 1`` tokens at a stride of ``seq_len``."""
    return (num_tokens - 1) // seq_len


def epoch_position(step: int, batch_size: int, num_tokens: int, seq_len: int) -> dict:
    """Where the run is after global batch ``step``: ``epoch`` (1-based, of its last
    window) and ``epoch_windows`` (windows of that epoch read so far, of
    ``windows_per_epoch``)."""
    count = num_windows(num_tokens, seq_len)
    epoch, done = divmod(step * batch_size - 1, count)
    return {"epoch": epoch + 1, "epoch_windows": done + 1, "windows_per_epoch": count}


def permuted(index: np.ndarray, count: int, seed: int, epoch: int) -> np.ndarray:
    """Where each of ``index`` (in ``[0, count)``) goes in epoch ``epoch``'s permutation."""
    half_bits = max(1, (int(count - 1).bit_length() + 1) // 2)
    keys = np.random.default_rng([seed, epoch, _EPOCH_KEY]).integers(
        0, 2**63, size=_ROUNDS, dtype=np.uint64
    )
    out = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(out.shape, dtype=bool)  # cycle-walk until inside [0, count)
    while todo.any():
        out[todo] = _feistel(out[todo], half_bits, keys)
        todo = out >= count
    return out.astype(np.int64)


def _feistel(x: np.ndarray, half_bits: int, keys: np.ndarray) -> np.ndarray:
    """A bijection of ``[0, 4**half_bits)``: ``_ROUNDS`` rounds on the two halves."""
    mask = np.uint64((1 << half_bits) - 1)
    left, right = x >> np.uint64(half_bits), x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << np.uint64(half_bits)) | right


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele et al. 2014): every input bit reaches every output
    bit. Arithmetic wraps modulo 2**64, as intended."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
