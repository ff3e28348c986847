"""Saving and loading a run's sharded state whatever the layout: each rank writes its dp
shard of the parameters it writes (each logical element once, nothing gathered), and
loading fills each tensor from the stored pieces that overlap it.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from meshwise.checkpoint.save_dir import SaveDir
from meshwise.checkpoint.store import Checkpoint, CheckpointWriteError, finalize, write_rank_file
from meshwise.comm import ops
from meshwise.geometry.flat_runs import FlatRun
from meshwise.geometry.pieces import Piece, pieces_in_range

# Stored names: model.<param>, optim.exp_avg.<param>, optim.exp_avg_sq.<param> (<param>
# the single-process name), rng.rank<r> (a rank's CPU generator), and <group>.rank<r>.<name>
# for other per-rank state (comm: what gradient compression carries between steps).
KIND_PREFIX = {"param": "model.", "exp_avg": "optim.exp_avg.", "exp_avg_sq": "optim.exp_avg_sq."}
PARAM_PREFIX = KIND_PREFIX["param"]


def _stored(piece: Piece, kind: str) -> Piece:
    return dataclasses.replace(piece, name=KIND_PREFIX[kind] + piece.name)


def save(
    target: str | Path | SaveDir,
    step: int,
    runs: list[FlatRun],
    pieces: dict[str, Piece],
    represented: set[str],
    world: ops.Group,
    meta: dict,
    rank_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path | None:
    """Write a checkpoint of ``step`` (a collective over ``world``); rank 0 returns its path.

    ``target``: the ``--save`` directory or a job's view of it; ``pieces``: engine parameter
    name -> ``logical_piece``; ``represented``: the names this rank writes;
    ``rank_tensors``: group -> name -> this rank's own state. Raises
    ``CheckpointWriteError`` alike on every rank.
    """
    save_dir = target if isinstance(target, SaveDir) else SaveDir(Path(target))
    entries = _entries(runs, pieces, represented, world.rank, rank_tensors)
    needed = sum(t.numel() * t.element_size() for _, t in entries)
    # Rank 0 decides for everyone: room made (pruning early if it must), the directory
    # created, or the reason not; the others wait for the answer.
    sizes = ops.all_gather_object(needed, world, category="checkpoint")
    verdict = None
    if world.rank == 0:  # under torchrun only rank 0's run id names the directory
        problem = save_dir.prepare(step, sum(sizes))
        verdict = (problem, str(save_dir.temp_dir(step)))
    problem, tmp = ops.all_gather_object(verdict, world, category="checkpoint")[0]
    if problem:
        raise CheckpointWriteError(problem)
    tmp = Path(tmp)
    fragment: dict | str  # this rank's file, or why it could not be written
    try:
        fragment = write_rank_file(tmp, world.rank, entries)
    except CheckpointWriteError as exc:
        fragment = str(exc)
    fragments = ops.all_gather_object(fragment, world, category="checkpoint")
    problems = [f for f in fragments if isinstance(f, str)]
    if problems:
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(problems[0])
    path = None
    if world.rank == 0:
        path = finalize(tmp, fragments, meta, save_dir.final_dir(step))
    ops.barrier(world)  # nobody goes on (or exits) before the checkpoint is visible
    return path


def _entries(runs, pieces, represented, rank, rank_tensors) -> list[tuple[Piece, torch.Tensor]]:
    entries = []
    for run in runs:
        layout = [(pieces[name], offset) for name, offset, _ in run.names if name in represented]
        for kind, (tensor, base) in run.tensors.items():
            for sub, lo, hi in pieces_in_range(layout, *run.save_range):
                entries.append((_stored(sub, kind), tensor[lo - base : hi - base]))
    rng = torch.get_rng_state()
    entries.append((Piece.whole(f"rng.rank{rank}", rng.shape), rng))
    for group, tensors in (rank_tensors or {}).items():
        for name, tensor in tensors.items():
            entries.append((Piece.whole(f"{group}.rank{rank}.{name}", tensor.shape), tensor))
    return entries


@torch.no_grad()
def load(
    ckpt: Checkpoint, runs: list[FlatRun], pieces: dict[str, Piece], rank: int, same_layout: bool
) -> None:
    """Fill every tensor of ``runs`` from ``ckpt``; restore the RNG on the same layout."""
    for run in runs:
        layout = [(pieces[name], offset) for name, offset, _ in run.names]
        for kind, (tensor, base) in run.tensors.items():
            for sub, lo, hi in pieces_in_range(layout, base, base + tensor.numel()):
                ckpt.read_into(tensor[lo - base : hi - base], _stored(sub, kind))
    if same_layout:
        torch.set_rng_state(ckpt.read(f"rng.rank{rank}"))


def rank_state(ckpt: Checkpoint, group: str, rank: int) -> dict[str, torch.Tensor]:
    """What ``save`` stored of ``rank``'s ``group`` state: name -> tensor."""
    prefix = f"{group}.rank{rank}."
    return {
        name[len(prefix) :]: ckpt.read(name) for name in ckpt.tensors if name.startswith(prefix)
    }


def model_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Every model parameter, whole, under its single-process name."""
    return {
        name[len(PARAM_PREFIX) :]: ckpt.read(name)
        for name in sorted(ckpt.tensors)
        if name.startswith(PARAM_PREFIX)
    }
