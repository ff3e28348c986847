"""What a global batch carries: tokens, ``labels`` (the targets in the loss) and ``starts``
(the inputs that begin a document), as host arrays so nothing decided from them reads a
device; chat rows packed from whole conversations (``PackedRows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshwise.geometry.documents import Documents

LOSS_ON = ("assistant", "all")
LONG_CONVERSATIONS = ("truncate", "refuse")
PAD_ID = 0  # the input at a padding position: any id (it has no label, nothing sees it)


IGNORE = -100  # the target the loss skips (PyTorch's ignore_index)


@dataclass
class Batch:
    """A global batch: ``tokens`` (B, T + 1) int64 tensor; ``labels`` and ``starts``
    (B, T) bool host arrays, or None."""

    tokens: torch.Tensor
    labels: np.ndarray | None = None
    starts: np.ndarray | None = None

    @property
    def num_labelled(self) -> int:
        """Targets in the loss, counted on the host."""
        if self.labels is None:
            return self.tokens.shape[0] * (self.tokens.shape[1] - 1)
        return int(self.labels.sum())

    def targets(self) -> torch.Tensor:
        """(B, T) targets, ``IGNORE`` where unlabelled (the loss skips them)."""
        targets = self.tokens[:, 1:]
        if self.labels is None:
            return targets
        return targets.masked_fill(~torch.from_numpy(self.labels), IGNORE)


def documents_from_starts(starts: np.ndarray) -> Documents[np.ndarray]:
    """The documents (host arrays) of sequences whose documents begin where ``starts``
    (B, T) is true (and at every row's first token, marked or not)."""
    starts = starts.copy()
    starts[:, 0] = True
    index = np.broadcast_to(np.arange(starts.shape[1]), starts.shape)
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return Documents(np.cumsum(starts, axis=1, dtype=np.int64), index - first)


def separator_starts(inputs: np.ndarray, separator: int) -> np.ndarray:
    """(B, T) bool: the inputs right after an end-of-text ``separator`` begin a document
    (the separator ends the one before it)."""
    starts = np.zeros(inputs.shape, dtype=bool)
    starts[:, 1:] = inputs[:, :-1] == separator
    return starts


class PackedRows:
    """Whole conversations packed into rows of ``width`` tokens, in file order.

    ``starts``: each conversation's first token in the file; ``num_tokens``: the file's.
    Row ``r`` is tokens ``[row_start[r], row_start[r] + row_len[r])``, then padding. A longer
    conversation is cut (``truncated``, ``dropped_tokens``), or ``too_long`` names it.
    """

    def __init__(self, starts: np.ndarray, num_tokens: int, width: int):
        lengths = np.diff(np.append(starts, num_tokens))
        self.width = width
        cut = np.minimum(lengths, width)
        self.truncated = int((lengths > width).sum())
        self.dropped_tokens = int((lengths - cut).sum())
        self.too_long = int(np.argmax(lengths > width)) if self.truncated else None
        row_start: list[int] = []
        row_len: list[int] = []
        for start, length in zip(starts.tolist(), cut.tolist()):
            if row_len and row_len[-1] + length <= width:
                row_len[-1] += length  # conversations are contiguous in the file
            else:
                row_start.append(start)
                row_len.append(length)
        self.row_start = np.asarray(row_start, dtype=np.int64)
        self.row_len = np.asarray(row_len, dtype=np.int64)
        self.conversation_starts = starts

    def __len__(self) -> int:
        return len(self.row_start)

    def labelled_per_row(self, labels: np.ndarray) -> np.ndarray:
        """The assistant targets each row keeps (labels nonzero, a conversation's first
        token excepted): what ``batch`` labels with ``loss_on`` assistant, per row."""
        marked = np.append(np.asarray(labels) != 0, False)  # a sentinel past the end
        marked[self.conversation_starts] = False
        bounds = np.stack([self.row_start, self.row_start + self.row_len], axis=1).ravel()
        return np.add.reduceat(marked.astype(np.int64), bounds)[::2]

    @property
    def padding_share(self) -> float:
        return 1.0 - float(self.row_len.sum()) / (len(self) * self.width)

    def batch(
        self,
        rows: np.ndarray,
        tokens: np.ndarray,
        labels: np.ndarray,
        loss_on: str,
        document_mask: bool,
    ) -> Batch:
        """The global batch of rows ``rows``: tokens, labels (assistant tokens, or every
        real target; never a conversation's first token, which no conversation of its
        own predicts) and, with ``document_mask``, the conversations' starts."""
        B, width = len(rows), self.width
        out = np.full((B, width), PAD_ID, dtype=np.int64)
        label = np.zeros((B, width), dtype=bool)
        begins = np.zeros((B, width), dtype=bool)
        for i, row in enumerate(rows.tolist()):
            start, length = int(self.row_start[row]), int(self.row_len[row])
            out[i, :length] = tokens[start : start + length]
            label[i, :length] = (
                labels[start : start + length] != 0 if loss_on == "assistant" else True
            )
            first = np.searchsorted(self.conversation_starts, start)
            last = np.searchsorted(self.conversation_starts, start + length)
            begins[i, self.conversation_starts[first:last] - start] = True
            begins[i, length : length + 1] = True  # the padding: a document of its own
        label &= ~begins  # a conversation's first token is no target
        return Batch(torch.from_numpy(out), label[:, 1:], begins[:, :-1] if document_mask else None)
