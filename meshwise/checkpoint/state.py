"""Saving and loading a training run's sharded state, whatever the layout.

Engines describe what they hold as ``FlatRun``s: a flat buffer's parameter
layout (engine names and offsets), the range this rank writes, and the tensors
that cover parts of it (parameters, AdamW's two moments). Together with each
parameter's ``Piece`` (its tensor-parallel box inside the logical tensor) that
is all the format needs:

- saving, each rank writes the part of each run it owns as a dp shard, for the
  parameters it is the writer of (tp replicas on tp rank 0, the tied
  embedding on the first pipeline stage), so every logical element is stored
  exactly once and no rank gathers anything;
- loading, each rank fills every tensor it holds from whichever stored pieces
  overlap it, so the saving layout does not matter.

Stored names: ``model.<param>``, ``optim.exp_avg.<param>``,
``optim.exp_avg_sq.<param>`` (``<param>`` the single-process name),
``rng.rank<r>`` for each rank's CPU generator state, and ``<group>.rank<r>.<name>``
for other per-rank state (``comm``: what gradient compression carries between
steps).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from meshwise.checkpoint.store import (Checkpoint, finalize, prune, temp_dir,
                                       write_rank_file)
from meshwise.comm import ops
from meshwise.layout.flat_runs import FlatRun
from meshwise.layout.pieces import Piece, pieces_in_range

KIND_PREFIX = {"param": "model.", "exp_avg": "optim.exp_avg.", "exp_avg_sq": "optim.exp_avg_sq."}
PARAM_PREFIX = KIND_PREFIX["param"]


def _stored(piece: Piece, kind: str) -> Piece:
    return dataclasses.replace(piece, name=KIND_PREFIX[kind] + piece.name)


def save(save_dir: str | Path, step: int, runs: list[FlatRun], pieces: dict[str, Piece],
         writers: set[str], world: ops.Group, meta: dict,
         rank_tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> Path | None:
    """Write a checkpoint of ``step`` (a collective over ``world``); rank 0 returns its path.

    ``pieces``: every engine parameter name -> its ``logical_piece``;
    ``writers``: the names this rank writes; ``rank_tensors``: group -> name -> tensor
    of this rank's own state, stored as ``<group>.rank<r>.<name>``.
    """
    tmp = temp_dir(save_dir, step)
    if world.rank == 0:
        if tmp.exists():  # left by a save that died; it was never a checkpoint
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    ops.barrier(world)
    entries = []
    for run in runs:
        layout = [(pieces[name], offset) for name, offset, _ in run.names if name in writers]
        for kind, (tensor, base) in run.tensors.items():
            for sub, lo, hi in pieces_in_range(layout, *run.save_range):
                entries.append((_stored(sub, kind), tensor[lo - base:hi - base]))
    rng = torch.get_rng_state()
    entries.append((Piece.whole(f"rng.rank{world.rank}", rng.shape), rng))
    for group, tensors in (rank_tensors or {}).items():
        for name, tensor in tensors.items():
            entries.append((Piece.whole(f"{group}.rank{world.rank}.{name}", tensor.shape), tensor))
    fragment = write_rank_file(tmp, world.rank, entries)
    fragments = ops.all_gather_object(fragment, world, category="checkpoint")
    path = None
    if world.rank == 0:
        path = finalize(tmp, fragments, meta)
    ops.barrier(world)  # nobody goes on (or exits) before the checkpoint is visible
    return path


@torch.no_grad()
def load(ckpt: Checkpoint, runs: list[FlatRun], pieces: dict[str, Piece], rank: int,
         same_layout: bool) -> None:
    """Fill every tensor of ``runs`` from ``ckpt``; restore the RNG on the same layout."""
    for run in runs:
        layout = [(pieces[name], offset) for name, offset, _ in run.names]
        for kind, (tensor, base) in run.tensors.items():
            for sub, lo, hi in pieces_in_range(layout, base, base + tensor.numel()):
                ckpt.read_into(tensor[lo - base:hi - base], _stored(sub, kind))
    if same_layout:
        torch.set_rng_state(ckpt.read(f"rng.rank{rank}"))


def rank_state(ckpt: Checkpoint, group: str, rank: int) -> dict[str, torch.Tensor]:
    """What ``save`` stored of ``rank``'s ``group`` state: name -> tensor."""
    prefix = f"{group}.rank{rank}."
    return {name[len(prefix):]: ckpt.read(name) for name in ckpt.tensors
            if name.startswith(prefix)}


def model_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Every model parameter, whole, under its single-process name."""
    return {name[len(PARAM_PREFIX):]: ckpt.read(name) for name in sorted(ckpt.tensors)
            if name.startswith(PARAM_PREFIX)}


def keep_newest(save_dir: str | Path, keep_last: int | None) -> list[Path]:
    """Apply ``--keep-last`` (``None`` keeps everything)."""
    return prune(save_dir, keep_last) if keep_last else []
