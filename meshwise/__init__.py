"""meshwise: 3D-parallel training for PyTorch (data, tensor, pipeline, context) with ZeRO.

Public names (``__all__``): the mesh and ``launch``, ``ParallelPlan`` and ``parallelize``, the
ZeRO engines, tensor-parallel layers, pipeline schedules and runtime, ``Trainer``
(docs/own-model.md). Each loads on first use (PEP 562): ``meshwise.comm.ops`` alone is light.
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
    "MeshwiseError": "meshwise.geometry.errors",
    "ParallelDims": "meshwise.mesh",
    "ParallelModel": "meshwise.apply.parallelize",
    "ParallelPlan": "meshwise.geometry.plan",
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
