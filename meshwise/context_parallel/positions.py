"""The positions of a context-parallel rank's tokens (the ``positions`` style of a plan)."""

from __future__ import annotations

import torch

from meshwise.layout.sequence import zigzag_positions
from meshwise.models.attention import Positions


class ZigzagPositions(Positions):
    """Global positions of the two zigzag chunks this cp rank holds of each sequence
    (``meshwise.layout.sequence``): learned positions and rotary angles are
    looked up at them (under document masking, at their places in their
    documents)."""

    def __init__(self, cp_rank: int, cp_size: int):
        super().__init__()
        self.cp_rank, self.cp_size = cp_rank, cp_size

    @classmethod
    def from_positions(cls, module: Positions, cp_group) -> "ZigzagPositions":
        swapped = cls(cp_group.rank, cp_group.size)
        swapped.documents = module.documents
        return swapped

    def held(self, start: int, length: int, device) -> torch.Tensor:
        if start:
            raise ValueError("a context-parallel forward holds chunks of whole sequences "
                             "from position 0; decoding after a KV cache runs at cp 1")
        return zigzag_positions(length, self.cp_rank, self.cp_size, device)  # (T / cp,)

    def extra_repr(self) -> str:
        return f"cp_rank={self.cp_rank}, cp_size={self.cp_size}"
