"""Gradient synchronisation across all four axes, and the global gradient norm.

This is the one place that states, for every parameter, across which axes it is
replicated and how its gradient is kept consistent:

* dp and cp: every parameter is replicated across dp and cp (a cp rank holds
  every parameter and some tokens of every sequence); its gradient is SUMMED
  over ``mesh.dp_cp_group`` by the engine's buckets (or reduce-scattered into shards
  under ZeRO, which shards over dp x cp as FSDP does in torchtitan). Each cp
  rank's loss is its tokens' share of the global mean, so the sum is the
  gradient of the global mean: no token counted twice.
* tp: a tp-sharded parameter (``tp_sharded=True``: column/row weights, the
  vocabulary shard of the embedding) is a different slice on every tp rank and
  needs nothing. A tp-replicated parameter (LayerNorms, row-parallel biases, the
  position embedding) gets IDENTICAL gradients on every tp rank without
  communication: its gradient flows from activations that are themselves
  replicated, because ``copy_to_tp``'s backward already summed them over tp
  (Megatron-LM section 3). ``check_tp_replicas`` verifies this at the first step.
  Under sequence parallelism (``--sp``) a replicated parameter sees only its
  rank's slice of the sequence: its gradients are partial sums, SUMMED over tp
  after the dp x cp sync, in one all-reduce of every such part this rank holds
  (Megatron-LM's ``allreduce_sequence_parallel_gradients``; the sums commute,
  and tp ranks hold the same parameters at the same offsets of their buffers).
* pp: a tie whose members live on different stages (the token embedding and
  the head on the first and last stage) keeps a copy at each end; their
  gradients are SUMMED over ``mesh.tie_group`` after the dp sync (Megatron-LM's
  embedding group), so both copies take the same step. ``parallelize`` marks
  them and the engine's ``finish_grad_sync`` sums them, so every caller of the
  engine gets it. Where both ends sit on one rank (the V of ZB-V and DualPipeV)
  they are summed here. Under ZeRO-2/3 each member has a flat buffer of its own,
  so the dp shards of the members line up and their sum is exact too.

The global norm counts each unique parameter once: tp-replicated parameters on tp
rank 0 only, a tie on the stage holding its first member only, and shards summed.
"""

from __future__ import annotations

import math

import torch

from meshwise.comm import ops
from meshwise.layout.flat_runs import owned_values
from meshwise.layout.params import is_tp_sharded
from meshwise.mesh import Mesh


class GradSync3D:
    """Completes a step's gradients on every axis and computes their global norm.

    ``named_params``: the parameters as they were handed to the engine (read for
    their tensor-parallel marks only, so they may be on the meta device);
    ``engine``: the sharding engine; ``model``: this rank's ``ParallelModel``,
    for ties across pipeline stages (counted once in the norm; none without it).
    """

    def __init__(self, named_params, mesh: Mesh, engine, model=None):
        self.mesh, self.engine = mesh, engine
        self.params = dict(named_params)
        self.local_ties = model.local_ties if model is not None else []
        writer = model.is_writer if model is not None else (lambda name: True)
        self.counted = {name for name, p in self.params.items()
                        if writer(name) and (mesh.tp_rank == 0 or is_tp_sharded(p))}
        sequence_parallel = model is not None and model.sequence_parallel
        self.partial_over_tp = ({name for name, p in self.params.items() if not is_tp_sharded(p)}
                                if sequence_parallel and mesh.dims.tp > 1 else set())
        self._checked_tp = False

    def finish(self) -> None:
        """Wait for the dp reductions and the tie sums over stages (the engine's),
        then sum sequence-parallel partial gradients over tp."""
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
        sq = self.engine.grad_sq_norm(include=self.counted.__contains__)
        sq = sq.to(torch.float64).reshape(1)
        ops.all_reduce(sq, self.mesh.tp_group, category="norm")
        ops.all_reduce(sq, self.mesh.pp_group, category="norm")
        return sq[0]

    def grad_norm(self) -> float:
        """The L2 norm of the full model's gradient, read on the host."""
        return math.sqrt(self.grad_sq_norm().item())

    def norm_and_skip(self, loss_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The squared global gradient norm and whether the step must be skipped (a
        non-finite norm or any rank's loss not finite): 0-dim tensors on the device,
        the same on every rank, from one world all-reduce and no host read.

        Each rank's part of the squared norm and ``loss * 0`` (NaN exactly where its
        loss is not finite; NaN survives the sum) are summed over the world. At ZeRO
        stages 0-1 every rank of the engine's group (dp x cp) holds the whole sum over
        that group, so the world's sum counts it dp x cp times and is divided by that."""
        local = self.engine.grad_sq_norm(include=self.counted.__contains__, over_dp=False)
        both = torch.stack([local.to(torch.float64), loss_part.detach().to(torch.float64) * 0])
        ops.all_reduce(both, self.mesh.world_group, category="norm")
        replicas = self.mesh.dims.dp * self.mesh.dims.cp
        sq = both[0] if self.engine.stage >= 2 else both[0] / replicas
        return sq, ~(torch.isfinite(sq) & torch.isfinite(both[1]))

    def check_replica_values(self, rtol: float = 1e-6) -> None:
        """Raise if a tp-replicated parameter's values differ across tp ranks.

        Works under every ZeRO stage: each dp rank sums the elements of its dp
        shard (float64 sum and absolute sum), the dp ranks add them up, and the
        totals must agree across tp. Replicas drift only through nondeterministic
        kernels or a bug; found early, the parameter is named, on every rank.
        """
        held = owned_values(self.engine.checkpoint_runs())
        names = [n for n, p in self.params.items() if not is_tp_sharded(p)]
        device = next(iter(held.values())).device if held else torch.device("cpu")
        empty = torch.zeros(0, dtype=torch.float64, device=device)
        self._compare_across_tp(names, [held.get(n, empty) for n in names], rtol, "values",
                                sum_over=self.mesh.dp_cp_group)

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
            raise RuntimeError(f"{what} of tp-replicated parameters differ across tp ranks: "
                               f"{', '.join(names[i] for i in bad)}")

    def check_tp_replicas(self, rtol: float = 1e-5) -> None:
        """Raise if a tp-replicated parameter's gradient differs across tp ranks.

        Needs full gradients (ZeRO stages 0 and 1); skipped when they are sharded.
        """
        if getattr(self.engine, "stage", 0) >= 2:
            return
        names = [n for n, p in self.params.items() if not is_tp_sharded(p)]
        self._compare_across_tp(names, [self.engine.grad_of(n) for n in names], rtol,
                                "gradients")
