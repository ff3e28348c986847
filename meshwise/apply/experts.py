"""Expert-parallel experts: this rank's ``E / ep`` experts of one MoE layer, and the
all-to-all that brings every rank's tokens for them and takes the results back
(GShard, Lepikhin et al. 2020, section 2.2; dropless, as MegaBlocks, Gale et al. 2022).

Each forward first exchanges the token counts (an all-to-all of ``E`` integers), then
reads them on the host once: the uneven all-to-all of the tokens needs its split sizes
there. That one host read per MoE layer and micro-batch is the price of dropless
routing; the backward reuses the forward's sizes, reversed. Every rank issues the same
collectives in the same order, also when it sends or receives no token.
"""

from __future__ import annotations

import torch
from torch import nn

from meshwise.comm import ops
from meshwise.geometry.params import mark_ep
from meshwise.models.moe import Experts, expert_swiglu


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks of ``group`` (``send`` rows to each, in rank order),
    ``recv`` rows from each; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group, send: list[int], recv: list[int]):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _exchange(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.recv, ctx.send), None, None, None


def _exchange(x: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])  # (received rows, D)
    ops.all_to_all_single(out, x.contiguous(), group, recv, send, category="moe")
    return out


class ExpertParallelExperts(nn.Module):
    """Experts ``ep_rank * E/ep ..`` of a layer's ``Experts``, under the same parameter
    names (each a dim-0 slice of the logical stacked tensor, marked for checkpoints
    and the initialisation); called as ``Experts`` is, on every rank's tokens."""

    def __init__(self, experts: Experts, ep_group):
        super().__init__()
        self.group = ep_group
        self.num_experts = experts.gate_proj.shape[0]
        size, rank = ep_group.size, ep_group.rank
        self.local = self.num_experts // size
        for name in ("gate_proj", "up_proj", "down_proj"):
            whole = getattr(experts, name)
            part = nn.Parameter(torch.empty(self.local, *whole.shape[1:], device=whole.device))
            setattr(self, name, mark_ep(part, rank, size))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: (N, D) this rank's token copies sorted by (global) expert, ``counts``:
        (E,) per expert. Returns their outputs in the same order."""
        ep, local = self.group.size, self.local
        received = torch.empty_like(counts)  # (E,): [source rank, my local expert]
        ops.all_to_all_single(received, counts, self.group, category="moe")
        # The one host read: the token all-to-all's split sizes (and the loop's, if used).
        host = torch.cat([counts, received]).tolist()
        mine, theirs = host[: ep * local], host[ep * local :]
        send = [sum(mine[j * local : (j + 1) * local]) for j in range(ep)]
        recv = [sum(theirs[i * local : (i + 1) * local]) for i in range(ep)]
        per_expert = [sum(theirs[i * local + e] for i in range(ep)) for e in range(local)]
        tokens = AllToAll.apply(x, self.group, send, recv)  # (R, D): by source, then expert
        # Regroup by local expert (source ranks in order inside each), as the kernel wants.
        block = torch.repeat_interleave(
            torch.arange(ep * local, device=x.device), received, output_size=sum(recv)
        )  # (R,) each row's (source, expert) block
        key = (block % local) * ep + block // local  # expert-major
        order = key.argsort(stable=True)
        out = expert_swiglu(
            tokens[order],
            self.gate_proj,
            self.up_proj,
            self.down_proj,
            received.view(ep, local).sum(0),
            per_expert,
        )
        back = torch.empty_like(out).index_copy(0, order, out)  # source order again
        return AllToAll.apply(back, self.group, recv, send)
