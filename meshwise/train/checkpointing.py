"""The trainer's side of checkpoints: beside the engine's state, the step (which fixes the
learning rate and next batch), the model's shape, the layout, configuration, run state,
lineage and each rank's compressor state, so a resume continues bit-exactly.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from meshwise.checkpoint import state
from meshwise.checkpoint.lineage import Lineage
from meshwise.checkpoint.save_dir import SaveDir
from meshwise.checkpoint.store import Checkpoint
from meshwise.mesh import Mesh
from meshwise.train.run_state import RunState, record

log = logging.getLogger("meshwise")

# Layout keys a checkpoint may lack, and what they were then.
LAYOUT_DEFAULTS = {"cp": 1, "sp": False}
# What fixes the dp buckets and what a compressor carries for them, besides the layout.
BUCKET_SETTINGS = (
    ("comm", "compress"),
    ("comm", "error_feedback"),
    ("comm", "bucket_mb"),
    ("runtime", "dtype"),
    ("runtime", "grad_reduce_dtype"),
)


class RunCheckpointer:
    """Saves and restores one rank's share of a run. ``pieces``: each engine parameter's box
    in its logical tensor; ``represented``: the names this rank stores (each logical
    tensor once).
    """

    def __init__(
        self,
        cfg,
        run: RunState,
        mesh: Mesh,
        engine,
        pieces: dict,
        represented: set[str],
        model: dict,
        compressor=None,
        device=None,
    ):
        self.cfg, self.run, self.mesh, self.engine = cfg, run, mesh, engine
        self.compressor, self.device = compressor, device
        self.pieces = pieces
        self.represented = represented
        self.model = model  # the shape of the model, checked on resume
        p = cfg.parallel
        self.layout = {
            "dp": p.dp,
            "tp": p.tp,
            "pp": p.pp,
            "virtual_stages": p.virtual_stages,
            "zero": p.zero,
            "cp": p.cp,
            "sp": p.sp,
        }
        self.lineage = Lineage(run.run_id)  # a fresh run, until ``load``
        self.resumed_from: Path | None = None

    def due(self, step: int) -> bool:
        c = self.cfg.checkpoint
        if not c.save:
            return False
        return step == self.cfg.optim.steps or bool(c.save_every and step % c.save_every == 0)

    def save(self, step: int) -> None:
        c = self.cfg.checkpoint
        meta = {
            "step": step,
            "optimizer_step": self.engine.step_count,
            "model": self.model,
            "layout": self.layout,
            **record(self.cfg, self.run),
            "lineage": self.lineage.to_meta(),
        }
        own = None if self.compressor is None else {"comm": self.compressor.state_tensors()}
        protect = frozenset({self.resumed_from}) if self.resumed_from else frozenset()
        save_dir = SaveDir(Path(c.save), self.run.run_id, c.keep_last, self.lineage, protect)
        path = state.save(
            save_dir,
            step,
            self.engine.checkpoint_runs(),
            self.pieces,
            self.represented,
            self.mesh.world_group,
            meta,
            own,
        )
        if path is not None:
            removed = save_dir.prune(c.keep_last) if c.keep_last else []
            log.info("saved %s%s", path, f" (removed {len(removed)} older)" if removed else "")

    def load(self, path: str) -> int:
        """Restore from ``path``; return the step it was saved at."""
        ckpt = Checkpoint(path)  # verified before the ranks started (``check_resume``)
        self.lineage = Lineage.of(ckpt.meta).resumed_by(self.run.run_id, ckpt.step)
        self.resumed_from = Path(path)
        saved = {**LAYOUT_DEFAULTS, **ckpt.meta["layout"]}  # saved before cp and sp existed
        same = saved == self.layout
        state.load(ckpt, self.engine.checkpoint_runs(), self.pieces, self.mesh.rank, same)
        self.engine.load_done()
        self.engine.step_count = ckpt.meta["optimizer_step"]
        if self.compressor is not None:
            self._load_compressor(ckpt, same)
        how = "same layout" if same else f"resharded from {ckpt.meta['layout']}"
        log.info("resumed from %s at step %d (%s)", path, ckpt.step, how)
        return ckpt.step

    def _load_compressor(self, ckpt: Checkpoint, same_layout: bool) -> None:
        """The warm-up and top-k ramp go on from the step reached; the carried state
        comes back where the buckets are the same (layout, sizes, compressor)."""
        self.compressor.step = ckpt.step
        saved, now = ckpt.meta["config"], dataclasses.asdict(self.cfg)
        changed = [
            key
            for section, key in BUCKET_SETTINGS
            if saved.get(section, {}).get(key) != now[section][key]
        ]
        if same_layout and not changed:
            self.compressor.load_state_tensors(
                state.rank_state(ckpt, "comm", self.mesh.rank), self.device
            )
        elif self.mesh.rank == 0:
            why = "another layout" if not same_layout else "changed " + ", ".join(changed)
            log.info(
                "--compress %s: its carried errors start from zero (%s)",
                self.cfg.comm.compress,
                why,
            )
