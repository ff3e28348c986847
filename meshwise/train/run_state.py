"""Run state: what the launcher decided for one launch, apart from the settings (run id,
checkpoint started from, schedule start, data digests, log folders), computed once before
the ranks start; records keep these at the keys they had as settings (``RECORDED_AT``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

from meshwise.checkpoint.store import MANIFEST, Checkpoint
from meshwise.data.token_files import read_meta
from meshwise.data.tokenizer import load_tokenizer
from meshwise.train.config import OptimConfig, TrainConfig, recorded_section
from meshwise.train.loggers import run_names
from meshwise.train.lr_schedule import resumed_start

# Where each fact is kept in a recorded configuration (section, key): where it was
# when it was part of the settings. The checkpoint path itself is recorded only in
# the ``run`` section (paths differ between nodes; the step and digest stand for it).
RECORDED_AT = {
    "run_id": ("checkpoint", "run_id"),
    "resume_step": ("checkpoint", "resume_step"),
    "resume_manifest": ("checkpoint", "resume_manifest"),
    "schedule_start": ("optim", "schedule_start"),
    "tokenizer_digest": ("data", "tokenizer_digest"),
    "chat_template_digest": ("data", "chat_template_digest"),
    "log_dir": ("runtime", "log_dir"),
    "run_name": ("runtime", "run_name"),
    "profile_dir": ("runtime", "profile_dir"),
}


@dataclass(frozen=True)
class RunState:
    """What one launch of a job runs with besides its settings; every rank gets the same."""

    run_id: str = ""  # names the job's saves and its lineage ("": a run made in Python)
    resume: str | None = None  # the checkpoint this launch starts from; None: from scratch
    resume_step: int | None = None
    resume_manifest: str | None = None  # the SHA-256 of that checkpoint's manifest
    schedule_start: int = 0  # the step the learning-rate schedule starts at
    tokenizer_digest: str | None = None  # of --tokenizer's file; None: byte-level
    chat_template_digest: str | None = None  # of the template chat data was rendered with
    run_name: str | None = None  # the loggers' run; None: named when loggers start
    log_dir: str | None = None  # the loggers' folder
    profile_dir: str | None = None  # the profiler's traces; None: ./profile

    @property
    def start(self) -> Path | None:
        """The checkpoint this launch starts from, as a path (None: from scratch)."""
        return Path(self.resume) if self.resume is not None else None

    @classmethod
    def at_launch(cls, cfg: TrainConfig, data_path: str | Path, run_id: str) -> "RunState":
        """What ``meshwise train`` decides before its ranks start, all but where they start
        from (``starting_from``); the launcher names the run, so every rank agrees."""
        names = run_names(cfg.runtime, cfg.checkpoint.save)
        return cls(
            run_id=run_id,
            **data_digests(cfg, data_path),
            run_name=names["run_name"],
            log_dir=names["log_dir"],
            profile_dir=names["profile_dir"],
        )

    @classmethod
    def in_rank(cls, cfg: TrainConfig, data_path: str | Path) -> "RunState":
        """The same for a ``Trainer`` made without a run state (the Python API): no run
        id, and only the names the settings give (the logging rank names the rest)."""
        r = cfg.runtime
        return cls(
            **data_digests(cfg, data_path),
            run_name=r.run_name,
            log_dir=r.log_dir,
            profile_dir=r.profile_dir,
        )

    def starting_from(self, optim: OptimConfig, checkpoint: str | Path | None) -> "RunState":
        """This run state for a launch that starts from ``checkpoint`` (None: from scratch):
        its step, its manifest's digest, and where the schedule starts; ``ValueError``
        when the settings' schedule does not continue the checkpoint's."""
        if checkpoint is None:
            return dataclasses.replace(
                self, resume=None, resume_step=None, resume_manifest=None, schedule_start=0
            )
        ckpt = Checkpoint(checkpoint)
        digest = hashlib.sha256((ckpt.path / MANIFEST).read_bytes()).hexdigest()
        return dataclasses.replace(
            self,
            resume=str(checkpoint),
            resume_step=ckpt.step,
            resume_manifest=digest,
            schedule_start=schedule_start(optim, ckpt),
        )

    @classmethod
    def recorded(cls, meta: dict) -> "RunState":
        """The run state a checkpoint's metadata (or a metrics config file) records: its
        ``run`` section, or, written before there was one, the configuration's keys."""
        if isinstance(meta.get("run"), dict):
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in meta["run"].items() if k in known})
        config = meta.get("config", {})
        return cls(
            **{
                name: config[section][key]
                for name, (section, key) in RECORDED_AT.items()
                if key in config.get(section, {})
            }
        )


def record(cfg: TrainConfig, run: RunState) -> dict:
    """The configuration a checkpoint and the metrics' config file record: ``config``, the
    settings with the run state's facts at their keys (``RECORDED_AT``), and ``run``."""
    config = dataclasses.asdict(cfg)
    for name, (section, key) in RECORDED_AT.items():
        config[section][key] = getattr(run, name)
    return {"config": config, "run": dataclasses.asdict(run)}


def schedule_start(optim: OptimConfig, ckpt: Checkpoint) -> int:
    """The step this run's schedule starts at, resuming ``ckpt`` (``lr_schedule.resumed_start``
    against the schedule the checkpoint recorded)."""
    saved = recorded_section(OptimConfig, ckpt.meta["config"]["optim"])
    return resumed_start(optim, saved, ckpt.step, RunState.recorded(ckpt.meta).schedule_start)


def data_digests(cfg: TrainConfig, data_path: str | Path) -> dict:
    """The digests of the tokenizer (``--tokenizer``, as the checks before launch resolved
    it) and of the chat template the token file was rendered with (its sidecar)."""
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer)  # parsed once per file: the checks' copy
    chat = read_meta(data_path, d.token_dtype).get("chat") or {}
    return {
        "tokenizer_digest": tokenizer.digest if tokenizer.path is not None else None,
        "chat_template_digest": chat.get("template_digest"),
    }
