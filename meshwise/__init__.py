"""meshwise: 3D-parallel training for PyTorch (data, tensor, pipeline) with ZeRO.

The public names, grouped by what they are for:

* layout: ``ParallelDims``, ``Mesh`` (one process group per axis), ``launch``
  (spawn local ranks or join torchrun);
* parallelism applied to a plain model: ``ParallelPlan`` (what a model family
  splits, cuts and ties), ``parallelize`` (a model on the meta device -> this
  rank's pipeline chunks with tensor-parallel layers);
* data parallel and ZeRO around any ``nn.Module``: ``ZeroOptimizer`` (stages
  0-2, overlapped gradient buckets), ``ZeroStage3`` (parameters sharded too),
  ``Precision`` (bf16 compute with fp32 master weights);
* tensor parallel layers: ``ColumnParallelLinear``, ``RowParallelLinear``,
  ``VocabParallelEmbedding``, ``VocabParallelHead``,
  ``vocab_parallel_cross_entropy``;
* pipeline: ``build_schedule`` (schedules as data), ``PipelineRuntime``;
* training: ``AdamWConfig``, ``GPT``, ``GPTConfig``, ``TrainConfig``, ``Trainer``.

Each name is imported on first use (PEP 562), so ``import meshwise.comm.ops``
loads the collectives and nothing of the trainer, the models or the command
line.
"""

from __future__ import annotations

import importlib

# public name -> the module defining it
_PUBLIC = {
    "AdamWConfig": "meshwise.sharding.adamw",
    "ColumnParallelLinear": "meshwise.tensor_parallel.layers",
    "GPT": "meshwise.models.gpt",
    "GPTConfig": "meshwise.models.gpt",
    "Mesh": "meshwise.mesh",
    "ParallelDims": "meshwise.mesh",
    "ParallelModel": "meshwise.apply.parallelize",
    "ParallelPlan": "meshwise.layout.plan",
    "PipelineRuntime": "meshwise.pipeline.runtime",
    "Precision": "meshwise.sharding.flat",
    "RowParallelLinear": "meshwise.tensor_parallel.layers",
    "TrainConfig": "meshwise.train.config",
    "Trainer": "meshwise.train.trainer",
    "VocabParallelEmbedding": "meshwise.tensor_parallel.vocab",
    "VocabParallelHead": "meshwise.tensor_parallel.vocab",
    "ZeroOptimizer": "meshwise.sharding.buckets",
    "ZeroStage3": "meshwise.sharding.zero3",
    "build_schedule": "meshwise.pipeline.schedules",
    "parallelize": "meshwise.apply.parallelize",
    "vocab_parallel_cross_entropy": "meshwise.tensor_parallel.vocab",
}
_PUBLIC_MODULES = {"launch": "meshwise.cli.launch"}  # public name -> a module
__all__ = sorted([*_PUBLIC, *_PUBLIC_MODULES])


def __getattr__(name: str):
    if name in _PUBLIC_MODULES:
        value = importlib.import_module(_PUBLIC_MODULES[name])
    elif name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    else:
        raise AttributeError(f"module 'meshwise' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
