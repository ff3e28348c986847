"""meshwise: 3D-parallel training for PyTorch (data, tensor, pipeline) with ZeRO.

The public names, grouped by what they are for:

* layout: ``ParallelDims``, ``Mesh`` (one process group per axis), ``launch``
  (spawn local ranks or join torchrun);
* data parallel and ZeRO around any ``nn.Module``: ``ZeroOptimizer`` (stages
  0-2, overlapped gradient buckets), ``ZeroStage3`` (parameters sharded too);
* tensor parallel layers: ``ColumnParallelLinear``, ``RowParallelLinear``,
  ``VocabParallelEmbedding``, ``vocab_parallel_cross_entropy``;
* pipeline: ``build_schedule`` (schedules as data), ``PipelineRuntime``;
* training: ``AdamWConfig``, ``GPT``, ``GPTConfig``, ``TrainConfig``, ``Trainer``.
"""

from meshwise import launch
from meshwise.mesh import Mesh, ParallelDims
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.optim import AdamWConfig
from meshwise.pipeline.runtime import PipelineRuntime
from meshwise.pipeline.schedules import build_schedule
from meshwise.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                             VocabParallelEmbedding,
                                             vocab_parallel_cross_entropy)
from meshwise.train.config import TrainConfig
from meshwise.train.trainer import Trainer
from meshwise.zero.optimizer import ZeroOptimizer
from meshwise.zero.params import ZeroStage3

__all__ = [
    "AdamWConfig", "ColumnParallelLinear", "GPT", "GPTConfig", "Mesh", "ParallelDims",
    "PipelineRuntime", "RowParallelLinear", "TrainConfig", "Trainer", "VocabParallelEmbedding",
    "ZeroOptimizer", "ZeroStage3", "build_schedule", "launch", "vocab_parallel_cross_entropy",
]
