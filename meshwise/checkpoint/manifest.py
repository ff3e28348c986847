"""A checkpoint's ``manifest.json``: written with its own digest, read only when sound.

``manifest.sha256`` (written last) covers the manifest, which the per-file checksums do
not; reading checks it, then every key a loader uses (present, typed, in range), so
damage stops the job before any rank starts, not as a ``KeyError`` inside one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

FORMAT = "meshwise-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
DIGEST = "manifest.sha256"
DTYPES = (
    "float64",
    "float32",
    "bfloat16",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


def write(directory: Path, manifest: dict) -> None:
    """``manifest.json``, then its digest: a directory with both holds a sound manifest."""
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    write_atomic(directory / MANIFEST, data)
    write_atomic(directory / DIGEST, f"{hashlib.sha256(data).hexdigest()}  {MANIFEST}\n".encode())


def read(directory: Path) -> dict:
    """The manifest of ``directory``, its digest and shape checked (``CheckpointError``)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {directory} is not a complete checkpoint")
    try:
        data = path.read_bytes()
        manifest = json.loads(data)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    version = manifest.get("version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: version {version!r} is not one this meshwise reads "
            f"({', '.join(map(str, READABLE_VERSIONS))})"
        )
    if version >= 2:  # version 1 was written before the digest: its shape is still checked
        _check_digest(directory, data)
    try:
        validate(manifest)
    except (KeyError, TypeError, ValueError) as exc:
        reason = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise CheckpointError(f"{path}: damaged ({reason})") from None
    return manifest


def _check_digest(directory: Path, data: bytes) -> None:
    digest_path = directory / DIGEST
    try:
        recorded = digest_path.read_text().split()[0]
    except (OSError, ValueError, IndexError):
        raise CheckpointError(
            f"{digest_path}: missing or unreadable; {directory} is not a complete checkpoint"
        ) from None
    if recorded != hashlib.sha256(data).hexdigest():
        raise CheckpointError(
            f"{directory / MANIFEST}: checksum mismatch with {DIGEST} (the "
            "manifest or its digest is damaged)"
        )


def validate(manifest: dict) -> None:
    """Raise ``KeyError``/``TypeError``/``ValueError`` naming the first key out of shape."""
    meta, files, tensors = manifest["meta"], manifest["files"], manifest["tensors"]
    _require(
        isinstance(meta, dict) and isinstance(files, dict) and isinstance(tensors, dict),
        "meta, files and tensors must be objects",
    )
    for key in ("step", "optimizer_step"):
        if key in meta:
            _require(_is_int(meta[key]) and meta[key] >= 0, f"meta.{key} must be an integer >= 0")
    for key in ("model", "layout", "config", "lineage"):
        if key in meta:
            _require(isinstance(meta[key], dict), f"meta.{key} must be an object")
    for name, info in files.items():
        _require(bool(_FILE_NAME.match(name)), f"file name {name!r}")
        _require(_is_int(info["bytes"]) and info["bytes"] >= 0, f"files.{name}.bytes")
        _require(
            isinstance(info["sha256"], str) and bool(_SHA256.match(info["sha256"])),
            f"files.{name}.sha256",
        )
    for name, entry in tensors.items():
        _validate_tensor(name, entry, files)


def _validate_tensor(name: str, entry: dict, files: dict) -> None:
    shape = entry["shape"]
    _require(
        isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape),
        f"tensors.{name}.shape",
    )
    _require(entry["dtype"] in DTYPES, f"tensors.{name}.dtype {entry['dtype']!r}")
    _require(isinstance(entry["pieces"], list), f"tensors.{name}.pieces")
    stored = 0
    for piece in entry["pieces"]:
        where = f"a piece of tensors.{name}"
        _require(piece["file"] in files, f"{where} names an unlisted file {piece['file']!r}")
        _require(isinstance(piece["key"], str), f"{where}: key")
        offsets, sizes, flat = piece["box_offsets"], piece["box_sizes"], piece["flat"]
        for label, values in (("box_offsets", offsets), ("box_sizes", sizes)):
            _require(
                isinstance(values, list)
                and len(values) == len(shape)
                and all(_is_int(v) and v >= 0 for v in values),
                f"{where}: {label}",
            )
        _require(
            all(o + s <= d for o, s, d in zip(offsets, sizes, shape)),
            f"{where}: its box lies outside the shape {shape}",
        )
        _require(
            isinstance(flat, list)
            and len(flat) == 2
            and all(map(_is_int, flat))
            and 0 <= flat[0] <= flat[1] <= math.prod(sizes),
            f"{where}: flat {flat}",
        )
        stored += flat[1] - flat[0]
    _require(
        stored == math.prod(shape),
        f"tensors.{name}: its pieces hold {stored} elements of {math.prod(shape)}",
    )


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_meta(directory: Path) -> dict | None:
    """The run metadata of a checkpoint when its manifest is sound, else None (no error):
    for deciding which checkpoints a job may prune, where anything doubtful is kept."""
    try:
        return read(directory)["meta"]
    except CheckpointError:
        return None


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` in a temporary file beside ``path``, flushed to disk, renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
