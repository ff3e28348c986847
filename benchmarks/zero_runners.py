"""The variants ``benchmarks/zero.py`` times, built on one rank: meshwise's ZeRO stages 0-3
and their torch peers (DDP, ZeroRedundancyOptimizer, FSDP2, FSDP1 where FSDP2 fails), each
with one timed step and its model-state bytes, and the global batches they share.

The torch peers call ``torch.distributed`` directly (a benchmark, not the library).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import (
    adamw_config,
    gpt_config,
    meshwise_gpt,
    reference_gpt,
    timed_step,
    token_loss_sum,
    torch_param_groups,
)
from meshwise.data.dataset import rank_slice
from meshwise.sharding.buckets import ZeroOptimizer
from meshwise.sharding.zero3 import ZeroStage3

# Timed in this order (reversed every other round); each meshwise stage then its peer.
VARIANTS = ("zero0", "ddp", "zero1", "zero_redundancy", "zero2", "zero3", "fsdp2")
STAGE_OF = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}


# ---------------------------------------------------------------- setup
def local_batches(args, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` global batches (the same for every variant); this rank's contiguous slice."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(count):
        batch = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=gen)
        local = rank_slice(batch, rank, args.world_size)  # (B / N, T + 1)
        out.append((local[:, :-1].contiguous(), local[:, 1:].contiguous()))
    return out


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    storages.pop(0, None)  # empty storages may share the null pointer
    return sum(storages.values())


def torch_state_bytes(model: nn.Module, opt) -> int:
    tensors = []
    for p in model.parameters():
        tensors += [p, p.grad]
    optimizers = [opt] + ([opt.optim] if hasattr(opt, "optim") else [])  # ZeRO's local AdamW
    for o in optimizers:
        for state in o.state.values():
            tensors += list(state.values())
    return held_bytes(tensors)


# ---------------------------------------------------------------- runners
class MeshwiseRunner:
    """zero_grad, forward + backward, finish_grad_sync, AdamW step on a meshwise engine.

    ``settle`` also waits for the step's parameter all-gather (ZeRO-1/2 leave it
    to the next forward): the last step before other work runs.
    """

    def __init__(self, pm, engine, global_tokens: int, lr: float):
        self.model, self.loss_fn = pm.chunks[0], pm.loss
        self.engine, self.global_tokens, self.lr = engine, global_tokens, lr

    def step(self, x, y, settle: bool = True) -> tuple[float, dict]:
        def forward_backward():
            loss = self.loss_fn(self.model(x), y) / self.global_tokens
            loss.backward()
            return loss

        def optimizer_step():
            self.engine.step(self.lr)
            if settle:
                self.engine.wait_params()

        loss, times = timed_step(
            self.engine.zero_grad, forward_backward, self.engine.finish_grad_sync, optimizer_step
        )
        return loss.item(), times

    def state_bytes(self) -> int:
        return self.engine.state_bytes()


class TorchRunner:
    """zero_grad, forward + backward (the wrapper syncs inside), ``opt.step()``.

    DDP and FSDP average gradients over ranks where meshwise sums them, so the
    loss backpropagated here is scaled by the world size: both then apply the
    gradient of the global mean loss (the same AdamW steps, not just nearly the
    same: Adam is scale-invariant only up to ``eps``).
    """

    def __init__(self, model, opt, global_tokens: int):
        self.model, self.opt, self.global_tokens = model, opt, global_tokens
        self.world_size = dist.get_world_size()

    def step(self, x, y, settle: bool = True) -> tuple[float, dict]:
        # ``settle`` as for meshwise: the wrappers leave nothing in flight after a step.
        def forward_backward():
            loss = token_loss_sum(self.model(x), y) / self.global_tokens
            (loss * self.world_size).backward()
            return loss

        loss, times = timed_step(self.opt.zero_grad, forward_backward, None, self.opt.step)
        return loss.item(), times

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self.opt)


def build_runner(name: str, args, group, mesh):
    """The model + engine / wrapper + optimizer of variant ``name``."""
    cfg, tokens = adamw_config(args), args.batch_size * args.seq_len
    if name in ("zero0", "zero1", "zero2", "zero3"):
        pm, values = meshwise_gpt(gpt_config(args), args.seed)
        if name == "zero3":
            (chunk,) = pm.chunks
            engine = ZeroStage3(chunk, group, cfg, units=pm.layers(), values=values)
        else:
            engine = ZeroOptimizer(
                pm.named_parameters(),
                group,
                stage=STAGE_OF[name],
                adamw=cfg,
                bucket_cap_mb=args.bucket_mb,
                modules=pm.chunks,
                values=values,
            )
        return MeshwiseRunner(pm, engine, tokens, args.lr)
    model = reference_gpt(gpt_config(args), args.seed)
    kwargs = dict(lr=args.lr, betas=cfg.betas, eps=cfg.eps)
    if name in ("ddp", "zero_redundancy"):
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True
        )
        groups = torch_param_groups(ddp.module.named_parameters(), cfg)
        if name == "ddp":
            return TorchRunner(ddp, torch.optim.AdamW(groups, **kwargs), tokens)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            groups,
            optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=args.zro_bucket_view,
            **kwargs,
        )
        return TorchRunner(ddp, opt, tokens)
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, ModuleWrapPolicy

        from meshwise.models.gpt import Block

        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True
        )
    else:
        raise ValueError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}, fsdp1")
    opt = torch.optim.AdamW(torch_param_groups(model.named_parameters(), cfg), **kwargs)
    return TorchRunner(model, opt, tokens)


def build_all(args, group, mesh, first_batch) -> tuple[dict, dict, dict]:
    """Every variant, FSDP1 standing in for FSDP2 if FSDP2 fails (its error returned).

    FSDP2 takes its first warm-up step here, so that it fails before the timing;
    the losses of steps already taken are returned too.
    """
    runners, errors, losses = {}, {}, {}
    for name in args.variants:
        try:
            runners[name] = build_runner(name, args, group, mesh)
            losses[name] = [runners[name].step(*first_batch)[0]] if name == "fsdp2" else []
        except Exception as exc:  # noqa: BLE001 - reported, then the nearest peer runs
            if name != "fsdp2":
                raise
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            runners.pop(name, None)
            runners["fsdp1"], losses["fsdp1"] = build_runner("fsdp1", args, group, mesh), []
    return runners, errors, losses
