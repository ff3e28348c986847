"""PowerSGD (Vogels et al. 2019): low-rank gradient compression with error feedback."""

from __future__ import annotations

import math

import torch

from meshwise.comm.compression.compressor import COMPRESS_WARMUP_STEPS, Compressor, NoCompression


def orthogonalize(m: torch.Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt on the columns of ``m`` (rows x rank), in place (as PyTorch's hook)."""
    for i in range(m.shape[1]):
        col = m[:, i : i + 1]
        col /= col.norm() + eps
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1 :]
            rest -= col * (col.t() @ rest)


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD (Vogels et al. 2019, Algorithm 1 with error feedback).

    Per matrix gradient ``M`` (rows x rest): ``P = M Q`` all-reduced (with the bucket's
    vectors), orthogonalised, ``Q = M^T P`` all-reduced, ``M ~ P Q^T``; ``Q`` starts seeded,
    the same on every rank, and is warm-started across steps. Only a matrix that at least
    halves is compressed (PyTorch's ``min_compression_rate``); none for ``warmup_steps``.
    """

    name = "powersgd"
    carried = {"error": "errors", "q": "qs"}  # qs: (key, offset) -> the last step's Q

    def __init__(
        self,
        rank: int,
        error_feedback: bool = True,
        warmup_steps: int = COMPRESS_WARMUP_STEPS,
        seed: int = 0,
    ):
        super().__init__(error_feedback)
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank, self.warmup_steps, self.seed = rank, warmup_steps, seed
        self.layouts: dict = {}  # key -> [(offset, shape)] of the bucket's parameters
        self.qs: dict = {}  # (key, offset) -> Q of the previous step

    def set_layout(self, key, params: list[tuple[int, tuple[int, ...]]]) -> None:
        self.layouts[key] = list(params)

    def _matrices(self, key, n: int) -> list[tuple[int, int, int]]:
        """``(offset, rows, cols)`` of the matrices worth compressing in bucket ``key``."""
        found = []
        for offset, shape in self.layouts.get(key, []):
            if len(shape) < 2:
                continue
            rows, cols = shape[0], math.prod(shape[1:])
            if (
                offset + rows * cols <= n
                and min(rows, cols) > self.rank
                and rows * cols >= 2 * (rows + cols) * self.rank
            ):
                found.append((offset, rows, cols))
        return sorted(found)

    def _q(self, key, offset: int, cols: int, device) -> torch.Tensor:
        if (key, offset) not in self.qs:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + offset)
            self.qs[(key, offset)] = torch.randn(cols, self.rank, generator=gen).to(device)
        return self.qs[(key, offset)]

    def reduce(self, key, flat, comm, scatter=False):
        n = flat.numel()
        matrices = self._matrices(key, n)
        if self.step < self.warmup_steps or not matrices:
            NoCompression.reduce(self, key, flat, comm, scatter)
            return
        acc = self._with_error(key, flat)  # (n,) fp32
        rest = torch.ones(n, dtype=torch.bool, device=flat.device)
        ms, ps = [], []
        for offset, rows, cols in matrices:
            m = acc[offset : offset + rows * cols].view(rows, cols)
            rest[offset : offset + rows * cols] = False
            ms.append(m)
            ps.append(m @ self._q(key, offset, cols, flat.device))  # (rows, r)
        plain = acc[rest]
        first = torch.cat([p.view(-1) for p in ps] + [plain])
        comm.all_reduce(first)
        at, p_hats = 0, []
        for p in ps:
            p_hats.append(first[at : at + p.numel()].view_as(p))
            orthogonalize(p_hats[-1])
            at += p.numel()
        qs = [m.t() @ p_hat for m, p_hat in zip(ms, p_hats)]  # (cols, r) each, local
        second = torch.cat([q.view(-1) for q in qs])
        # What this rank's M loses by the projection onto span(P): its residual.
        for m, p_hat, q in zip(ms, p_hats, qs):
            m -= p_hat @ q.t()
        self._keep_error(key, torch.where(rest, torch.zeros_like(acc), acc))
        comm.all_reduce(second)
        out = torch.empty_like(acc)
        out[rest] = first[at:]
        at = 0
        for (offset, rows, cols), p_hat in zip(matrices, p_hats):
            q_sum = second[at : at + cols * self.rank].view(cols, self.rank)
            out[offset : offset + rows * cols].view(rows, cols).copy_(p_hat @ q_sum.t())
            self.qs[(key, offset)] = q_sum.clone()  # warm start for the next step
            at += cols * self.rank
        flat.copy_(out)
