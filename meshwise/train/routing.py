"""The step's side of mixture-of-experts routing: a router tally per micro-batch (the
balancing loss's weight and the count sum over the ranks that route different tokens),
the router report in the metrics, and aux-loss-free balancing's bias update.

Counts are summed over every rank that routes its own tokens: dp x cp, and tp under
sequence parallelism; without it the tp ranks route the same tokens, which are counted
once. Pipeline stages hold different layers, so a world sum of the (layers, experts)
table adds them side by side.
"""

from __future__ import annotations

import dataclasses

import torch

from meshwise.comm import ops
from meshwise.geometry.flat_runs import FlatRun
from meshwise.models.moe import is_moe_layer
from meshwise.models.router_stats import RouterTally


class RouterBalance:
    """Routing statistics and balancing for a model config with experts (``cfg``: a
    ``LlamaConfig``); ``num_micro_batches``: per optimizer step (accumulation x pipeline)."""

    def __init__(self, cfg, mesh, sequence_parallel: bool, num_micro_batches: int):
        self.cfg, self.mesh = cfg, mesh
        self.layers = [i for i in range(cfg.n_layer) if is_moe_layer(cfg, i)]
        self.sequence_parallel = sequence_parallel and mesh.dims.tp > 1
        self.aux_scale = cfg.aux_loss_coef / num_micro_batches
        self.tallies: list[RouterTally] = []

    @classmethod
    def of(cls, model_cfg, mesh, sequence_parallel: bool, num_micro_batches: int):
        """A balance for a model with experts, else None."""
        if getattr(model_cfg, "n_experts", 0) <= 0:
            return None
        return cls(model_cfg, mesh, sequence_parallel, num_micro_batches)

    def attach(self, contexts: list) -> list:
        """The micro-batches' contexts, each with a fresh tally of this step's routing."""
        self.tallies = [
            RouterTally(self.aux_scale, self.cfg.aux_loss_formula, self._sum_counts)
            for _ in contexts
        ]
        return [
            dataclasses.replace(context, router=tally)
            for context, tally in zip(contexts, self.tallies)
        ]

    def _sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """A micro-batch's (E,) counts over every rank that routed its own tokens (a
        collective in the forward: the balancing loss's gradient needs them)."""
        summed = counts.clone()
        ops.all_reduce(summed, self.mesh.dp_cp_group, category="moe")
        if self.sequence_parallel:
            ops.all_reduce(summed, self.mesh.tp_group, category="moe")
        return summed

    def extra_loss(self, context) -> torch.Tensor | float:
        """What a micro-batch adds to its loss at the end of the model: transformers'
        concatenated balancing loss (its layers' gradient comes from there), else 0."""
        tally = context.router if context is not None else None
        if tally is None or not tally.prob_sums:
            return 0.0
        return self.aux_scale * tally.concatenated_share()

    def step_table(self, device) -> torch.Tensor:
        """(MoE layers, experts) tokens routed this step, summed over every rank and
        micro-batch (one all-reduce; no host read)."""
        table = torch.zeros(len(self.layers), self.cfg.n_experts, device=device)
        for tally in self.tallies:
            for layer, counts in tally.counts.items():
                table[self.layers.index(layer)] += counts.to(table.dtype)
        ops.all_reduce(table, self.mesh.world_group, category="moe")
        if self.mesh.dims.tp > 1 and not self.sequence_parallel:
            table /= self.mesh.dims.tp  # every tp rank routed the same tokens
        return table

    def add_values(self, values, table: torch.Tensor) -> None:
        """The router report (read with the step's other metrics): the balancing loss,
        and tokens per expert max / mean of the worst layer, and which layer it is."""
        aux = sum(
            (share for tally in self.tallies for share in tally.aux.values()),
            torch.zeros((), device=table.device),
        )
        for tally in self.tallies:  # transformers' formula: the value at the loss
            if tally.prob_sums:
                aux = aux + tally.concatenated_share().detach()
        if self.mesh.dims.tp > 1 and not self.sequence_parallel:
            aux = aux / self.mesh.dims.tp
        values.add("aux_loss", aux / len(self.tallies), "sum")
        ratio = table.max(-1).values / table.mean(-1).clamp(min=1e-12)  # (MoE layers,)
        worst = ratio.argmax()
        layer_ids = torch.tensor(self.layers, device=table.device)
        values.add("moe_max_load", ratio[worst], "first")
        values.add("moe_worst_layer", layer_ids[worst], "first")

    @staticmethod
    def report(combined: dict) -> dict:
        """The router report's entries of the metrics line, from the combined values."""
        return {
            "aux_loss": combined["aux_loss"],
            "moe_max_load": combined["moe_max_load"],
            "moe_worst_layer": int(combined["moe_worst_layer"]),
        }

    @torch.no_grad()
    def update_biases(self, table: torch.Tensor, runs: list[FlatRun], skip: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437, section
        2.1.2): each expert's routing bias moves by ``rate * sign(mean load - load)``,
        written into the engine's values of ``layers.I.mlp.expert_bias`` (this rank's
        part of them; the step's publish hands them to the forward). ``skip``: the step's
        non-finite verdict (a 0-dim device tensor): a skipped step moves no bias."""
        rate = self.cfg.bias_update_rate
        if not rate:
            return
        delta = rate * torch.sign(table.mean(-1, keepdim=True) - table)  # (MoE layers, E)
        delta = delta * (~skip).to(delta.dtype)  # on the device: no host read
        rows = {f"layers.{layer}.mlp.expert_bias": i for i, layer in enumerate(self.layers)}
        for run in runs:
            tensor, base = run.tensors["param"]
            for name, offset, numel in run.names:
                if name not in rows:
                    continue
                lo, hi = max(offset, base), min(offset + numel, base + tensor.numel())
                if lo < hi:
                    part = delta[rows[name], lo - offset : hi - offset]
                    tensor[lo - base : hi - base] += part.to(tensor.dtype)
