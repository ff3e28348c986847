"""``--save`` and ``--resume`` before any rank starts: the lock, leftovers, collisions, room.

The launching process (under torchrun global rank 0) holds the lock for the whole job,
so it alone removes dead saves' leftovers and, with ``--branch``, moves newer checkpoints
aside; other ranks only check. What cannot work ends the job here with one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from meshwise.checkpoint import resume
from meshwise.checkpoint.lineage import Lineage
from meshwise.checkpoint.lock import SaveDirLock
from meshwise.checkpoint.save_dir import (
    SaveDir,
    checkpoint_bytes,
    human_bytes,
    stale_temporaries,
    with_headroom,
)
from meshwise.checkpoint.store import Checkpoint
from meshwise.cli import launch
from meshwise.train.config import TrainConfig
from meshwise.train.run_state import RunState

log = logging.getLogger("meshwise")


def acts_for_the_job() -> bool:
    """Whether this process acts on the save directory for the job (not only checks it)."""
    return not launch.under_torchrun() or os.environ.get("RANK") == "0"


@contextlib.contextmanager
def held_save_dir(cfg: TrainConfig, run_id: str):
    """Hold ``--save`` for job ``run_id``: locked, leftovers of dead jobs removed; on the
    way out, this job's own unfinished saves removed and the lock released."""
    c = cfg.checkpoint
    if not c.save or not acts_for_the_job():
        yield
        return
    resume.check_save_dir(c.save)
    with SaveDirLock(c.save, run_id) as lock:
        leftovers = stale_temporaries(c.save)
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        if leftovers:
            log.info(
                "removed %d unfinished save(s) of an earlier job from %s%s",
                len(leftovers),
                c.save,
                f" (pid {lock.stale.get('pid')}, gone)" if lock.stale else "",
            )
        try:
            yield
        finally:
            SaveDir(Path(c.save), run_id).discard_temporaries()


def check_start(
    cfg: TrainConfig, run: RunState, ckpt: Checkpoint | None, new_checkpoint_bytes: int
) -> None:
    """What resuming ``run.resume`` into ``--save`` means, before training: refuse a
    collision (or set the newer entries aside with ``--branch``), and make sure one
    checkpoint fits."""
    c = cfg.checkpoint
    if not c.save:
        return
    start, start_step = run.start, run.resume_step or 0
    newer = resume.in_the_way(c.save, start_step)
    if newer and not c.branch:
        raise ValueError(resume.branch_problem(c.save, start, start_step, newer))
    if newer and acts_for_the_job():
        folder = resume.set_aside(c.save, newer, run.run_id)
        log.warning(
            "warning: --branch: moved %s into %s; this run goes on from step %d",
            ", ".join(p.name for p in newer),
            folder,
            start_step,
        )
    check_room(cfg, run, ckpt, new_checkpoint_bytes)


def check_room(
    cfg: TrainConfig, run: RunState, ckpt: Checkpoint | None, new_checkpoint_bytes: int
) -> None:
    """One checkpoint must fit in ``--save``, counting what ``--keep-last`` may prune."""
    c, start = cfg.checkpoint, run.start
    assert c.save is not None, "check_start checks only a run with --save"
    needed = with_headroom(
        (checkpoint_bytes(start) if start is not None else 0) or new_checkpoint_bytes
    )
    free = shutil.disk_usage(c.save).free
    reclaimable = 0
    if c.keep_last and ckpt is not None:  # a resumed run may prune its lineage first
        lineage = Lineage.of(ckpt.meta).resumed_by(run.run_id, ckpt.step)
        ours = SaveDir(Path(c.save), run.run_id, c.keep_last, lineage, frozenset({start}))
        reclaimable = sum(checkpoint_bytes(p) for p in ours.ours())
    if free + reclaimable < needed:
        raise ValueError(
            f"--save {c.save}: {human_bytes(free)} free, but one checkpoint of "
            f"this run needs about {human_bytes(needed)}; free some space or "
            "choose another --save"
        )
