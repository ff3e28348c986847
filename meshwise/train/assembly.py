"""A rank's parts for training, each built from the settings, the run state and the parts
before it: the mesh, the model laid out, the engine, the schedule, the start from a
checkpoint, the observer (the ``Trainer`` calls them in that order).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
from meshwise.apply.compile import compile_blocks, compile_loss, keep_kernels_in
from meshwise.apply.lora import add_adapters
from meshwise.apply.parallelize import ParallelModel
from meshwise.apply.stages import chunk_layers
from meshwise.comm import ops
from meshwise.geometry.init import on_meta
from meshwise.mesh import Mesh
from meshwise.models.families import ModelFamily, family
from meshwise.pipeline.runtime import PipelineRuntime
from meshwise.pipeline.schedules import build_schedule
from meshwise.sharding.adamw import AdamWConfig
from meshwise.train.build import (
    build_engine,
    build_model,
    hidden_size,
    own_model_shape,
    precision_of,
)
from meshwise.train.checkpointing import RunCheckpointer
from meshwise.train.config import TrainConfig
from meshwise.train.fingerprint import check_same_job
from meshwise.train.grad_comm import GradCommStats, grad_compressor, grad_reducer
from meshwise.train.init_from import initial_values
from meshwise.train.lora_setup import lora_values
from meshwise.train.lr_schedule import LRSchedule
from meshwise.train.metrics import MetricsLog
from meshwise.train.observe import RunObserver
from meshwise.train.run_state import RunState, record


def join_job(cfg: TrainConfig, run: RunState, data_path, device: torch.device) -> Mesh:
    """Every rank runs the same job (or all stop, naming the difference); the mesh of
    its groups; the collective ledger."""
    check_same_job(
        cfg, run, data_path, ops.world_group(timeout_s=cfg.comm.timeout_s, device=device)
    )
    mesh = Mesh.build(cfg.parallel.dims, timeout_s=cfg.comm.timeout_s, device=device)
    ops.start_ledger(cfg.comm.timeout_s, out_dir=cfg.ledger_dir())
    return mesh


def lay_out_model(cfg: TrainConfig, mesh: Mesh, vocab_size: int, own: ModelFamily | None):
    """This rank's part of the model, laid out (``own``: a model of one's own, else the
    configuration's family): its family, config, ``ParallelModel`` and the shape
    checkpoints record."""
    if own is None:
        model_shape = cfg.model.sizes(vocab_size)
        fam = family(model_shape["family"])
        model_cfg = fam.make_config({**model_shape, "dropout": cfg.model.dropout})
        parallel_model = build_model(cfg, fam, model_cfg, mesh, vocab_size)
    else:
        fam, model_cfg = own, None
        parallel_model = build_model(cfg, fam, None, mesh, None)
        model_shape = own_model_shape(parallel_model, vocab_size)
    if cfg.runtime.compile:  # inside checkpointing: a recompute replays the compiled graph
        keep_kernels_in(cfg.data.cache_dir)
        compile_blocks(parallel_model.layers(), split_backward=_splits_backward(cfg))
        compile_loss(parallel_model)
    apply_activation_checkpointing(parallel_model.layers(), cfg.runtime.activation_checkpointing)
    return fam, model_cfg, parallel_model, model_shape


def _splits_backward(cfg: TrainConfig) -> bool:
    """Whether the schedule defers linear layers' weight gradients to W actions."""
    p = cfg.parallel
    if p.pp == 1:
        return False
    schedule = build_schedule(p.schedule, p.pp, p.num_micro_batches, p.virtual_stages)
    return schedule.has_weight_actions


def build_optimizer(
    cfg: TrainConfig,
    mesh: Mesh,
    fam: ModelFamily,
    model_cfg,
    parallel_model: ParallelModel,
    device: torch.device,
):
    """The gradient compressor (``--compress``), the engine that syncs the gradients and
    steps AdamW, holding this rank's initial values, and what counts its bytes."""
    o = cfg.optim
    adamw = AdamWConfig(lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    values = initial_values(
        parallel_model, cfg, fam.init and partial(fam.init, model_cfg), cfg.data.seed
    )
    if cfg.lora.enabled:  # the adapters' values; the frozen weights held outside the engine
        values = lora_values(parallel_model, values, cfg, precision_of(cfg).param_dtype, device)
    compressor = grad_compressor(mesh, cfg)
    reducer = grad_reducer(mesh, cfg, compressor)
    engine = build_engine(parallel_model, mesh, cfg, adamw, values, device, reducer)
    return compressor, engine, GradCommStats(mesh.world_group.counters, reducer)


def build_runtime(cfg: TrainConfig, mesh: Mesh, parallel_model: ParallelModel, engine):
    """The module the step runs, and the pipeline runtime when there are stages."""
    p, chunks = cfg.parallel, parallel_model.chunks
    model = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
    if p.pp == 1:
        return model, None
    schedule = build_schedule(p.schedule, p.pp, p.num_micro_batches, p.virtual_stages)
    return model, PipelineRuntime(
        chunks, schedule, mesh.pp_group, engine, loss_fn=parallel_model.loss
    )


def start_run(cfg: TrainConfig, run: RunState, checkpointer: RunCheckpointer, logging_rank: bool):
    """Where the run starts (the checkpoint resumed, else step 0), its learning-rate
    schedule (from the run state's start) and its metrics log (the logging rank's)."""
    start_step = checkpointer.load(run.resume) if run.resume else 0
    metrics = MetricsLog(
        cfg.runtime.metrics if logging_rank else None,
        cfg.optim.steps,
        cfg.runtime.log_every,
        resume_step=start_step,
        quiet=cfg.runtime.quiet,
    )
    return start_step, LRSchedule.of(cfg.optim, run.schedule_start), metrics


def build_observer(
    cfg: TrainConfig,
    run: RunState,
    mesh: Mesh,
    device: torch.device,
    fam: ModelFamily,
    model_cfg,
    parallel_model: ParallelModel,
) -> RunObserver:
    """FLOPs come from the whole model's shapes (built on the meta device, with the
    run's LoRA adapters and frozen weights)."""
    with on_meta():
        whole = fam.build(model_cfg)
    if cfg.lora.enabled:
        add_adapters([whole], cfg.lora, parallel_model.plan.last_stage)
    layers = chunk_layers(whole, parallel_model.plan)
    d_model = None if model_cfg else hidden_size(layers[0])
    return RunObserver(cfg, run, mesh, device, whole, layers, record(cfg, run)["config"], d_model)
