"""What every gradient compressor shares: error feedback (Seide et al. 2014; Karimireddy
et al. 2019; the residual ``(g + e) - decompressed`` added next step, so nothing is lost)
and the state kept across steps. No ``torch.distributed`` here.
"""

from __future__ import annotations

import torch

COMPRESS_WARMUP_STEPS = 10  # uncompressed steps before top-k and PowerSGD start


class LocalComm:
    """The collectives of a group of one (for tests and single-process use)."""

    size, rank = 1, 0

    def all_reduce(self, tensor):
        pass

    def reduce_scatter(self, flat):
        return 0, flat.numel()

    def all_gather(self, out, inp):
        out.copy_(inp.view_as(out))

    def all_to_all(self, sends, recvs):
        recvs[0].copy_(sends[0])


class Compressor:
    """Base: error-feedback state per bucket key; ``reduce`` does the work."""

    name = "none"
    carried = {"error": "errors"}  # name -> attribute: the per-bucket state kept across steps

    def __init__(self, error_feedback: bool = True):
        self.error_feedback = error_feedback
        self.errors: dict = {}  # key -> residual this rank did not send
        self.step = 0  # optimizer steps finished (``end_step``)

    def end_step(self) -> None:
        self.step += 1

    def _with_error(self, key, flat: torch.Tensor) -> torch.Tensor:
        """``flat + e`` in fp32 (a new tensor)."""
        acc = flat.float() if flat.dtype != torch.float32 else flat.clone()
        if self.error_feedback and key in self.errors:
            acc += self.errors[key]
        return acc

    def _keep_error(self, key, residual: torch.Tensor) -> None:
        if self.error_feedback:
            self.errors[key] = residual

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's state a restart on the same layout needs, by name: each tensor
        of the ``carried`` dicts as ``<kind>.<key>`` (a tuple key's parts joined by dots)."""
        out = {}
        for kind, attr in self.carried.items():
            for key, tensor in getattr(self, attr).items():
                parts = key if isinstance(key, tuple) else (key,)
                out[".".join([kind, *map(str, parts)])] = tensor
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], device) -> None:
        """Take back what ``state_tensors`` returned."""
        for name, tensor in tensors.items():
            kind, *parts = name.split(".")
            key = tuple(map(int, parts))  # engines key buckets by int
            getattr(self, self.carried[kind])[key if len(key) > 1 else key[0]] = tensor.to(
                device=device, dtype=torch.float32
            )

    def reduce(self, key, flat: torch.Tensor, comm, scatter: bool = False) -> None:
        raise NotImplementedError


class NoCompression(Compressor):
    def reduce(self, key, flat, comm, scatter=False):
        if scatter:
            comm.reduce_scatter(flat)
        else:
            comm.all_reduce(flat)
