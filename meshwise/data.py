"""Byte-level corpora, uint16 token files and deterministic global batches.

A token file is a flat little-endian uint16 array (``.bin``) with a JSON sidecar
``<name>.bin.meshwise.json`` holding ``{"num_tokens", "vocab_size", "max_token",
"source", "format", "written_by"}``. ``vocab_size`` is the tokenizer's when it is
known (256 for byte-level corpora) and ``null`` for a ``.bin`` meshwise did not
build; ``max_token`` is the largest id in the file when it was scanned. The
sidecar's name is ours alone and its ``written_by`` marks it: a file of that
name that meshwise did not write is never read or replaced.
``resolve_data`` turns what the user gave (nothing, a text file, a folder, a
``.bin``) into such a file, building and caching it once, atomically (temp file
in the same folder, then ``os.replace``), so concurrent builders or a crash never
leave a half-written file. Call it once before spawning ranks; every rank then
opens the result with ``TokenDataset``, which only memory-maps it.

Global batch ``step`` is drawn from ``numpy.random.default_rng([seed, step,
split_id])``: the same in every process and layout, and independent of how many
batches came before, so a resumed run sees exactly the batches it would have.
The trainer cuts each dp rank's contiguous rows with ``rank_slice``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sysconfig
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

logger = logging.getLogger("meshwise")

FORMAT_VERSION = 2
WRITTEN_BY = "meshwise"
TOKEN_DTYPE = np.dtype("<u2")
BYTE_VOCAB_SIZE = 256
ACCEPTED = "a text file, a folder of text files, or a .bin of uint16 tokens"
SPLITS = {"train": 0, "val": 1}
VAL_MIN_SEQUENCES = 4  # the validation split holds at least this many windows
_SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a file as binary
_SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning a .bin for its max token


def default_cache_dir() -> Path:
    """``$MESHWISE_CACHE`` if set, else ``~/.cache/meshwise``."""
    return Path(os.environ.get("MESHWISE_CACHE") or "~/.cache/meshwise").expanduser()


def sidecar_path(path: str | os.PathLike) -> Path:
    """Our JSON sidecar of a token file: ``corpus.bin`` -> ``corpus.bin.meshwise.json``."""
    path = Path(path)
    return path.with_name(path.name + ".meshwise.json")


def _atomic_write(dest: Path, chunks: Iterable[bytes], before_replace=None) -> None:
    """Write ``chunks`` to a temp file next to ``dest``, fsync, then rename it over ``dest``.

    ``before_replace(tmp_path)`` runs once the data is complete; if it (or the
    write) raises, the temp file is removed and ``dest`` is left untouched.
    """
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
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


def _write_meta(bin_path: Path, meta: dict) -> None:
    """Write the JSON sidecar of ``bin_path`` atomically."""
    meta = {**meta, "format": FORMAT_VERSION, "written_by": WRITTEN_BY}
    _atomic_write(sidecar_path(bin_path), [json.dumps(meta, indent=1).encode()])


def _ours(side: Path) -> dict | None:
    """The sidecar's contents if meshwise wrote it; raise if the name is someone else's."""
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("written_by") != WRITTEN_BY:
        raise ValueError(f"{side} exists but was not written by meshwise; it is left alone: "
                         "move or rename it so meshwise can record the token file's metadata")
    return meta


@lru_cache(maxsize=16)
def _scan_bin(path: str, size: int, mtime_ns: int) -> dict:
    """Metadata of a ``.bin`` without a sidecar: one chunked pass for the max token.

    Cached on (path, size, mtime): this is where the result lives when the
    sidecar cannot be written, and a rewritten file is scanned again.
    """
    tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    max_token = 0
    for start in range(0, len(tokens), _SCAN_CHUNK):
        max_token = max(max_token, int(tokens[start : start + _SCAN_CHUNK].max()))
    return {"num_tokens": len(tokens), "vocab_size": None, "max_token": max_token,
            "source": path}


def read_meta(path: str | os.PathLike) -> dict:
    """Metadata of a token file: its sidecar, or computed once from the tokens.

    Without a (valid) sidecar the file is scanned once for ``max token + 1``;
    the sidecar is then written next to it if that folder is writable, and
    otherwise the result is kept in memory for this process.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data path {str(path)!r} does not exist; expected {ACCEPTED}")
    st = path.stat()
    if st.st_size == 0 or st.st_size % TOKEN_DTYPE.itemsize:
        raise ValueError(f"token file {str(path)!r} has {st.st_size} bytes, not a non-empty "
                         f"array of uint16 tokens; expected {ACCEPTED}")
    side = sidecar_path(path)
    if side.exists():
        meta = _ours(side)
        if (meta.get("num_tokens") == st.st_size // TOKEN_DTYPE.itemsize
                and meta.get("format") == FORMAT_VERSION):
            return meta
        logger.warning("rebuilding the stale sidecar %s", side)
    meta = dict(_scan_bin(str(path.resolve()), st.st_size, st.st_mtime_ns))
    if os.access(path.parent, os.W_OK):
        try:
            _write_meta(path, meta)
        except OSError as err:  # a race or a read-only mount: keep it in memory
            logger.debug("could not write sidecar %s: %s", side, err)
    return meta


def _hash_key(parts: Iterable[object]) -> str:
    """Short stable hash of the reprs of ``parts`` (a cache key)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode())
    return digest.hexdigest()[:16]


def _list_files(root: Path, suffix: str = "", skip_dirs: frozenset = frozenset()) -> list[str]:
    """Sorted POSIX relative paths of the files under ``root`` (hidden entries skipped)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(root)
        found += [(rel_dir / f).as_posix() for f in filenames
                  if f.endswith(suffix) and not f.startswith(".")]
    return sorted(found)


def _read_text(path: Path) -> bytes | None:
    """The bytes of ``path``, or None when it looks binary (NUL in its first 8 KiB)."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
        return None if b"\0" in head else head + f.read()


def _as_tokens(contents: Iterable[bytes | None], stats: dict) -> Iterator[bytes]:
    """uint16 token bytes of ``b"\\n".join(contents)`` (None entries skipped), in one pass."""
    sep = np.frombuffer(b"\n", np.uint8).astype(TOKEN_DTYPE).tobytes()
    for data in contents:
        if data is None:
            stats["skipped"] += 1
            continue
        if stats["files"]:
            yield sep
        stats["files"] += 1
        stats["content_bytes"] += len(data)
        yield np.frombuffer(data, np.uint8).astype(TOKEN_DTYPE).tobytes()


def _build_bytes_corpus(dest: Path, contents: Iterable[bytes | None], source: str) -> Path:
    """Build the byte-level token file ``dest`` (and sidecar) from file contents, atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    stats = {"files": 0, "skipped": 0, "content_bytes": 0}
    start = time.perf_counter()

    def finish(tmp: Path) -> None:
        if stats["content_bytes"] == 0:
            raise ValueError(f"data path {source!r} holds no text (empty corpus or only "
                             f"binary files); expected {ACCEPTED}")
        stats["num_tokens"] = tmp.stat().st_size // TOKEN_DTYPE.itemsize
        # The sidecar goes first: a .bin present in the cache always has one.
        _write_meta(dest, {"num_tokens": stats["num_tokens"], "vocab_size": BYTE_VOCAB_SIZE,
                           "max_token": None, "source": source})

    _atomic_write(dest, _as_tokens(contents, stats), before_replace=finish)
    logger.info("built corpus %s: %d tokens from %d files (%d binary skipped) in %.1f s",
                dest, stats["num_tokens"], stats["files"], stats["skipped"],
                time.perf_counter() - start)
    return dest


def _cached(dest: Path, build) -> Path:
    """``dest`` if it is already built (with its sidecar), else ``build()``.

    Builders of the same file take turns on a lock file beside it, so processes
    started together (every rank of a torchrun node) tokenize once: the first
    builds, the others find its result.
    """
    if dest.is_file() and sidecar_path(dest).is_file():
        logger.info("using cached corpus %s", dest)
        return dest
    import fcntl

    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(f".{dest.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if dest.is_file() and sidecar_path(dest).is_file():
            logger.info("using corpus %s, built by another process", dest)
            return dest
        return build()


def _stdlib_corpus(cache_dir: Path) -> Path:
    """The default corpus: the standard library's ``.py`` sources, byte-level."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = frozenset({"site-packages", "__pycache__"})
    files = _list_files(root, ".py", skip)
    key = _hash_key((rel, (root / rel).stat().st_size) for rel in files)
    dest = cache_dir / f"stdlib-{platform.python_version()}-{key}.bin"
    return _cached(dest, lambda: _build_bytes_corpus(
        dest, ((root / rel).read_bytes() for rel in files), f"stdlib:{root}"))


def _text_corpus(path: Path, cache_dir: Path) -> Path:
    """Byte-level tokens of one text file, or of every text file under a folder."""
    path = path.resolve()
    if path.is_dir():
        files = _list_files(path, skip_dirs=frozenset({"__pycache__"}))
        stats = [(path / rel).stat() for rel in files]
        key = _hash_key([str(path)] + [(rel, st.st_size, st.st_mtime_ns)
                                       for rel, st in zip(files, stats)])
        contents = (_read_text(path / rel) for rel in files)
    else:
        st = path.stat()
        key = _hash_key((str(path), st.st_size, st.st_mtime_ns))
        contents = (_read_text(p) for p in [path])
    dest = cache_dir / f"{path.stem or 'corpus'}-{key}.bin"
    return _cached(dest, lambda: _build_bytes_corpus(dest, contents, str(path)))


def resolve_data(path: str | os.PathLike | None,
                 cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the token ``.bin`` for ``path``, building and caching it if needed.

    ``None`` selects the default corpus (the standard library's sources); a text
    file or a folder of text files is tokenized byte-level (vocab 256) and cached
    in ``cache_dir`` (default ``default_cache_dir()``); a ``.bin`` is used as is.
    Use ``read_meta`` on the result for its vocabulary size. Raises ValueError for
    a missing path or an empty corpus.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if path is not None:
        path = Path(path).expanduser()
        if not path.exists():
            raise ValueError(f"data path {str(path)!r} does not exist; expected {ACCEPTED}")
        if path.is_file() and path.suffix == ".bin":
            read_meta(path)  # validates, and writes the sidecar once if missing
            return path
    try:
        return _stdlib_corpus(cache) if path is None else _text_corpus(path, cache)
    except OSError as exc:
        origin = ("--cache-dir" if cache_dir is not None else
                  "MESHWISE_CACHE" if os.environ.get("MESHWISE_CACHE") else "the default")
        raise ValueError(f"cannot build the corpus in the cache directory {cache} (from "
                         f"{origin}): {exc.strerror or exc}; point MESHWISE_CACHE or "
                         "--cache-dir at a writable folder") from None


def resolve_vocab_size(meta: dict, requested: int = 0) -> int:
    """The vocabulary a model of this data needs, checked against the tokens.

    ``requested`` (``--vocab-size``, 0 for none) wins when given; it must hold
    every token id. Without it: the tokenizer's vocabulary from the sidecar, or
    for a ``.bin`` of unknown origin its largest id + 1 while that stays within
    the byte default; past it the vocabulary must be stated, so a stray large id
    cannot silently grow the model.
    """
    stated, max_token = meta.get("vocab_size"), meta.get("max_token")
    source = meta.get("source", "the data")
    if requested:
        if max_token is not None and max_token >= requested:
            raise ValueError(f"{source} holds token id {max_token}, outside --vocab-size "
                             f"{requested}; valid: --vocab-size {max_token + 1} or more")
        if stated and requested < stated:
            raise ValueError(f"--vocab-size {requested} is smaller than the vocabulary of "
                             f"{stated} the data was tokenized with")
        return requested
    if stated:
        return stated
    if max_token < BYTE_VOCAB_SIZE:
        return max_token + 1
    raise ValueError(f"{source} holds token ids up to {max_token}, beyond the byte-level "
                     f"{BYTE_VOCAB_SIZE}; say the vocabulary with --vocab-size "
                     f"(at least {max_token + 1})")


def rank_slice(batch: torch.Tensor, rank: int, num_ranks: int) -> torch.Tensor:
    """Rows ``[rank * B/num_ranks, (rank + 1) * B/num_ranks)`` of a global batch (a view)."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
    if batch.shape[0] % num_ranks:
        raise ValueError(f"batch size {batch.shape[0]} is not divisible by {num_ranks} ranks")
    rows = batch.shape[0] // num_ranks
    return batch[rank * rows : (rank + 1) * rows]


class TokenDataset:
    """Random windows of ``seq_len + 1`` tokens from a memory-mapped token file.

    The last ``val_fraction`` of the tokens (at least ``VAL_MIN_SEQUENCES``
    windows' worth; none when ``val_fraction`` is 0) is the validation split;
    train windows end before it, so no train window overlaps it. Opening is
    cheap (a read-only memmap and the sidecar), and pickling reopens the file
    instead of copying it.
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, val_fraction: float = 0.01,
                 vocab_size: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.path = Path(path)
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        meta = read_meta(self.path)
        self.vocab_size: int = resolve_vocab_size(meta, vocab_size)
        self._tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
        window = seq_len + 1
        num_tokens = len(self._tokens)
        num_val = 0
        if val_fraction > 0:
            num_val = max(int(num_tokens * val_fraction), VAL_MIN_SEQUENCES * window)
        self.num_train_tokens = num_tokens - num_val
        self.num_val_tokens = num_val
        if self.num_train_tokens < window:
            need = window + (VAL_MIN_SEQUENCES * window if val_fraction > 0 else 0)
            raise ValueError(
                f"the corpus {meta.get('source') or str(self.path)!r} has {num_tokens} tokens; "
                f"--seq-len {seq_len} needs at least {need} ({VAL_MIN_SEQUENCES} held-out "
                f"windows and one training window of seq_len + 1 tokens)")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_tokens"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")

    def _split_range(self, split: str) -> tuple[int, int]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
        if split == "train":
            return 0, self.num_train_tokens
        if self.num_val_tokens == 0:
            raise ValueError("no validation split: this dataset has val_fraction=0")
        return self.num_train_tokens, self.num_train_tokens + self.num_val_tokens

    def window_starts(self, step: int, batch_size: int, seed: int,
                      split: str = "train") -> np.ndarray:
        """Token offsets of the ``batch_size`` windows of global batch ``step``."""
        for name, value in (("step", step), ("seed", seed)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        lo, hi = self._split_range(split)
        rng = np.random.default_rng([seed, step, SPLITS[split]])
        # A window [s, s + seq_len] must end inside the split: s <= hi - seq_len - 1.
        return lo + rng.integers(0, hi - lo - self.seq_len, size=batch_size)

    def global_batch(self, step: int, batch_size: int, seed: int,
                     split: str = "train") -> torch.Tensor:
        """Global batch ``step`` as an int64 tensor of shape (batch_size, seq_len + 1).

        Inputs are ``batch[:, :-1]`` and targets ``batch[:, 1:]``. Only the chosen
        windows are read from the memmap.
        """
        starts = self.window_starts(step, batch_size, seed, split)
        window = self.seq_len + 1
        rows = np.empty((batch_size, window), dtype=np.int64)  # (B, T + 1)
        for row, start in enumerate(starts):
            rows[row] = self._tokens[start : start + window]
        return torch.from_numpy(rows)
