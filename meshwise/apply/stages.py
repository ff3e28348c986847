"""A model's repeated layers, and the copy of it one pipeline stage holds: its share of
the layers under their global indices, the end modules of other stages set to None.
"""

from __future__ import annotations

import copy

from torch import nn

from meshwise.geometry.errors import MeshwiseError
from meshwise.geometry.plan import ParallelPlan


def layers_of(model: nn.Module, plan: ParallelPlan) -> nn.ModuleDict | nn.ModuleList:
    """The container of ``model``'s layers the plan names (MeshwiseError when missing)."""
    name = type(model).__name__
    if not hasattr(model, plan.layers):
        children = ", ".join(n for n, _ in model.named_children()) or "none"
        raise MeshwiseError(
            f"plan: {name} has no attribute {plan.layers!r} (the plan's layers); "
            f"its children: {children}"
        )
    layers = getattr(model, plan.layers)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise MeshwiseError(
            f"plan: {name}.{plan.layers} is a {type(layers).__name__}; valid: an "
            "nn.ModuleList of the layers, or an nn.ModuleDict keyed by their index"
        )
    return layers


def chunk_layers(chunk: nn.Module, plan: ParallelPlan) -> list[nn.Module]:
    """The layers ``chunk`` (a model or a pipeline stage of it) holds, in order."""
    layers = layers_of(chunk, plan)
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


class StageLayers(nn.ModuleList):
    """The layers of an ``nn.ModuleList`` that one pipeline stage holds, named by their
    index in the whole list (``blocks.2`` on the stage of layers 2 and 3), so names do
    not depend on the layout; iterating and indexing go over the held layers in order.
    """

    def __init__(self, named: list[tuple[str, nn.Module]]):
        super().__init__()
        for key, layer in named:
            self.add_module(key, layer)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return StageLayers(list(self._modules.items())[idx])
        return list(self._modules.values())[idx]


def cut_stage(model: nn.Module, plan: ParallelPlan, stage: int, num_stages: int) -> nn.Module:
    """Logical stage ``stage``'s copy of ``model``: its layers, and the end modules it holds."""
    if num_stages == 1:
        return model
    chunk = copy.deepcopy(model)  # cheap on the meta device
    layers = layers_of(chunk, plan)
    named = list(layers.named_children())
    per_stage = len(named) // num_stages
    kept = named[stage * per_stage : (stage + 1) * per_stage]
    if isinstance(layers, nn.ModuleDict):
        for key in {key for key, _ in named} - {key for key, _ in kept}:
            del layers[key]
    else:  # a ModuleList renumbers what remains after a deletion: keep the indices
        setattr(chunk, plan.layers, StageLayers(kept))
    if stage != 0:
        for name in plan.first_stage:
            set_module(chunk, name, None)
    if stage != num_stages - 1:
        for name in plan.last_stage:
            set_module(chunk, name, None)
    return chunk


def set_module(root: nn.Module, path: str, module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)
