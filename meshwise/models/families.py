"""Model families by name: a plain model (``build``), its plan, its layout-independent
initial values (``init``) and the tp degrees it accepts (``check_tp``). A new family costs
a model file and an entry here, nothing in the runtime.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from meshwise.geometry.init import Init, init_module
from meshwise.geometry.plan import ParallelPlan
from meshwise.models.gpt import GPT, GPTConfig, check_gpt_tp, gpt_init, gpt_plan
from meshwise.models.llama import Llama
from meshwise.models.llama_config import LlamaConfig
from meshwise.models.llama_plan import check_llama_tp, llama_init, llama_plan


@dataclass(frozen=True)
class ModelFamily:
    """How to build, lay out and initialise one kind of model."""

    name: str
    config: type
    build: Callable[[Any], nn.Module]  # config -> the plain model
    plan: Callable[[Any], ParallelPlan]
    init: Callable[[Any, str], Init] | None  # (config, logical name) -> Init; None: the
    check_tp: Callable[[Any, int], None]  # modules' own (meshwise.apply.module_init)

    @classmethod
    def own(
        cls,
        factory: Callable[[], nn.Module],
        plan: ParallelPlan,
        init_of: Callable[[str], Init] | None = None,
    ) -> "ModelFamily":
        """A model of one's own: ``factory()`` builds it (the trainer calls it on the meta
        device), ``plan`` lays it out, ``init_of(name)`` draws its initial values
        (``None``: each module's own initialisation). Its checks are ``parallelize``'s."""
        return cls(
            "own",
            type(None),
            lambda cfg: factory(),
            lambda cfg: plan,
            None if init_of is None else (lambda cfg, name: init_of(name)),
            lambda cfg, tp: None,
        )

    def create(self, cfg, seed: int = 0) -> nn.Module:
        """The whole model on one process, holding the layout-independent initial
        values of ``seed`` (what every layout starts from; a reference)."""
        init = self.init
        if init is None:
            raise ValueError(
                f"model family {self.name!r} has no init: create() draws each "
                "parameter's values from it; valid: ModelFamily.own(factory, "
                "plan, init_of)"
            )
        model = self.build(cfg)
        init_module(model, lambda name: init(cfg, name), seed, self.plan(cfg).logical_name)
        return model

    def make_config(self, sizes: dict):
        """The family's config from a dict of sizes (extra keys are ignored)."""
        fields = {f.name for f in dataclasses.fields(self.config)}
        return self.config(**{k: v for k, v in sizes.items() if k in fields})


FAMILIES = {
    "gpt": ModelFamily("gpt", GPTConfig, GPT, gpt_plan, gpt_init, check_gpt_tp),
    "llama": ModelFamily("llama", LlamaConfig, Llama, llama_plan, llama_init, check_llama_tp),
}


def family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r}; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]
