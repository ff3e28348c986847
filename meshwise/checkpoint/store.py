"""Checkpoint directories: per-rank safetensors files plus one manifest, written under a
temporary name and renamed once complete, removed by renaming to ``.trash-`` first. Not
``torch.distributed.checkpoint``, whose shards are boxes: a ZeRO shard is a flat run
cutting through parameters, and a ``Piece`` is both. No communication here.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import re
from pathlib import Path

import torch

from meshwise.checkpoint import manifest as manifest_file

# Re-exported: the manifest's names are part of this module's interface.
from meshwise.checkpoint.manifest import FORMAT, MANIFEST, VERSION, CheckpointError  # noqa: F401
from meshwise.geometry.pieces import Piece, copy_overlap

STEP_DIR = re.compile(r"^step-(\d{8})$")
TEMP_PREFIX = ".tmp-"  # a save under way, or one that died
TRASH_PREFIX = ".trash-"  # a checkpoint being removed


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a vanished folder); one line."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step of a ``step-NNNNNNNN`` directory name, else None."""
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def temp_dir(save_dir: str | os.PathLike, step: int, job: str = "") -> Path:
    """Where ``job`` writes step ``step`` before it is complete (unique to the job)."""
    return Path(save_dir) / f"{TEMP_PREFIX}{step_dir_name(step)}{'-' + job if job else ''}"


def write_rank_file(
    tmp_dir: str | os.PathLike, rank: int, entries: list[tuple[Piece, torch.Tensor]]
) -> dict:
    """Write this rank's pieces (flat tensors, one per piece) and return its manifest fragment."""
    from safetensors.torch import save_file

    file_name = f"rank-{rank:05d}.safetensors"
    tensors, pieces = {}, []
    for i, (piece, tensor) in enumerate(entries):
        if tensor.numel() != piece.numel:
            raise ValueError(
                f"{piece.name}: {tensor.numel()} elements for a piece of {piece.numel}"
            )
        key = f"p{i}"
        tensors[key] = tensor.detach().reshape(-1).contiguous().cpu()
        pieces.append(
            {
                "name": piece.name,
                "shape": list(piece.shape),
                "key": key,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                **piece.to_dict(),
            }
        )
    path = Path(tmp_dir) / file_name
    try:
        save_file(tensors, str(path))
        _fsync(path)
    except Exception as exc:  # safetensors raises its own error type for OS errors
        path.unlink(missing_ok=True)
        raise CheckpointWriteError(f"cannot write {path}: {_reason(exc)}") from None
    return {"file": file_name, "pieces": pieces}


def _reason(exc: BaseException) -> str:
    """An OS error's reason in a few words, whoever raised it."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    if "No space left" in text or getattr(exc, "errno", None) == errno.ENOSPC:
        return "No space left on device"
    return text.splitlines()[0] if text else type(exc).__name__


def finalize(
    tmp_dir: str | os.PathLike,
    fragments: list[dict],
    meta: dict,
    final: str | os.PathLike | None = None,
) -> Path:
    """Write the manifest for the complete set of fragments and make the checkpoint visible
    as ``final`` (default: ``tmp_dir``'s name without the temporary prefix)."""
    tmp_dir = Path(tmp_dir)
    files: dict[str, dict] = {}  # file name -> its size and digest
    tensors: dict[str, dict] = {}  # logical tensor -> its shape, dtype and pieces
    for fragment in fragments:
        path = tmp_dir / fragment["file"]
        files[fragment["file"]] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        for p in fragment["pieces"]:
            entry = tensors.setdefault(
                p["name"], {"shape": p["shape"], "dtype": p["dtype"], "pieces": []}
            )
            if entry["shape"] != p["shape"]:
                raise ValueError(
                    f"{p['name']}: pieces disagree on the shape ({entry['shape']} vs {p['shape']})"
                )
            entry["pieces"].append(
                {
                    "file": fragment["file"],
                    "key": p["key"],
                    **{k: p[k] for k in ("box_offsets", "box_sizes", "flat")},
                }
            )
    for name, entry in tensors.items():
        stored = sum(p["flat"][1] - p["flat"][0] for p in entry["pieces"])
        if stored != math.prod(entry["shape"]):
            raise ValueError(
                f"{name}: pieces hold {stored} elements, the tensor has "
                f"{math.prod(entry['shape'])} (a shard missing or written twice)"
            )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "meta": meta,
        "files": files,
        "tensors": tensors,
    }
    manifest_file.write(tmp_dir, manifest)
    final = Path(final) if final else tmp_dir.parent / tmp_dir.name.removeprefix(TEMP_PREFIX)
    if final.exists() or final.is_symlink():
        raise ValueError(f"{final} already exists; a checkpoint is never overwritten")
    os.rename(tmp_dir, final)  # fails too if another job created ``final`` meanwhile
    _fsync(tmp_dir.parent)
    return final


class Checkpoint:
    """A complete checkpoint directory, opened for reading any slice of any tensor."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no such checkpoint directory")
        manifest = manifest_file.read(self.path)
        self.meta: dict = manifest["meta"]
        self.files: dict = manifest["files"]
        self.tensors: dict = manifest["tensors"]
        self._open: dict = {}

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def verify(self) -> None:
        """Every listed file present, of its recorded size and checksum."""
        for name, info in self.files.items():
            path = self.path / name
            if not path.is_file():
                raise CheckpointError(f"{path}: missing from the checkpoint")
            size = path.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(
                    f"{path}: {size} bytes, the manifest says {info['bytes']} "
                    "(truncated or replaced)"
                )
            if _sha256(path) != info["sha256"]:
                raise CheckpointError(f"{path}: checksum mismatch (the file is damaged)")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def read_into(self, out: torch.Tensor, piece: Piece) -> None:
        """Fill flat ``out`` with the elements of ``piece`` from whatever pieces were stored."""
        entry = self._entry(piece.name)
        if tuple(entry["shape"]) != piece.shape:
            raise CheckpointError(
                f"{self.path}: {piece.name} has shape {tuple(entry['shape'])} "
                f"in the checkpoint but {piece.shape} in the model"
            )
        copied = 0
        for stored in entry["pieces"]:
            src_piece = Piece.from_dict(piece.name, piece.shape, stored)
            if not _may_overlap(piece, src_piece):
                continue
            src = self._handle(stored["file"]).get_tensor(stored["key"])
            copied += copy_overlap(out, piece, src.to(out.dtype), src_piece)
        if copied != piece.numel:
            raise CheckpointError(
                f"{self.path}: {piece.name} is incomplete ({copied} of "
                f"{piece.numel} wanted elements stored)"
            )

    def read(self, name: str) -> torch.Tensor:
        """The whole logical tensor ``name``."""
        piece = Piece.whole(name, self.shape(name))
        out = torch.empty(piece.numel, dtype=getattr(torch, self._entry(name)["dtype"]))
        self.read_into(out, piece)
        return out.view(piece.shape)

    def _entry(self, name: str) -> dict:
        if name not in self.tensors:
            raise CheckpointError(
                f"{self.path}: no tensor {name!r} (a checkpoint of another model?)"
            )
        return self.tensors[name]

    def _handle(self, file_name: str):
        from safetensors import safe_open

        if file_name not in self._open:
            path = self.path / file_name
            try:
                self._open[file_name] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: unreadable ({exc})") from None
        return self._open[file_name]


def complete_checkpoints(save_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``save_dir``, oldest first (temporary ones ignored)."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [
        (step_of(p), p)
        for p in root.iterdir()
        if step_of(p) is not None and (p / MANIFEST).is_file()
    ]
    return [p for _, p in sorted(found)]


def step_entries(save_dir: str | os.PathLike) -> list[Path]:
    """Every ``step-NNNNNNNN`` entry of ``save_dir``, complete or not, oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or the newest complete one of a ``--save`` directory."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: neither a checkpoint nor a directory holding one")
    return found[-1]


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """A checkpoint directory, or a ``--save`` directory's newest one, verified."""
    if not Path(path).exists():
        raise CheckpointError(f"{path}: no such file or directory")
    ckpt = Checkpoint(resolve(path))
    ckpt.verify()
    return ckpt


def _may_overlap(a: Piece, b: Piece) -> bool:
    for off_a, size_a, off_b, size_b in zip(a.box_offsets, a.box_sizes, b.box_offsets, b.box_sizes):
        if off_a + size_a <= off_b or off_b + size_b <= off_a:
            return False
    if a.box_offsets == b.box_offsets and a.box_sizes == b.box_sizes:
        return a.flat_start < b.flat_end and b.flat_start < a.flat_end
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
