"""What a run trains with: the model laid out on this rank (built on the meta device), its
sharding engine (allocating only what this rank keeps), and the dtype of ``--dtype auto``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshwise.apply.lora import add_adapters
from meshwise.apply.parallelize import ParallelModel, parallelize
from meshwise.apply.stages import chunk_layers
from meshwise.device.choice import resolve_dtype, takes_bf16
from meshwise.geometry.init import on_meta
from meshwise.geometry.params import ep_split
from meshwise.mesh import Mesh
from meshwise.models.families import FAMILIES, ModelFamily
from meshwise.pipeline.schedules import STAGE_MAP_OF
from meshwise.sharding.adamw import AdamWConfig
from meshwise.sharding.buckets import ZeroOptimizer
from meshwise.sharding.experts import DenseAndExperts
from meshwise.sharding.flat import Precision
from meshwise.sharding.zero3 import ZeroStage3, reshard_policy
from meshwise.train.config import TrainConfig


def build_model(
    cfg: TrainConfig, family: ModelFamily, model_cfg, mesh: Mesh, vocab_size: int | None
) -> ParallelModel:
    """This rank's part of the model: pipeline chunks with tensor-parallel layers (and
    sequence parallelism), context-parallel positions and attention, on meta."""
    p = cfg.parallel
    with on_meta():
        model = family.build(model_cfg)
    parallel_model = parallelize(
        model,
        family.plan(model_cfg),
        tp_group=mesh.tp_group if p.tp > 1 else None,
        pp_rank=mesh.pp_rank,
        pp_size=p.pp,
        virtual_stages=p.virtual_stages,
        vocab_size=vocab_size,
        sequence_parallel=p.sp,
        cp_group=mesh.cp_group,
        stage_map=STAGE_MAP_OF.get(p.schedule, "loop") if p.pp > 1 else "loop",
        tie_group=mesh.tie_group,
        ep_group=mesh.ep_group,
        check_forward=FAMILIES.get(family.name) is not family,
    )
    if cfg.lora.enabled:  # after the tp swap: each adapter follows its layer's split
        add_adapters(parallel_model.chunks, cfg.lora, skip=parallel_model.plan.last_stage)
    return parallel_model


def dtype_resolved(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """``cfg`` with ``--dtype auto`` resolved for ``device`` (the Python API's default; the
    command line resolves it before launch)."""
    if cfg.runtime.dtype != "auto":
        return cfg
    dtype = resolve_dtype(
        "auto",
        device.type,
        lambda: takes_bf16([torch.cuda.get_device_capability(device)], torch.cuda.nccl.version()),
    )
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, dtype=dtype))


def precision_of(cfg: TrainConfig) -> Precision:
    """``--dtype`` and ``--grad-reduce-dtype`` as the engines' dtypes."""
    if cfg.runtime.dtype != "bf16":
        return Precision()
    reduce = torch.bfloat16 if cfg.runtime.grad_reduce_dtype == "bf16" else torch.float32
    return Precision(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def build_engine(
    model: ParallelModel,
    mesh: Mesh,
    cfg: TrainConfig,
    adamw: AdamWConfig,
    values,
    device,
    grad_reducer=None,
    exclude=(),
):
    """The gradient synchroniser + optimizer for ``--zero`` (``ZeroOptimizer`` for stages 0-2,
    ``ZeroStage3``), filled from ``values``, reducing over ``mesh.shard_group``, then over
    ``mesh.replicate_group`` (``--dp-shard``); through ``grad_reducer`` when given (its
    group: the replicate group under ``--dp-shard``, else dp x cp). ``exclude``:
    parameters held elsewhere, which ZeRO-3 must not shard (stages 0-2 take only trained
    ones, and those are the caller's to leave out)."""
    if mesh.replicate_group is None:
        return _sharding_engine(model, mesh, cfg, adamw, values, device, grad_reducer, exclude)
    # Hybrid: native within a replica, the reducer's algorithm / compressor across them.
    engine = _sharding_engine(model, mesh, cfg, adamw, values, device, None, exclude)
    engine.replicate_over(mesh.replicate_group, grad_reducer)
    return engine


def _sharding_engine(model, mesh, cfg, adamw, values, device, grad_reducer, exclude=()):
    precision, p = precision_of(cfg), cfg.parallel
    if model.ep_group is not None:
        return _dense_and_experts(model, mesh, cfg, adamw, values, device, grad_reducer)
    if p.zero == 3:  # the layers are units, the rest the root unit
        target: nn.Module | list[nn.Module] = model.chunks[0]
        units: list = model.layers()
        alone: list[nn.Module] = []
        if p.pp > 1:  # per chunk; its end modules (a tied embedding) never share a unit
            per_chunk = []
            for chunk in model.chunks:
                first, last = model.end_modules(chunk)
                per_chunk.append(first + chunk_layers(chunk, model.plan) + last)
                alone += first + last
            target, units = model.chunks, per_chunk
        return ZeroStage3(
            target,
            mesh.shard_group,
            adamw,
            units,
            reshard=reshard_policy(p.pp > 1, p.reshard_after_forward),
            alone=alone,
            exclude=exclude,
            precision=precision,
            values=values,
            device=device,
            unit_cap_mb=cfg.comm.bucket_mb,
            grad_reducer=grad_reducer,
        )
    tied = list(model.cross_stage_ties) + [n for group in model.local_ties for n in group]
    return ZeroOptimizer(
        model.named_parameters(),
        mesh.shard_group,
        stage=p.zero,
        adamw=adamw,
        bucket_cap_mb=cfg.comm.bucket_mb,
        precision=precision,
        modules=model.chunks,
        values=values,
        device=device,
        grad_reducer=grad_reducer,
        reduce_once=p.pp > 1,
        own_buckets=tied,
    )


def _dense_and_experts(model, mesh, cfg, adamw, values, device, grad_reducer):
    """Under expert parallelism: the dense parameters' engine over dp x cp and the
    experts' over their expert-data-parallel group, at the same ZeRO stage."""
    p = cfg.parallel
    named = model.named_parameters()
    # Experts differ across ep ranks: the dense engine's ZeRO-3 must not shard them over
    # dp x cp. Trained, they have an engine of their own; frozen (LoRA), they are held
    # beside the engines (``meshwise.train.lora_setup``).
    every_expert = [q for _, q in named if ep_split(q) is not None]
    experts = [(n, q) for n, q in named if ep_split(q) is not None and q.requires_grad]
    dense_model = dataclasses.replace(model, ep_group=None)
    if not experts:  # a pipeline stage of dense layers only: its engine as without ep
        return _sharding_engine(
            dense_model, mesh, cfg, adamw, values, device, grad_reducer, every_expert
        )
    if p.zero == 3:
        dense = _sharding_engine(
            dense_model, mesh, cfg, adamw, values, device, grad_reducer, every_expert
        )
        # The dense engine took the rest: this one holds the experts, a unit per layer,
        # gathered from a step's first forward to its end (no freed views to rebuild
        # under the dense engine's saved-tensor hooks).
        holders = [
            [
                m
                for m in chunk.modules()
                if any(ep_split(q) is not None for q in m.parameters(False))
            ]
            for chunk in model.chunks
        ]
        pipelined = len(model.chunks) > 1
        expert_engine = ZeroStage3(
            model.chunks if pipelined else model.chunks[0],
            mesh.expert_shard_group,
            adamw,
            holders if pipelined else holders[0],
            reshard="after-step",
            precision=precision_of(cfg),
            values=values,
            device=device,
        )
        return _with_experts(dense, expert_engine, mesh, experts)
    dense_named = [(n, q) for n, q in named if ep_split(q) is None]
    tied = list(model.cross_stage_ties) + [n for group in model.local_ties for n in group]
    common = dict(
        stage=p.zero,
        adamw=adamw,
        bucket_cap_mb=cfg.comm.bucket_mb,
        precision=precision_of(cfg),
        modules=model.chunks,
        values=values,
        device=device,
        reduce_once=p.pp > 1,
    )
    dense = ZeroOptimizer(
        dense_named, mesh.shard_group, grad_reducer=grad_reducer, own_buckets=tied, **common
    )
    return _with_experts(
        dense, ZeroOptimizer(experts, mesh.expert_shard_group, **common), mesh, experts
    )


def _with_experts(dense, expert_engine, mesh, experts) -> DenseAndExperts:
    """Under ``--dp-shard`` the experts' shards are summed over their replicate group
    (the dense engine's group is ``build_engine``'s to set)."""
    if mesh.expert_replicate_group is not None:
        expert_engine.replicate_over(mesh.expert_replicate_group)
    return DenseAndExperts(dense, expert_engine, mesh.ep_group, [n for n, _ in experts])


def own_model_shape(model: ParallelModel, data_vocab_size: int) -> dict:
    """What a checkpoint records of a model of one's own; ValueError when the data's
    token ids do not fit its vocabulary."""
    vocab = model.vocab_size
    if vocab is not None and data_vocab_size > vocab:
        raise ValueError(
            f"the data has {data_vocab_size} token ids but the model's vocabulary "
            f"holds {vocab}; valid: a model with vocabulary >= {data_vocab_size}, "
            "or data of its tokenizer"
        )
    return {"family": "own", "vocab_size": vocab, "num_stages": model.num_stages}


def hidden_size(layer: torch.nn.Module) -> int:
    """A layer's width: the input features of its first ``nn.Linear`` (for FLOPs)."""
    first = next((m for m in layer.modules() if isinstance(m, torch.nn.Linear)), None)
    return first.in_features if first is not None else 0
