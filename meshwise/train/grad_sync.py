"""Gradient synchronisation across all four axes, and the global gradient norm: the one
place that states how each parameter's gradient stays consistent over dp x cp, tp and
tied pipeline stages (docs/layouts.md "How gradients are kept consistent").
"""

from __future__ import annotations

import math

import torch

from meshwise.comm import ops
from meshwise.geometry.flat_runs import owned_values
from meshwise.geometry.params import is_tp_sharded
from meshwise.mesh import Mesh
from meshwise.sharding.replicas import check_replicas_equal


class GradSync3D:
    """Completes a step's gradients on every axis and computes their global norm.

    ``named_params``: as handed to the engine (read for their tp marks only: meta is fine);
    ``engine``: the sharding engine; ``model``: this rank's ``ParallelModel``, for its ties.
    """

    def __init__(self, named_params, mesh: Mesh, engine, model=None):
        self.mesh, self.engine = mesh, engine
        self.params = {n: p for n, p in named_params if p.requires_grad}  # frozen: no gradient
        self.local_ties = model.local_ties if model is not None else []
        writer = model.is_writer if model is not None else (lambda name: True)
        # The parameters this rank speaks for: each logical tensor once among its tp
        # replicas and tied copies, counted once in the norm and written once to a save.
        self.represented = {
            name
            for name, p in self.params.items()
            if writer(name) and (mesh.tp_rank == 0 or is_tp_sharded(p))
        }
        sequence_parallel = model is not None and model.sequence_parallel
        self.partial_over_tp = (
            {name for name, p in self.params.items() if not is_tp_sharded(p)}
            if sequence_parallel and mesh.dims.tp > 1
            else set()
        )
        self._checked_tp = False

    def finish(self) -> None:
        """Wait for the dp reductions and the tie sums over stages (the engine's),
        then sum sequence-parallel partial gradients over tp."""
        # The engine sums a cross-stage tie over mesh.tie_group (parallelize marked it), so
        # every caller of the engine gets that; a tie whose ends sit on this rank (the V
        # of ZB-V and DualPipeV) is summed here.
        self.engine.finish_grad_sync()
        for members in self.local_ties:
            grads = [self.engine.tie_grad(name) for name in members]
            total = torch.stack(grads).sum(0)
            for grad in grads:
                grad.copy_(total)
        if self.partial_over_tp:
            self._sum_partials_over_tp()
        if not self._checked_tp and self.mesh.dims.tp > 1:
            self.check_tp_replicas()
            self._checked_tp = True

    @torch.no_grad()
    def _sum_partials_over_tp(self) -> None:
        # Under --sp a replicated parameter sees its rank's tokens only: one all-reduce of
        # every such part (Megatron-LM's allreduce_sequence_parallel_gradients), after the
        # dp x cp sync (the sums commute; tp ranks hold them at the same buffer offsets).
        views = self.engine.held_grads(self.partial_over_tp)
        if not views:
            return
        packed = torch.cat([v.reshape(-1) for v in views])  # (sum of their elements,)
        ops.all_reduce(packed, self.mesh.tp_group, category="grad")
        for view, part in zip(views, packed.split([v.numel() for v in views])):
            view.copy_(part.view_as(view))

    def grad_sq_norm(self) -> torch.Tensor:
        """The squared L2 norm of the full model's gradient: a float64 0-dim tensor on
        the device, the same on every rank (never read on the host here)."""
        sq = self.engine.grad_sq_norm(include=self.represented.__contains__)
        sq = sq.to(torch.float64).reshape(1)
        ops.all_reduce(sq, self.mesh.tp_group, category="norm")
        ops.all_reduce(sq, self.mesh.pp_group, category="norm")
        return sq[0]

    def grad_norm(self) -> float:
        """The L2 norm of the full model's gradient, read on the host."""
        return math.sqrt(self.grad_sq_norm().item())

    def norm_and_skip(self, loss_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The squared global gradient norm and whether to skip the step (a non-finite norm or
        any rank's loss): 0-dim device tensors, the same on every rank, from one world
        all-reduce of each rank's part and ``loss * 0`` (NaN where a loss is not finite).
        """
        local = self.engine.grad_sq_norm(include=self.represented.__contains__, over_dp=False)
        both = torch.stack([local.to(torch.float64), loss_part.detach().to(torch.float64) * 0])
        ops.all_reduce(both, self.mesh.world_group, category="norm")
        # At ZeRO 0-1 every dp x cp rank holds the whole sum; at 2-3 each replica of
        # --dp-shard holds every shard once (the same values in each replica).
        dims = self.mesh.dims
        copies = dims.num_replicas if self.engine.stage >= 2 else dims.dp * dims.cp
        sq = both[0] / copies
        return sq, ~(torch.isfinite(sq) & torch.isfinite(both[1]))

    def check_replica_values(self, rtol: float = 1e-6) -> None:
        """Raise, naming the parameter, if a tp-replicated parameter's values differ across tp
        ranks (nondeterministic kernels, or a bug). Any ZeRO stage: the float64 sums of the dp
        shards are added up over dp x cp, then compared across tp.
        """
        held = owned_values(self.engine.checkpoint_runs())
        names = [n for n, p in self.params.items() if not is_tp_sharded(p)]
        device = next(iter(held.values())).device if held else torch.device("cpu")
        empty = torch.zeros(0, dtype=torch.float64, device=device)
        self._compare_across_tp(
            names,
            [held.get(n, empty) for n in names],
            rtol,
            "values",
            sum_over=self.mesh.dp_cp_group,
        )
        for engine in getattr(self.engine, "engines", (self.engine,)):  # dense, experts
            if engine.replicate_group is not None:
                check_replicas_equal(engine.flats, engine.replicate_group)

    def _compare_across_tp(self, names, tensors, rtol: float, what: str, sum_over=None) -> None:
        if not names:
            return
        sums = torch.stack([t.double().sum() for t in tensors])
        scale = torch.stack([t.double().abs().sum() for t in tensors])
        if sum_over is not None:  # partial sums of dp shards -> whole parameters
            both = torch.stack([sums, scale])
            ops.all_reduce(both, sum_over, category="check")
            sums, scale = both[0], both[1]
        low, high = sums.clone(), sums.clone()
        ops.all_reduce(low, self.mesh.tp_group, op="min", category="check")
        ops.all_reduce(high, self.mesh.tp_group, op="max", category="check")
        bad = ((high - low) > rtol * scale + 1e-12).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(
                f"{what} of tp-replicated parameters differ across tp ranks: "
                f"{', '.join(names[i] for i in bad)}"
            )

    def check_tp_replicas(self, rtol: float = 1e-5) -> None:
        """Raise if a tp-replicated parameter's gradient differs across tp ranks.

        Needs full gradients (ZeRO stages 0 and 1); skipped when they are sharded.
        """
        if getattr(self.engine, "stage", 0) >= 2:
            return
        names = [n for n, p in self.params.items() if not is_tp_sharded(p)]
        self._compare_across_tp(names, [self.engine.grad_of(n) for n in names], rtol, "gradients")
