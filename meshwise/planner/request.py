"""A planning request (a model, a world, a device, the choices allowed): ``run`` lists the
layouts that fit, best first, or raises ``NoLayoutFits`` naming what would fit; ``predict``
times one layout (``--explain``, ``--layout auto``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from meshwise.planner.devices import DeviceProfile, compiled_profile, device_profile
from meshwise.planner.layout import Layout
from meshwise.planner.search import (
    Prediction,
    Space,
    memory_limit,
    predict,
    search,
    settings_of,
    valid_choices,
)
from meshwise.planner.shapes import ModelShape, model_shape
from meshwise.train.config import TrainConfig
from meshwise.train.lora_setup import check_nf4_rows

GIB = 2**30
MAX_WORLD_FACTOR = 4096  # how far up the smallest fitting world is searched


class NoLayoutFits(ValueError):
    """No valid layout of the world fits; the message names what would."""


@dataclass
class PlanRequest:
    cfg: TrainConfig
    world: int
    device: DeviceProfile
    space: Space
    shape: ModelShape

    @property
    def limit(self) -> float:
        """Bytes one rank may hold."""
        return memory_limit(self.device, self.world)

    def predict(self, layout: Layout) -> Prediction:
        """One layout's prediction; ValueError (the configuration check's own message) for
        one ``meshwise train`` would refuse, or one of another world."""
        if layout.world_size != self.world:
            raise ValueError(
                f"--explain {layout.flags()!r} has dp x cp x tp x pp = "
                f"{layout.world_size} ranks, not --world {self.world}"
            )
        laid_out = layout.apply(self.cfg).validate()
        if laid_out.lora.quantize_base == "nf4":  # each rank's rows whole NF4 blocks
            check_nf4_rows(laid_out, self.shape.vocab)
        return predict(
            self.shape, layout, settings_of(self.cfg, self.device), self.device, self.limit
        )

    def run(self) -> list[Prediction]:
        """Every valid layout that fits, best first (NoLayoutFits when none does)."""
        found = search(self.cfg, self.shape, self.world, self.device, self.space, self.limit)
        fitting = [p for p in found if p.fits]
        if fitting:
            return fitting
        raise NoLayoutFits(self._what_would_fit(found))

    def _what_would_fit(self, found: list[Prediction]) -> str:
        where = (
            "per device"
            if not self.device.memory_per_node
            else f"per rank ({self.device.memory_bytes / GIB:.1f} GiB shared by the "
            f"machine's ranks)"
        )
        if not found:
            probe = Layout(dp=self.world)
            try:
                probe.apply(self.cfg).validate()
                reason = "the batch or the model does not split over it"
            except ValueError as exc:
                reason = str(exc)
            return (
                f"no valid layout of --world {self.world} for this model and batch "
                f"({reason}); valid: a world whose ranks the model's heads, layers, "
                "sequence and --batch-size divide among"
            )
        least = found[0]
        need_gb = math.ceil(least.memory.total / GIB * 10) / 10  # enough, at 0.1 GiB
        if self.device.memory_per_node:
            local = round(self.device.memory_bytes / self.limit)
            fix = f"--device-memory-gb {need_gb * local:.1f} or more (the machine's)"
        else:
            fix = f"--device-memory-gb {need_gb:.1f} or more"
        world = self._smallest_world()
        more = f", or --world {world}" if world else ""
        return (
            f"no layout of --world {self.world} fits {self.limit / GIB:.1f} GiB {where}: "
            f"the least any needs is {least.memory.total / GIB:.2f} GiB "
            f"({least.layout.flags()}); valid: "
            f"{fix}{more}"
        )

    def _smallest_world(self) -> int | None:
        """The smallest multiple of the world (doubling) with a layout that fits, searched
        with the most frugal choices allowed (highest valid ZeRO stage: QLoRA's is 2; most
        recomputation)."""
        space = self.space
        zeros, modes = valid_choices(self.cfg, space)
        if not zeros or not modes:
            return None
        frugal = dataclasses.replace(space, zero=zeros[-1:], activation_checkpointing=modes[-1:])
        world = self.world * 2
        while world <= self.world * MAX_WORLD_FACTOR:
            found = search(
                self.cfg, self.shape, world, self.device, frugal, memory_limit(self.device, world)
            )
            if any(p.fits for p in found):
                return world
            world *= 2
        return None


def plan_request(
    cfg: TrainConfig,
    world: int,
    device_name: str,
    space: Space,
    memory_gb: float | None = None,
    nodes: int | None = None,
    cache_dir: str | None = None,
) -> PlanRequest:
    """Resolve the device profile for ``world`` ranks over ``nodes`` machines."""
    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    if memory_gb is not None and memory_gb <= 0:
        raise ValueError(f"--device-memory-gb must be > 0, got {memory_gb:g}")
    device = device_profile(
        device_name,
        Path(cache_dir) if cache_dir else None,
        memory_bytes=memory_gb * GIB if memory_gb else None,
    )
    if cfg.runtime.compile:
        device = compiled_profile(device)
    if nodes is not None:
        if nodes < 1 or world % nodes:
            divisors = [k for k in range(1, world + 1) if world % k == 0]
            raise ValueError(
                f"--nodes {nodes} does not divide --world {world}; valid: "
                f"{', '.join(map(str, divisors[:12]))}"
            )
        device = dataclasses.replace(device, ranks_per_node=world // nodes)
    elif device.ranks_per_node > 0:
        device = dataclasses.replace(device, ranks_per_node=min(device.ranks_per_node, world))
    return PlanRequest(cfg, world, device, space, model_shape(cfg))
