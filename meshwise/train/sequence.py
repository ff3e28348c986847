"""The trainer's side of context and sequence parallelism: which tokens a rank feeds.

Under ``--cp N`` every micro-batch is cut along the sequence into its 2N zigzag
chunks and a cp rank feeds its two (``meshwise.layout.sequence``); its targets
are cut the same way, so each token keeps its own target and the sum of the
token losses over the cp ranks is the micro-batch's sum, counted once. The
learning signal is the global mean as on one process (DESIGN section 1):
every rank still divides by the tokens of the global batch.

A forward over a sequence whose length the layout cannot split (a sample
growing one token at a time) is padded after its end: under the causal mask
no token sees what comes after it, so the logits of the real tokens are those
of the unpadded sequence.
"""

from __future__ import annotations

import torch

from meshwise.comm import ops
from meshwise.layout.sequence import (SequenceShard, padded_length, position_owner,
                                      zigzag_slice)
from meshwise.mesh import Mesh


def sequence_shard(mesh: Mesh, sequence_parallel: bool) -> SequenceShard:
    """The part of every sequence this rank holds."""
    dims = mesh.dims
    sp_rank, sp_size = (mesh.tp_rank, dims.tp) if sequence_parallel else (0, 1)
    return SequenceShard(mesh.cp_rank, dims.cp, sp_rank, sp_size)


class SequenceSplit:
    """Cuts whole sequences into this rank's tokens, and finds a position's logits."""

    def __init__(self, mesh: Mesh, shard: SequenceShard, divisor: int):
        self.mesh, self.shard, self.divisor = mesh, shard, divisor

    def mine(self, tokens: torch.Tensor) -> torch.Tensor:
        """This cp rank's tokens of (B, T) whole sequences: (B, T / cp)."""
        return zigzag_slice(tokens, 1, self.shard.cp_rank, self.shard.cp_size)

    def padded_mine(self, window: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``window`` (1, n) padded after its end to a length the layout splits, and
        cut to this rank's tokens; with the padded length."""
        n = window.shape[1]
        length = padded_length(n, self.divisor)
        if length != n:
            window = torch.cat([window, window.new_zeros(window.shape[0], length - n)], dim=1)
        return self.mine(window), length

    def last_logits(self, logits: torch.Tensor | None, n: int, length: int,
                    vocab_size: int, device) -> torch.Tensor | None:
        """The logits (V,) at position ``n - 1`` of a padded forward of ``length`` tokens,
        on every rank that holds the model's head (``logits`` not None there): the cp
        rank holding that position hands them to its cp peers."""
        owner, index = position_owner(n - 1, length, self.shard.cp_size)
        if self.shard.cp_size == 1:
            return None if logits is None else logits[0, index]
        row = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if logits is not None and self.shard.cp_rank == owner:
            row.copy_(logits[0, index])
        ops.broadcast(row, owner, self.mesh.cp, category="sample")
        return None if logits is None else row
