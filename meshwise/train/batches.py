"""What a rank feeds one step: its micro-batches of the global batch, and the loss's divisor.

Every rank draws the whole global batch (``meshwise.data.batches``), takes its
dp rank's contiguous rows, cuts them into micro-batches and each into its cp
rank's tokens (inputs and targets alike). Targets outside the loss's labels
become the ignored index, and the step's divisor is the number of labelled
targets of the GLOBAL batch, counted on the host from the batch every rank
holds: no collective, and every layout divides by the same number (DESIGN
section 1). Under document masking the rank's rows' documents go to the
model's ``DocumentContext``, so every pipeline stage, tp and cp rank knows the
documents of the tokens it computes without a message.
"""

from __future__ import annotations

import numpy as np
import torch

from meshwise.apply.documents import apply_document_mask
from meshwise.comm.devices import host_to_device
from meshwise.data.batches import BatchSource
from meshwise.data.dataset import rank_slice
from meshwise.data.packing import documents_from_starts
from meshwise.mesh import Mesh
from meshwise.models.documents import DocumentContext
from meshwise.models.dropout import DropoutContext
from meshwise.train.sequence import SequenceSplit


class StepBatches:
    """This rank's share of each global batch of ``source`` (a ``BatchSource``).
    ``documents``: the ``DocumentContext`` the model's attention and positions read
    (under document masking, else None)."""

    def __init__(self, source: BatchSource, mesh: Mesh, sequence: SequenceSplit,
                 dropout: DropoutContext, device):
        self.source, self.mesh, self.sequence = source, mesh, sequence
        self.dropout, self.device = dropout, device
        self.documents = DocumentContext(dropout) if source.document_mask else None

    def mask_documents_of(self, chunks) -> None:
        """Under document masking, hand the model's positions and attention the documents
        (``meshwise.apply.documents``)."""
        if self.documents is not None:
            apply_document_mask(chunks, self.documents)

    def take(self, step: int, batch_size: int, seed: int, num: int,
             split: str = "train") -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """``num`` micro-batches ``(inputs, targets)`` of this rank's rows of global batch
        ``step``, and the labelled targets of the whole global batch. Points the dropout
        (and document) context at the rank's first sample."""
        batch = self.source.batch(step, batch_size, seed, split)
        dp_rank, dp = self.mesh.dp_rank, self.mesh.dims.dp
        rows = batch_size // dp
        tokens = rank_slice(batch.tokens, dp_rank, dp)
        both = torch.cat([tokens[:, :-1], rank_slice(batch.targets(), dp_rank, dp)])
        inputs, targets = host_to_device(both, both.dtype, self.device).split(rows)
        if self.documents is not None:
            starts = rank_slice(batch.starts, dp_rank, dp)
            self.documents.set(documents_from_starts(starts), dp_rank * rows, rows // num,
                               self.device)
        self.dropout.at(step, dp_rank * rows)
        return [(self.sequence.mine(x), self.sequence.mine(y))
                for x, y in zip(inputs.chunk(num), targets.chunk(num))], batch.num_labelled

    def sample_prompt(self, seed: int, length: int) -> torch.Tensor:
        """A held-out prompt of up to ``length`` tokens; under document masking only its
        last document (what its last token sees), and the documents are put away: a
        sample is one document."""
        batch = self.source.batch(0, 1, seed, "val")
        prompt = batch.tokens[0, :length]
        if batch.starts is not None:
            begins = np.flatnonzero(batch.starts[0, :len(prompt)])
            prompt = prompt[int(begins[-1]) if len(begins) else 0:]
        if self.documents is not None:
            self.documents.set(None, 0, 0, self.device)
        return prompt
