"""Token files: a flat little-endian array of ids (``.bin``: uint16 up to 65,536 ids, else
uint32) and meshwise's JSON sidecar ``<name>.bin.meshwise.json`` (keys at ``_write_meta``),
each written atomically (a temp file, then ``os.replace``). See docs/data.md.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from meshwise.data import file_lock, token_scan
from meshwise.data.tokenizer import BYTE_LEVEL, BYTE_VOCAB_SIZE, Tokenizer, load_unchanged

logger = logging.getLogger("meshwise")

FORMAT_VERSION = 2
WRITTEN_BY = "meshwise"
SIDECAR_SUFFIX = ".meshwise.json"  # corpus.bin -> corpus.bin.meshwise.json
TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TOKEN_DTYPE = TOKEN_DTYPES["uint16"]  # the default, and the only one before sidecars said
ACCEPTED = (
    "a text, JSON lines, Parquet or CSV file, a folder of them, a datasets "
    "save_to_disk folder, or a .bin of token ids (uint16 or uint32)"
)


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest token dtype that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def token_dtype(meta: dict) -> np.dtype:
    """The dtype a token file's metadata records (uint16 when it says none)."""
    name = meta.get("dtype") or "uint16"
    if name not in TOKEN_DTYPES:
        raise ValueError(
            f"{meta.get('source')}: its sidecar records token dtype {name!r}; "
            f"valid: {', '.join(TOKEN_DTYPES)}"
        )
    return TOKEN_DTYPES[name]


def sidecar_path(path: str | os.PathLike) -> Path:
    """Our JSON sidecar of a token file: ``corpus.bin`` -> ``corpus.bin.meshwise.json``."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _atomic_write(dest: Path, chunks: Iterable[bytes], before_replace=None) -> None:
    """Write ``chunks`` to a temp file next to ``dest``, fsync, then rename it over ``dest``.

    ``before_replace(tmp_path)`` runs once the data is complete; if it (or the
    write) raises, the temp file is removed and ``dest`` is left untouched.
    """
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); the result should have the
        # permissions any new file gets here, so other users' ranks can read it.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace(Path(tmp))
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def exclusive_build(dest: Path):
    """Build ``dest`` alone: hold the lock beside it (``.NAME.lock``, removed afterwards),
    and remove what builders of ``dest`` that died left (their temp files) first."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = dest.with_name(f".{dest.name}.lock")
    fd = file_lock.acquire(lock, wait=True)
    try:
        for stale in dest.parent.glob(f".{glob.escape(dest.name)}.*.tmp"):
            stale.unlink(missing_ok=True)
        yield
    finally:
        file_lock.release(lock, fd)


def _umask() -> int:
    """This process's umask (reading it means setting it; put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_meta(bin_path: Path, meta: dict) -> None:
    """Write the JSON sidecar of ``bin_path`` atomically."""
    # Keys: num_tokens, vocab_size (null for a .bin meshwise did not build), max_token as of
    # scanned (the file's size and mtime then), source, dtype, tokenizer, format, and
    # written_by: a sidecar meshwise did not write is never read or replaced.
    meta = {**meta, "format": FORMAT_VERSION, "written_by": WRITTEN_BY}
    _atomic_write(sidecar_path(bin_path), [json.dumps(meta, indent=1).encode()])


def _ours(side: Path) -> dict | None:
    """The sidecar's contents if meshwise wrote it; raise if the name is someone else's."""
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("written_by") != WRITTEN_BY:
        raise ValueError(
            f"{side} exists but was not written by meshwise; it is left alone: "
            "move or rename it so meshwise can record the token file's metadata"
        )
    return meta


def read_meta(path: str | os.PathLike, dtype: str | None = None) -> dict:
    """Metadata of a token file: its sidecar, or computed once from the tokens.

    ``dtype`` (``--token-dtype``) must agree with a sidecar that records one. Without a valid
    sidecar the file is scanned once; the result is written beside it where the folder
    allows, else kept in memory.
    """
    path = Path(path)
    check_regular(path)
    st = path.stat()
    side = sidecar_path(path)
    meta = _ours(side) if side.exists() else None
    recorded = (meta.get("dtype") or "uint16") if meta else None
    if recorded and dtype and recorded != dtype:
        raise ValueError(
            f"--token-dtype {dtype}, but {side} records {recorded} for {path}; "
            "valid: leave --token-dtype out"
        )
    name = recorded or dtype or _settled_dtype(path, st)
    itemsize = token_dtype({**(meta or {}), "dtype": name}).itemsize
    if st.st_size == 0 or st.st_size % itemsize:
        raise ValueError(
            f"token file {str(path)!r} has {st.st_size} bytes, not a non-empty "
            f"array of {name} tokens; expected {ACCEPTED}"
        )
    if meta is not None:
        if (
            meta.get("num_tokens") == st.st_size // itemsize
            and meta.get("format") == FORMAT_VERSION
        ):
            return meta
        if meta.get("tokenizer"):  # built from text: a rescan would lose what wrote it
            raise ValueError(
                f"token file {str(path)!r} has {st.st_size} bytes, but its sidecar "
                f"records {meta.get('num_tokens')} {name} tokens: it changed "
                "since meshwise wrote it; prepare it again"
            )
        logger.warning("rebuilding the stale sidecar %s", side)
    meta = {
        "num_tokens": st.st_size // itemsize,
        "vocab_size": None,
        "max_token": None,
        "source": str(path.resolve()),
        "dtype": name,
    }
    meta["max_token"] = largest_id(path, meta)
    return _remember(path, meta)


def check_regular(path: Path) -> None:
    """A token file must be a regular file (a FIFO would block its reader forever)."""
    if path.is_file():
        return
    if path.is_symlink() and not path.exists():
        raise ValueError(
            f"data path {str(path)!r} is a symbolic link to nothing (or a loop); "
            f"expected {ACCEPTED}"
        )
    if path.exists():
        raise ValueError(f"data path {str(path)!r} is not a regular file; expected {ACCEPTED}")
    raise ValueError(f"data path {str(path)!r} does not exist; expected {ACCEPTED}")


def _settled_dtype(path: Path, st: os.stat_result) -> str:
    """uint16 for a ``.bin`` without a sidecar, unless it could be uint32 (then refuse)."""
    share = token_scan.uint32_share(str(path.resolve()), st.st_size, st.st_mtime_ns)
    if share:
        raise ValueError(
            f"--data {path} has no meshwise sidecar and could hold uint16 or uint32 "
            f"ids (read as uint16, {share:.0%} of every other id is 0, as in a "
            "uint32 file); say which with --token-dtype uint16 or --token-dtype "
            "uint32"
        )
    return "uint16"


def largest_id(path: str | os.PathLike, meta: dict) -> int:
    """The largest id in the token file: the sidecar's while the file is unchanged, else
    scanned (and kept in the sidecar when it can be)."""
    path = Path(path)
    st = path.stat()
    scanned = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    if meta.get("max_token") is not None and meta.get("scanned") == scanned:
        return meta["max_token"]
    found = token_scan.max_token(
        str(path.resolve()), st.st_size, st.st_mtime_ns, token_dtype(meta).str
    )
    meta_now = {**meta, "max_token": found, "scanned": scanned}
    if meta.get("written_by") == WRITTEN_BY:  # our sidecar: keep the scan for the next load
        _remember(path, meta_now)
    else:
        meta["scanned"] = scanned
    return found


def _remember(path: Path, meta: dict) -> dict:
    """Write ``meta`` as the sidecar when the folder allows it; return it either way."""
    if os.access(path.parent, os.W_OK):
        try:
            _write_meta(path, meta)
        except OSError as err:  # a race or a read-only mount: keep it in memory
            logger.debug("could not write sidecar %s: %s", sidecar_path(path), err)
    return meta


def resolve_vocab_size(
    meta: dict, requested: int = 0, path: str | os.PathLike | None = None
) -> int:
    """The vocabulary a model of this data needs, checked against the tokens.

    ``requested`` (``--vocab-size``, 0 for none) must hold every id; else the sidecar's
    tokenizer vocabulary, or for a ``.bin`` of unknown origin its largest id + 1 within the
    byte default: past it the size must be stated, so a stray id cannot grow the model.
    """
    stated, max_token = meta.get("vocab_size"), meta.get("max_token")
    source = meta.get("source", "the data")
    name = path or f"the token file of {source}"  # the file given, not where it came from
    if stated and max_token is not None and max_token >= stated:
        raise ValueError(
            f"{name} holds token id {max_token}, outside the vocabulary of {stated} "
            "it was tokenized with: it changed since meshwise wrote it; prepare it "
            "again"
        )
    if requested:
        if max_token is not None and max_token >= requested:
            raise ValueError(
                f"{name} holds token id {max_token}, outside --vocab-size "
                f"{requested}; valid: --vocab-size {max_token + 1} or more"
            )
        if stated and requested < stated:
            raise ValueError(
                f"--vocab-size {requested} is smaller than the vocabulary of "
                f"{stated} that {name} was tokenized with; valid: --vocab-size "
                f"{stated} or more"
            )
        return requested
    if stated:
        return stated
    assert max_token is not None, "read_meta records the largest id of a file without a vocabulary"
    if max_token < BYTE_VOCAB_SIZE:
        return max_token + 1
    raise ValueError(
        f"{source} holds token ids up to {max_token}, beyond the byte-level "
        f"{BYTE_VOCAB_SIZE}; say the vocabulary with --vocab-size "
        f"(at least {max_token + 1})"
    )


def check_tokenizer(meta: dict, tokenizer: Tokenizer, data: str | os.PathLike) -> None:
    """A token file must have been written by ``tokenizer`` (``--tokenizer``).

    A ``.bin`` meshwise did not build records no tokenizer: its ids must then
    fit the tokenizer's vocabulary.
    """
    recorded = meta.get("tokenizer")
    if recorded is None and meta.get("vocab_size") == BYTE_VOCAB_SIZE:
        recorded = {"kind": BYTE_LEVEL, "digest": BYTE_LEVEL}  # built before sidecars said
    if recorded is None:
        max_token = meta.get("max_token")
        if max_token is not None and max_token >= tokenizer.vocab_size:
            raise ValueError(
                f"--data {data} holds token id {max_token}, outside the "
                f"vocabulary of --tokenizer {tokenizer.describe()}"
            )
        return
    if recorded.get("digest") != tokenizer.digest:
        if recorded.get("kind") == BYTE_LEVEL:
            theirs, valid = "byte-level", "no --tokenizer"
        else:
            theirs = f"{recorded.get('path')} (digest {recorded.get('digest')})"
            valid = f"--tokenizer {recorded.get('path')}"
        raise ValueError(
            f"--data {data} was tokenized with {theirs}, not with --tokenizer "
            f"{tokenizer.describe()}; valid: {valid}, or the text prepared "
            "again with this tokenizer"
        )


def recorded_tokenizer(bin_path: str | os.PathLike, dtype: str | None = None) -> Tokenizer | None:
    """The ``tokenizer.json`` a token file's sidecar names, if it is still there
    unchanged (same digest); None for byte-level data or one that cannot be found."""
    recorded = read_meta(bin_path, dtype).get("tokenizer") or {}
    if recorded.get("kind") == BYTE_LEVEL or not recorded.get("path"):
        return None
    tokenizer = load_unchanged(recorded["path"], recorded.get("digest"))
    if tokenizer is None:
        logger.warning(
            "warning: %s was tokenized with %s (digest %s), which is no longer "
            "there unchanged; pass --tokenizer to decode samples",
            bin_path,
            recorded["path"],
            recorded.get("digest"),
        )
        return None
    return tokenizer
