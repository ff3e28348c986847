"""A layout as ``meshwise train`` takes it: ``Layout`` holds what the planner chooses,
``apply`` writes it into a ``TrainConfig`` (whose ``validate`` is the one source of the
rules), ``flags`` is the command line that runs it.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

from meshwise.train.config import TrainConfig


@dataclass(frozen=True)
class Layout:
    """One layout. ``micro_batches``: pipeline micro-batches (1 without a pipeline)."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # experts split over ep of the dp x cp ranks
    sp: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 1
    grad_accum: int = 1
    zero: int = 0
    activation_checkpointing: str = "none"
    compress: str = "none"
    dp_shard: int = 0  # ZeRO over dp_shard dp ranks, replicas across (0: all of dp)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shard_size(self) -> int:
        return self.dp_shard or self.dp

    @property
    def replicas(self) -> int:
        return self.dp // self.shard_size

    def flags(self) -> str:
        """The ``meshwise train`` flags of this layout (defaults left out, axes shown)."""
        parts = [f"--dp {self.dp}", f"--tp {self.tp}", f"--pp {self.pp}"]
        if self.cp > 1:
            parts.append(f"--cp {self.cp}")
        if self.ep > 1:
            parts.append(f"--ep {self.ep}")
        if self.sp:
            parts.append("--sp")
        if self.pp > 1:
            parts.append(f"--schedule {self.schedule} --micro-batches {self.micro_batches}")
            if self.virtual_stages > 1:
                parts.append(f"--virtual-stages {self.virtual_stages}")
        if self.grad_accum > 1:
            parts.append(f"--grad-accum {self.grad_accum}")
        parts.append(f"--zero {self.zero}")
        if self.replicas > 1:
            parts.append(f"--dp-shard {self.dp_shard}")
        if self.activation_checkpointing != "none":
            parts.append(f"--activation-checkpointing {self.activation_checkpointing}")
        if self.compress != "none":
            parts.append(f"--compress {self.compress}")
        return " ".join(parts)

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        """A copy of ``cfg`` laid out this way (not validated)."""
        parallel = dataclasses.replace(
            cfg.parallel,
            dp=self.dp,
            cp=self.cp,
            tp=self.tp,
            pp=self.pp,
            sp=self.sp,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            micro_batches=self.micro_batches if self.pp > 1 else 0,
            zero=self.zero,
            ep=self.ep,
            dp_shard=self.dp_shard,
        )
        return dataclasses.replace(
            cfg,
            parallel=parallel,
            data=dataclasses.replace(cfg.data, grad_accum=self.grad_accum),
            runtime=dataclasses.replace(
                cfg.runtime, activation_checkpointing=self.activation_checkpointing
            ),
            comm=dataclasses.replace(cfg.comm, compress=self.compress),
        )

    @classmethod
    def of(cls, cfg: TrainConfig) -> "Layout":
        """The layout a configuration runs."""
        p = cfg.parallel
        return cls(
            dp=p.dp,
            cp=p.cp,
            tp=p.tp,
            pp=p.pp,
            ep=p.ep,
            sp=p.sp,
            schedule=p.schedule,
            virtual_stages=p.virtual_stages,
            micro_batches=p.num_micro_batches,
            grad_accum=cfg.data.grad_accum,
            zero=p.zero,
            activation_checkpointing=cfg.runtime.activation_checkpointing,
            compress=cfg.comm.compress,
            dp_shard=p.dp_shard,
        )

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """A layout from ``meshwise train`` flags (``--explain``'s argument); ValueError
        naming a flag that is not a layout flag."""
        words = shlex.split(text)
        values: dict = {}
        i = 0
        while i < len(words):
            flag = words[i]
            name = flag.lstrip("-").replace("-", "_")
            if flag == "--sp":
                values["sp"], i = True, i + 1
                continue
            if name not in _PARSED or i + 1 >= len(words):
                valid = ", ".join("--" + n.replace("_", "-") for n in (*_PARSED, "sp"))
                raise ValueError(
                    f"--explain: {flag!r} is not a layout flag with a value; valid: {valid}"
                )
            values[name] = _PARSED[name](words[i + 1])
            i += 2
        if values.get("pp", 1) > 1 and "micro_batches" not in values:
            values["micro_batches"] = values["pp"]  # meshwise train's default
        return cls(**values)


_PARSED = {
    "dp": int,
    "cp": int,
    "ep": int,
    "tp": int,
    "pp": int,
    "schedule": str,
    "virtual_stages": int,
    "micro_batches": int,
    "grad_accum": int,
    "zero": int,
    "activation_checkpointing": str,
    "compress": str,
    "dp_shard": int,
}
