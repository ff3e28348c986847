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
"""

from meshwise import launch
from meshwise.mesh import Mesh, ParallelDims
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.optim import AdamWConfig
from meshwise.parallelize import ParallelModel, parallelize
from meshwise.pipeline.runtime import PipelineRuntime
from meshwise.pipeline.schedules import build_schedule
from meshwise.plan import ParallelPlan
from meshwise.sharding.buckets import ZeroOptimizer
from meshwise.sharding.flat import Precision
from meshwise.sharding.zero3 import ZeroStage3
from meshwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from meshwise.tensor_parallel.vocab import (VocabParallelEmbedding, VocabParallelHead,
                                            vocab_parallel_cross_entropy)
from meshwise.train.config import TrainConfig
from meshwise.train.trainer import Trainer

__all__ = [
    "AdamWConfig", "ColumnParallelLinear", "GPT", "GPTConfig", "Mesh", "ParallelDims",
    "ParallelModel", "ParallelPlan", "PipelineRuntime", "Precision", "RowParallelLinear",
    "TrainConfig", "Trainer", "VocabParallelEmbedding", "VocabParallelHead", "ZeroOptimizer",
    "ZeroStage3", "build_schedule", "launch", "parallelize", "vocab_parallel_cross_entropy",
]
