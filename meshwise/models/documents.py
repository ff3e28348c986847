"""Which documents the sequences of a forward hold (document masking, ``--document-mask``).

Attention and positions read them here rather than from their inputs: a
pipeline stage receives hidden states only, and every rank has the whole
global batch anyway (``meshwise.train.batches``), so each rank knows the
documents of every token it computes without a message. The trainer sets this
rank's rows of the step's batch once (``set``); which of them a forward holds
comes from the ``DropoutContext`` the trainer points at each forward's samples
(``at(step, first_sample)``), the one activation checkpointing restores for a
recompute, so a block recomputed in a pipeline's backward reads its own
micro-batch's documents, not the last forward's.
"""

from __future__ import annotations

import numpy as np
import torch

from meshwise.layout.documents import Documents, additive_mask
from meshwise.models.attention_masks import DocumentMask
from meshwise.models.dropout import DropoutContext


class DocumentContext:
    """The documents of this rank's rows of the batch being computed.

    ``where``: the rank's ``DropoutContext`` (its ``first_sample`` is the global
    index of a forward's first sequence). One per rank, shared by every copy of
    the model (pipeline chunks), like the dropout context.
    """

    def __init__(self, where: DropoutContext):
        self.where = where
        self._device = self._host = None
        self._first = self._rows = 0
        self._mask_key = self._mask = self._lengths_key = self._lengths = None
        self._masks_key = self._masks = None

    def __deepcopy__(self, memo):
        return self

    def set(self, documents: Documents | None, first_sample: int, rows: int, device) -> None:
        """This rank's sequences of the batch (global samples ``first_sample ..``), whose
        forwards compute ``rows`` sequences each, as host arrays (kept for decisions
        that must not read the device) and copied to ``device``; ``None``: whole
        sequences, one document each (no masking)."""
        self._host = documents
        self._device = None if documents is None else documents.to(device)
        self._first, self._rows = first_sample, rows
        self._mask_key = self._mask = self._lengths_key = self._lengths = None
        self._masks_key = self._masks = None

    def _offset(self) -> int:
        offset = self.where.first_sample - self._first
        if not 0 <= offset < self._host.ids.shape[0]:
            raise RuntimeError(f"a forward of samples {self.where.first_sample}.. outside this "
                               f"rank's {self._first}..{self._first + self._host.ids.shape[0]}")
        return offset

    def current(self) -> Documents | None:
        """The documents of the forward now running (on the device), or None."""
        if self._device is None:
            return None
        return self._device.rows(self._offset(), self._rows)

    def current_on_host(self) -> Documents | None:
        """The same as host arrays, for decisions that must not wait for the device."""
        if self._host is None:
            return None
        return self._host.rows(self._offset(), self._rows)

    def lengths(self) -> list[list[int]] | None:
        """Each current sequence's document lengths, in order (host integers), or None;
        made once per forward."""
        documents = self.current_on_host()
        if documents is None:
            return None
        key = ("lengths", self.where.first_sample)
        if self._lengths_key != key:
            self._lengths = [np.diff(np.append(np.flatnonzero(np.diff(row, prepend=-1)),
                                               len(row))).tolist() for row in documents.ids]
            self._lengths_key = key
        return self._lengths

    def masks(self) -> DocumentMask | None:
        """The current forward's documents as attention kernels read them, or None: one
        ``DocumentMask`` per forward, shared by every layer, so each mask a kernel
        needs (a flex ``BlockMask``, an additive mask) is made once per forward."""
        documents = self.current()
        if documents is None:
            return None
        key = self.where.first_sample
        if self._masks_key != key:
            self._masks = DocumentMask(documents, self.lengths())
            self._masks_key = key
        return self._masks

    def attention_mask(self, length: int, dtype: torch.dtype) -> torch.Tensor | None:
        """(B, 1, T, T) additive mask of the current forward's whole sequences (for
        attention with dropout): made once per forward and dtype, shared by every
        layer."""
        documents = self.current()
        if documents is None:
            return None
        key = (self.where.first_sample, length, dtype)
        if self._mask_key != key:
            positions = torch.arange(length, device=documents.ids.device)
            self._mask = additive_mask(documents.allowed(positions, positions), dtype)
            self._mask_key = key
        return self._mask
