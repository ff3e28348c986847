"""Gradient compressors (fp16, bf16, int8, top-k) and the choice by ``--compress`` name. Each
reduces a flat bucket through a ``comm`` (an ``AllReducer``) into the same decompressed sum
on every rank (with ``scatter=True``, this rank's chunk). See docs/compression.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshwise.comm.compression.compressor import COMPRESS_WARMUP_STEPS, Compressor, NoCompression
from meshwise.comm.compression.powersgd import PowerSGDCompressor

COMPRESSORS = ("none", "fp16", "bf16", "int8", "topk:FRACTION", "powersgd:RANK")
INT8_CHUNK = 1024
TOPK_RAMP_STEPS = 100  # top-k density ramp after the warm-up (Lin et al. 2018, DGC)
TOPK_RAMP_START = 0.25  # DGC's first density: 75% sparsity


@dataclass(frozen=True)
class CompressSpec:
    name: str  # none, fp16, bf16, int8, topk, powersgd
    fraction: float = 0.0  # topk
    rank: int = 0  # powersgd

    def __str__(self) -> str:
        if self.name == "topk":
            return f"topk:{self.fraction:g}"
        if self.name == "powersgd":
            return f"powersgd:{self.rank}"
        return self.name


def parse_compress(spec: str) -> CompressSpec:
    """``--compress`` text -> spec; ``ValueError`` naming the bad value and the valid ones."""
    valid = f"valid: {', '.join(COMPRESSORS)} (0 < FRACTION < 1, RANK >= 1)"
    name, _, arg = str(spec).partition(":")
    if name in ("none", "fp16", "bf16", "int8") and not arg:
        return CompressSpec(name)
    try:
        if name == "topk":
            fraction = float(arg)
            if 0 < fraction < 1:
                return CompressSpec("topk", fraction=fraction)
        elif name == "powersgd":
            rank = int(arg)
            if rank >= 1:
                return CompressSpec("powersgd", rank=rank)
    except ValueError:
        pass
    raise ValueError(f"--compress {spec!r} is not valid; {valid}")


def build_compressor(
    spec: CompressSpec | str,
    error_feedback: bool = True,
    warmup_steps: int = COMPRESS_WARMUP_STEPS,
    topk_ramp_steps: int = TOPK_RAMP_STEPS,
) -> Compressor:
    spec = parse_compress(spec) if isinstance(spec, str) else spec
    if spec.name == "none":
        return NoCompression()
    if spec.name in ("fp16", "bf16"):
        return CastCompressor(torch.float16 if spec.name == "fp16" else torch.bfloat16)
    if spec.name == "int8":
        return Int8Compressor(error_feedback=error_feedback)
    if spec.name == "topk":
        return TopKCompressor(
            spec.fraction,
            error_feedback=error_feedback,
            warmup_steps=warmup_steps,
            ramp_steps=topk_ramp_steps,
        )
    return PowerSGDCompressor(spec.rank, error_feedback=error_feedback, warmup_steps=warmup_steps)


class CastCompressor(Compressor):
    """Cast to fp16/bf16, reduce in it, cast back (DDP's fp16/bf16 hooks; ours run on gloo)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__(error_feedback=False)  # the cast error is not carried
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def reduce(self, key, flat, comm, scatter=False):
        low = flat.to(self.dtype)
        if scatter:
            lo, hi = comm.reduce_scatter(low)
            flat[lo:hi].copy_(low[lo:hi])
        else:
            comm.all_reduce(low)
            flat.copy_(low)


# ------------------------------------------------------------------- int8
def quantize_int8(x: torch.Tensor, chunk: int = INT8_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per ``chunk`` elements: ``(q, scales)``."""
    n = x.numel()
    padded = torch.nn.functional.pad(x.float(), (0, -n % chunk)).view(-1, chunk)  # (C, chunk)
    scales = padded.abs().amax(dim=1) / 127.0  # (C,)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:n], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, chunk: int = INT8_CHUNK) -> torch.Tensor:
    n = q.numel()
    padded = torch.nn.functional.pad(q.float(), (0, -n % chunk)).view(-1, chunk)  # (C, chunk)
    return (padded * scales[:, None]).view(-1)[:n]


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    """Tensors as one byte string (for one transfer of mixed dtypes)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def _unpack(data: torch.Tensor, *specs: tuple[torch.dtype, int]) -> list[torch.Tensor]:
    out, at = [], 0
    for dtype, numel in specs:
        size = torch.empty((), dtype=dtype).element_size()
        piece = data[at : at + numel * size]
        if piece.storage_offset() % size:  # a view needs an aligned start
            piece = piece.clone()
        out.append(piece.view(dtype))
        at += numel * size
    return out


class Int8Compressor(Compressor):
    """Per-chunk-scaled int8 with error feedback on both sides of a two-phase all-reduce."""

    name = "int8"
    carried = {"error": "errors", "owner_error": "owner_errors"}

    def __init__(self, error_feedback: bool = True, chunk: int = INT8_CHUNK):
        super().__init__(error_feedback)
        self.chunk = chunk
        self.owner_errors: dict = {}  # key -> residual of re-quantising the owned sum

    def reduce(self, key, flat, comm, scatter=False):
        p, n = comm.size, flat.numel()
        assert not scatter or n % p == 0, "reduce-scatter needs a multiple of the group size"
        size = -(-n // p)
        acc = self._with_error(key, flat)
        work = torch.nn.functional.pad(acc, (0, size * p - n))  # (p * size,)
        pieces = [quantize_int8(work[j * size : (j + 1) * size], self.chunk) for j in range(p)]
        sent = torch.cat([dequantize_int8(q, s, self.chunk) for q, s in pieces])[:n]
        self._keep_error(key, acc - sent)
        num_scales = pieces[0][1].numel()
        sends = [_pack(q, s) for q, s in pieces]
        recvs = [torch.empty_like(sends[0]) for _ in range(p)]
        comm.all_to_all(sends, recvs)
        owned = torch.zeros(size, dtype=torch.float32, device=flat.device)
        for data in recvs:  # in rank order: the same sum on every rank
            q, s = _unpack(data, (torch.int8, size), (torch.float32, num_scales))
            owned += dequantize_int8(q, s, self.chunk)
        lo, hi = comm.rank * size, min((comm.rank + 1) * size, n)
        if scatter:
            flat[lo:hi].copy_(owned[: hi - lo])
            return
        # The all-to-all was the reduce-scatter; the owner re-quantises its sum with error
        # feedback of its own (as 1-bit Adam's compressed all-reduce does), then all-gathers.
        if self.error_feedback and key in self.owner_errors:
            owned += self.owner_errors[key]
        q, s = quantize_int8(owned, self.chunk)
        if self.error_feedback:
            self.owner_errors[key] = owned - dequantize_int8(q, s, self.chunk)
        mine = _pack(q, s)
        gathered = torch.empty(p * mine.numel(), dtype=torch.uint8, device=flat.device)
        comm.all_gather(gathered, mine)
        full = torch.cat(
            [
                dequantize_int8(
                    *_unpack(part, (torch.int8, size), (torch.float32, num_scales)), self.chunk
                )
                for part in gathered.view(p, -1)
            ]
        )
        flat.copy_(full[:n])


# ------------------------------------------------------------------- top-k
class TopKCompressor(Compressor):
    """Each rank sends its largest-magnitude entries as (value, int32 index).

    Deep Gradient Compression's warm-up (Lin et al. 2018): ``warmup_steps`` uncompressed,
    then a density falling exponentially from 25% to ``fraction`` over ``ramp_steps``
    (why AdamW needs it: docs/compression.md).
    """

    name = "topk"

    def __init__(
        self,
        fraction: float,
        error_feedback: bool = True,
        warmup_steps: int = COMPRESS_WARMUP_STEPS,
        ramp_steps: int = TOPK_RAMP_STEPS,
    ):
        super().__init__(error_feedback)
        if not 0 < fraction < 1:
            raise ValueError(f"top-k fraction must be in (0, 1), got {fraction}")
        self.fraction, self.warmup_steps, self.ramp_steps = fraction, warmup_steps, ramp_steps

    def density(self) -> float:
        """The fraction sent at the current step (after the warm-up)."""
        done = self.step - self.warmup_steps
        if done >= self.ramp_steps or self.fraction >= TOPK_RAMP_START:
            return self.fraction
        t = done / self.ramp_steps
        return TOPK_RAMP_START ** (1 - t) * self.fraction**t

    def reduce(self, key, flat, comm, scatter=False):
        if self.step < self.warmup_steps:
            NoCompression.reduce(self, key, flat, comm, scatter)
            return
        n = flat.numel()
        k = max(1, math.ceil(self.density() * n))
        acc = self._with_error(key, flat)
        index = acc.abs().topk(k, sorted=False).indices
        values = acc[index].to(flat.dtype)
        residual = acc
        residual[index] -= values.float()  # what the low-precision value did not carry, too
        self._keep_error(key, residual)
        # All-gathered whatever ``scatter`` says: the pairs are too few to be worth routing
        # to owners, so each rank sums them all and keeps its chunk.
        mine = _pack(values, index.to(torch.int32))
        gathered = torch.empty(comm.size * mine.numel(), dtype=torch.uint8, device=flat.device)
        comm.all_gather(gathered, mine)
        flat.zero_()
        for part in gathered.view(comm.size, -1):  # rank order: identical sums everywhere
            v, i = _unpack(part, (flat.dtype, k), (torch.int32, k))
            flat.index_add_(0, i.long(), v)
