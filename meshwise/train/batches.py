"""What a rank feeds one step: its micro-batches of the global batch with their contexts,
and the loss's divisor, the labelled targets of the GLOBAL batch counted on the host
from the batch every rank draws (no collective; DESIGN section 1).
"""

from __future__ import annotations

import numpy as np
import torch

from meshwise.context_parallel.ring import RingAttention
from meshwise.data.batches import BatchSource
from meshwise.data.dataset import rank_slice
from meshwise.data.packing import documents_from_starts
from meshwise.device.clocks import host_to_device
from meshwise.geometry.sequence import SequenceShard
from meshwise.mesh import Mesh
from meshwise.models.attention import Positions, ScaledDotProductAttention
from meshwise.models.attention_masks import DocumentMask
from meshwise.models.context import ForwardContext, takes_context


def rank_tokens(mesh: Mesh, sequence_parallel: bool) -> SequenceShard:
    """The part of every sequence this rank holds (its cp chunks; with ``--sp`` its run
    of them between the tensor-parallel layers)."""
    dims = mesh.dims
    sp_rank, sp_size = (mesh.tp_rank, dims.tp) if sequence_parallel else (0, 1)
    return SequenceShard(mesh.cp_rank, dims.cp, sp_rank, sp_size)


class StepBatches:
    """This rank's share of each global batch of ``source`` (a ``BatchSource``), and the
    context of each micro-batch's forward (``feed`` says whether the model takes it)."""

    def __init__(self, source: BatchSource, mesh: Mesh, sequence_parallel: bool, device):
        self.source, self.mesh, self.device = source, mesh, device
        self.tokens = rank_tokens(mesh, sequence_parallel)
        self.with_context = True

    def feed(self, chunks) -> None:
        """Contexts go to ``chunks`` when their forward takes ``context=`` (a model of one's
        own may not); ValueError under document masking when the documents could not
        reach the model's attention and positions."""
        self.with_context = takes_context(chunks[0])
        if self.source.document_mask:
            _check_documents_reach(chunks, self.with_context)

    def take(self, step: int, batch_size: int, seed: int, num: int, split: str = "train"):
        """``num`` micro-batches ``(inputs, targets)`` of this rank's rows of global batch
        ``step``, the ``ForwardContext`` of each (None where the model takes none), and
        the labelled targets of the whole global batch."""
        batch = self.source.batch(step, batch_size, seed, split)
        dp_rank, dp = self.mesh.dp_rank, self.mesh.dims.dp
        rows = batch_size // dp
        tokens = rank_slice(batch.tokens, dp_rank, dp)
        both = torch.cat([tokens[:, :-1], rank_slice(batch.targets(), dp_rank, dp)])
        inputs, targets = host_to_device(both, both.dtype, self.device).split(rows)
        micro_batches = [
            (self.tokens.cut(x), self.tokens.cut(y))
            for x, y in zip(inputs.chunk(num), targets.chunk(num))
        ]
        if not self.with_context:
            return micro_batches, [None] * num, batch.num_labelled
        starts = None
        if self.source.document_mask and batch.starts is not None:  # always, when masking
            starts = rank_slice(batch.starts, dp_rank, dp)
        contexts = self._contexts(step, seed, dp_rank * rows, rows // num, num, starts)
        return micro_batches, contexts, batch.num_labelled

    def _contexts(
        self, step: int, seed: int, first: int, rows: int, num: int, starts: np.ndarray | None
    ) -> list[ForwardContext]:
        """The contexts of ``num`` micro-batches of ``rows`` sequences each, from global
        sample ``first``; ``starts``: where their documents begin, or None."""
        documents: list[DocumentMask | None] = [None] * num
        if starts is not None:
            host = documents_from_starts(starts)
            on_device = host.to(self.device)  # one copy for the step; rows are views of it
            documents = [
                DocumentMask.of(host.rows(m * rows, rows), on_device.rows(m * rows, rows))
                for m in range(num)
            ]
        return [
            ForwardContext(
                seed, step, first + m * rows, self.tokens, self.mesh.tp_rank, documents[m]
            )
            for m in range(num)
        ]

    def sample_prompt(self, seed: int, length: int) -> torch.Tensor:
        """A held-out prompt of up to ``length`` tokens; under document masking only its
        last document (what its last token sees): a sample is one document."""
        batch = self.source.batch(0, 1, seed, "val")
        prompt = batch.tokens[0, :length]
        if batch.starts is not None:
            begins = np.flatnonzero(batch.starts[0, : len(prompt)])
            prompt = prompt[int(begins[-1]) if len(begins) else 0 :]
        return prompt


def _check_documents_reach(chunks, with_context: bool) -> None:
    """Document masking needs a forward that takes its context and hands it to meshwise's
    attention and positions (``meshwise.models.attention``, or their cp forms)."""
    modules = [m for chunk in chunks for m in chunk.modules()]
    attention = any(isinstance(m, (ScaledDotProductAttention, RingAttention)) for m in modules)
    positions = any(isinstance(m, Positions) for m in modules)
    if with_context and attention and positions:
        return
    missing = (
        "a forward that takes context= (and passes it to its attention and positions)"
        if not with_context
        else "ScaledDotProductAttention modules (the plan's ring_attention style)"
        if not attention
        else "a Positions module (the plan's positions style; one "
        "that is never called serves a model without positions)"
    )
    raise ValueError(
        "document masking needs the model's attention and positions to be "
        f"meshwise.models.attention modules reached by its forward's context; "
        f"this model has no {missing}"
    )
