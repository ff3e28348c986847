"""The rank side of ``benchmarks/memory.py``: one variant's steps, measured from /proc.

Each job's ranks run ``rank_main``: import what the variant needs, read the
process's RSS (the baseline) and reset its high-water mark there, build the
variant, take the steps, then read ``VmHWM``. Every variant takes its
hyperparameters from the same validated ``TrainConfig`` (the one ``meshwise
train`` would build), so the peers train the meshwise GPT with the same initial
weights, the same global batches (``TokenDataset.global_batch``, this rank's
contiguous rows), the same learning-rate schedule (``lr_at``), AdamW settings,
weight-decay split and gradient clipping.

DDP, FSDP2 and DeepSpeed average gradients over ranks where meshwise sums them,
so their loss is scaled by the world size before backward: every variant then
applies the gradient of the global mean token loss.
"""

from __future__ import annotations

import gc
import importlib
import logging
import time
from pathlib import Path

import torch

from meshwise.comm import ops
from meshwise.train.config import TrainConfig
from meshwise.train.memory import reset_rss_peak, status_kib

STATUS_PATH = Path("/proc/self/status")

MESHWISE = ("zero0", "zero1", "zero2", "zero3")
DEEPSPEED = ("deepspeed1", "deepspeed2", "deepspeed3")
# What deepspeed.initialize imports on first use (0.19: its optimizer check imports
# the Muon optimizer, whose torch.compile pulls in inductor: some 700 modules).
DEEPSPEED_LAZY_IMPORTS = (
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.module_inject.auto_ep_config",
    "deepspeed.module_inject.auto_ep_layer",
)


# ---------------------------------------------------------------- process memory
def process_memory() -> dict[str, int]:
    """This process's resident set now (``VmRSS``) and its high-water mark (``VmHWM``)."""
    text = STATUS_PATH.read_text()
    return {"rss": status_kib("VmRSS", text) * 1024, "hwm": status_kib("VmHWM", text) * 1024}


# ---------------------------------------------------------------- runners
def import_for(variant: str) -> None:
    """Import what the variants load on first use, so that modules are in the baseline.

    Every job imports the same torch and meshwise modules (building DDP alone pulls
    in some 800 modules, about 60 MiB, through ``torch._dynamo``); DeepSpeed's jobs
    import ``deepspeed`` too.
    """
    import numpy.random  # noqa: F401 - the batches
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import meshwise.comm.allreduce.allreducer  # noqa: F401 - imported lazily by the trainer's setup
    import meshwise.comm.compression.compressors  # noqa: F401
    import meshwise.train.trainer  # noqa: F401

    if variant in DEEPSPEED:
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        # DeepSpeed's counterpart of the process group (it wraps the one already up, on
        # CPU also loading its shared-memory op for inference all-reduces).
        deepspeed.init_distributed(dist_backend="gloo")
        for name in DEEPSPEED_LAZY_IMPORTS:
            try:
                importlib.import_module(name)
            except ImportError:  # another DeepSpeed version: measured as it comes
                pass


class MeshwiseRunner:
    """``meshwise train``'s own path: the ``Trainer`` and its ``train_step``."""

    def __init__(self, cfg: TrainConfig, data_path: str):
        from meshwise.train.trainer import Trainer

        self.trainer = Trainer(cfg, data_path)
        self.num_params = self.trainer.num_params

    def step(self, step: int) -> float:
        return self.trainer.train_step(step)["loss"]


class SummedLoss(torch.nn.Module):
    """The GPT's summed token loss as the module a peer wraps (DDP, FSDP2 and DeepSpeed
    call their module with the batch and expect the loss)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs, targets):
        logits = self.model(inputs)  # (B, T, V)
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"
        )


class PeerRunner:
    """A peer's step: forward, backward, clip, AdamW at ``lr_at``, the loss all-reduced
    (as any training loop that logs its loss does)."""

    def __init__(self, variant: str, cfg: TrainConfig, data_path: str, rank: int, world_size: int):
        from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
        from meshwise.data.dataset import TokenDataset
        from meshwise.models.gpt import GPT, GPTConfig

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        d, m = cfg.data, cfg.model.resolved()
        self.data = TokenDataset(data_path, d.seq_len, vocab_size=m.vocab_size)
        gpt = GPT(
            GPTConfig(
                n_layer=m.n_layer,
                n_head=m.n_head,
                d_model=m.d_model,
                block_size=m.block_size,
                vocab_size=self.data.vocab_size,
            )
        ).init_weights(d.seed)
        self.num_params = sum(p.numel() for p in gpt.parameters())
        apply_activation_checkpointing(gpt.blocks.values(), cfg.runtime.activation_checkpointing)
        model = SummedLoss(gpt)
        self.global_tokens = d.batch_size * d.seq_len
        self.bf16 = cfg.runtime.dtype == "bf16"
        self.autocast = False  # DDP computes in bf16 under autocast; the others cast params
        self.group = ops.world_group()
        build = {"ddp": self._ddp, "fsdp2": self._fsdp2}.get(variant, self._deepspeed)
        build(variant, model)

    # ------------------------------------------------------------ builders
    def _adamw(self, named_parameters):
        from benchmarks.common import torch_param_groups
        from meshwise.sharding.adamw import AdamWConfig

        o = self.cfg.optim
        adamw = AdamWConfig(lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        return torch.optim.AdamW(
            torch_param_groups(named_parameters, adamw), lr=o.lr, betas=adamw.betas, eps=adamw.eps
        )

    def _ddp(self, variant: str, model) -> None:
        # Gradients as views of the buckets: no second copy (DDP's leanest setting).
        self.model = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=self.cfg.comm.bucket_mb, gradient_as_bucket_view=True
        )
        self.autocast = self.bf16
        self.opt = self._adamw(model.named_parameters())
        self.engine = None

    def _fsdp2(self, variant: str, model) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("dp",))
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.bf16
            else MixedPrecisionPolicy()
        )
        for block in model.model.blocks.values():
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model, self.opt, self.engine = model, self._adamw(model.named_parameters()), None

    def _deepspeed(self, variant: str, model) -> None:
        import deepspeed

        d, c = self.cfg.data, self.cfg.comm
        bucket_elements = int(c.bucket_mb * 2**20 / 4)  # fp32 elements in meshwise's bucket
        config = {
            "train_batch_size": d.batch_size,
            "train_micro_batch_size_per_gpu": d.batch_size // self.world_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.cfg.optim.clip,
            "zero_optimization": {
                "stage": int(variant[-1]),
                "reduce_bucket_size": bucket_elements,
                "allgather_bucket_size": bucket_elements,
            },
            "bf16": {"enabled": self.bf16},
            "zero_allow_untested_optimizer": True,  # torch.optim.AdamW, as for the others
            "steps_per_print": 10**9,
        }
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=model,
            optimizer=self._adamw(model.named_parameters()),
            config=config,
            dist_init_required=False,
        )
        self.model = self.engine

    # ------------------------------------------------------------ the step
    def step(self, step: int) -> float:
        from meshwise.data.dataset import rank_slice
        from meshwise.train.lr_schedule import lr_at

        o = self.cfg.optim
        lr = lr_at(step, o.lr, o.warmup_steps, o.steps)
        for param_group in self.opt.param_groups:
            param_group["lr"] = lr
        batch = self.data.global_batch(step, self.cfg.data.batch_size, self.cfg.data.seed)
        local = rank_slice(batch, self.rank, self.world_size)  # (B / N, T + 1)
        inputs, targets = local[:, :-1], local[:, 1:]
        if self.engine is None:
            self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(inputs, targets).float() / self.global_tokens
        if self.engine is not None:
            self.engine.backward(loss * self.world_size)
            self.engine.step()  # clips (config), steps and zeroes the gradients
        else:
            (loss * self.world_size).backward()
            if o.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.clip)
            self.opt.step()
        total = loss.detach().reshape(1)
        ops.all_reduce(total, self.group, op="sum", category="metrics")
        return total.item()


# ---------------------------------------------------------------- one job's rank
def rank_main(rank: int, variant: str, cfg: TrainConfig, data_path: str) -> dict:
    """Build ``variant``, take ``cfg.optim.steps`` steps; this rank's memory and times."""
    logging.basicConfig(level=logging.WARNING, force=True)
    world_size = cfg.parallel.dims.world_size
    import_for(variant)
    gc.collect()
    baseline = process_memory()["rss"]
    peak_was_reset = reset_rss_peak()  # a transient peak of the imports must not count
    if variant in MESHWISE:
        runner = MeshwiseRunner(cfg, data_path)
    else:
        runner = PeerRunner(variant, cfg, data_path, rank, world_size)
    built = process_memory()["rss"]
    step_s, losses = [], []
    for step in range(1, cfg.optim.steps + 1):
        ops.barrier(ops.world_group())  # the ranks start each step together
        start = time.perf_counter()
        losses.append(runner.step(step))
        step_s.append(time.perf_counter() - start)
    end = process_memory()
    return {
        "baseline_rss": baseline,
        "built_rss": built,
        "end_rss": end["rss"],
        "hwm": end["hwm"],
        "peak_was_reset": peak_was_reset,
        "step_s": step_s,
        "losses": losses,
        "num_params": runner.num_params,
    }
