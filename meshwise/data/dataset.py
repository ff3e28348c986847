"""Corpora, token files and deterministic global batches.

A token file is a flat little-endian array of uint16 (or, past 65,536 ids,
uint32) token ids (``.bin``) with meshwise's JSON sidecar
(``meshwise.data.token_files``). ``resolve_data`` turns what the user gave (nothing,
a text file, a folder, a ``.bin``) into such a file: text is encoded with the
run's tokenizer (byte-level by default, ``meshwise.data.tokenizer``) by
``meshwise.data.corpus`` and cached once, atomically (temp file in the same folder,
then ``os.replace``), so concurrent builders or a crash never leave a
half-written file. Call it once before spawning ranks; every rank then opens
the result with ``TokenDataset``, which only memory-maps it.

Global batch ``step`` is drawn from ``numpy.random.default_rng([seed, step,
split_id])``: the same in every process and layout, and independent of how many
batches came before, so a resumed run sees exactly the batches it would have.
The trainer cuts each dp rank's contiguous rows with ``rank_slice``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from meshwise.data.corpus import build_token_file
from meshwise.data.files import file_problem, list_files
from meshwise.data.progress import Progress
# Re-exported: the token-file format is part of this module's interface.
from meshwise.data.token_files import (ACCEPTED, BYTE_VOCAB_SIZE, TOKEN_DTYPE,  # noqa: F401
                                       check_tokenizer, exclusive_build, largest_id, read_meta,
                                       recorded_tokenizer, resolve_vocab_size, sidecar_path)
from meshwise.data.token_files import token_dtype as dtype_of
from meshwise.data.tokenizer import BYTE_LEVEL, ByteTokenizer, Tokenizer

logger = logging.getLogger("meshwise")

SPLITS = {"train": 0, "val": 1}
VAL_MIN_SEQUENCES = 4  # the validation split holds at least this many windows


def default_cache_dir() -> Path:
    """``$MESHWISE_CACHE`` if set, else ``~/.cache/meshwise``."""
    return Path(os.environ.get("MESHWISE_CACHE") or "~/.cache/meshwise").expanduser()


def _hash_key(parts: Iterable[object]) -> str:
    """Short stable hash of the reprs of ``parts`` (a cache key)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode())
    return digest.hexdigest()[:16]


def _build_corpus(dest: Path, files: list[Path], source: str, tokenizer: Tokenizer,
                  num_workers: int) -> Path:
    """Build the token file ``dest`` (and sidecar) from text files, atomically."""
    stats = build_with_progress(dest, files, tokenizer, source, num_workers)
    logger.info("built corpus %s: %d tokens from %d files (%d binary skipped) in %.1f s",
                dest, stats["num_tokens"], stats["files"], stats["skipped"], stats["seconds"])
    return dest


def build_with_progress(dest: Path, files: list[Path], tokenizer: Tokenizer, source: str,
                        num_workers: int) -> dict:
    """``meshwise.data.corpus.build_token_file`` with its progress shown on stderr."""
    bar = Progress(f"tokenizing {source}")
    try:
        return build_token_file(dest, files, tokenizer, source, num_workers,
                                lambda done, total, tokens: bar.update(done, total,
                                                                       f"{tokens:,} tokens"))
    finally:
        bar.close()


def _cached(dest: Path, build) -> Path:
    """``dest`` if it is already built (with its sidecar), else ``build()``.

    Builders of the same file take turns on a lock file beside it, so processes
    started together (every rank of a torchrun node) tokenize once: the first
    builds, the others find its result.
    """
    if dest.is_file() and sidecar_path(dest).is_file():
        logger.info("using cached corpus %s", dest)
        return dest
    with exclusive_build(dest):
        if dest.is_file() and sidecar_path(dest).is_file():
            logger.info("using corpus %s, built by another process", dest)
            return dest
        return build()


def _stdlib_corpus(cache_dir: Path, tokenizer: Tokenizer, num_workers: int) -> Path:
    """The default corpus: the standard library's ``.py`` sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = frozenset({"site-packages", "__pycache__"})
    files = list_files(root, ".py", skip, strict=False)
    key = _hash_key(_tokenizer_key(tokenizer) + [(rel, (root / rel).stat().st_size)
                                                 for rel in files])
    dest = cache_dir / f"stdlib-{platform.python_version()}-{key}.bin"
    return _cached(dest, lambda: _build_corpus(dest, [root / rel for rel in files],
                                               f"stdlib:{root}", tokenizer, num_workers))


def _text_corpus(path: Path, cache_dir: Path, tokenizer: Tokenizer, num_workers: int) -> Path:
    """Tokens of one text file, or of every text file under a folder."""
    path = path.resolve()
    files = text_files(path)
    if path.is_dir():
        parts = [str(path)] + [(file.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns)
                               for file, st in ((file, file.stat()) for file in files)]
    else:
        st = path.stat()
        parts = [str(path), st.st_size, st.st_mtime_ns]
    key = _hash_key(_tokenizer_key(tokenizer) + parts)
    dest = cache_dir / f"{path.stem or 'corpus'}-{key}.bin"
    return _cached(dest, lambda: _build_corpus(dest, files, str(path), tokenizer, num_workers))


def _tokenizer_key(tokenizer: Tokenizer) -> list:
    """The tokenizer's part of a cache key: nothing for byte-level, so corpora
    cached before tokenizers existed keep their names."""
    if tokenizer.kind == BYTE_LEVEL:
        return []
    return [("tokenizer", tokenizer.digest, tuple(tokenizer.separator))]


def text_files(path: Path) -> list[Path]:
    """The documents of ``path``: the file itself, or every regular file under the folder
    (``ValueError`` naming a file that cannot be read)."""
    if not path.is_dir():
        problem = file_problem(path)
        if problem:
            raise ValueError(f"data path {str(path)!r} is {problem}; expected {ACCEPTED}")
        return [path]
    return [path / rel for rel in list_files(path, skip_dirs=frozenset({"__pycache__"}))]


def resolve_data(path: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None,
                 tokenizer: Tokenizer | None = None, num_workers: int = 1,
                 token_dtype: str | None = None) -> Path:
    """Path of the token ``.bin`` for ``path``, building and caching it if needed.

    ``None`` selects the default corpus (the standard library's sources); a text
    file or a folder of text files is encoded with ``tokenizer`` (default
    byte-level, vocab 256) by ``num_workers`` processes and cached in
    ``cache_dir`` (default ``default_cache_dir()``), the key including the
    tokenizer's digest; a ``.bin`` is used as is, after checking that
    ``tokenizer`` (when given) is the one that wrote it. Use ``read_meta`` on the
    result for its vocabulary size. Raises ValueError for a missing path, an
    empty corpus or another tokenizer's token file.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if path is not None:
        path = Path(path).expanduser()
        if not path.exists():
            what = "is a symbolic link to nothing" if path.is_symlink() else "does not exist"
            raise ValueError(f"data path {str(path)!r} {what}; expected {ACCEPTED}")
        if path.is_file() and path.suffix == ".bin":
            meta = read_meta(path, token_dtype)  # validates; writes the sidecar once if missing
            if tokenizer is not None:
                check_tokenizer(meta, tokenizer, path)
            return path
    tokenizer = tokenizer or ByteTokenizer()
    try:
        if path is None:
            return _stdlib_corpus(cache, tokenizer, num_workers)
        return _text_corpus(path, cache, tokenizer, num_workers)
    except OSError as exc:
        origin = ("--cache-dir" if cache_dir is not None else
                  "MESHWISE_CACHE" if os.environ.get("MESHWISE_CACHE") else "the default")
        raise ValueError(f"cannot build the corpus in the cache directory {cache} (from "
                         f"{origin}): {exc.strerror or exc}; point MESHWISE_CACHE or "
                         "--cache-dir at a writable folder") from None


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

    The file is read with the dtype its sidecar records (uint16 or uint32), or
    ``token_dtype`` for a file without one (``read_meta``).

    The last ``val_fraction`` of the tokens (at least ``VAL_MIN_SEQUENCES``
    windows' worth; none when ``val_fraction`` is 0) is the validation split;
    train windows end before it, so no train window overlaps it. Opening is
    cheap (a read-only memmap and the sidecar), and pickling reopens the file
    instead of copying it.
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, val_fraction: float = 0.01,
                 vocab_size: int = 0, token_dtype: str | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.path = Path(path)
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        meta = read_meta(self.path, token_dtype)
        # Every load checks the largest id against the vocabulary (a cached scan):
        # an id past it would train on garbage under some layouts and crash others.
        meta = {**meta, "max_token": largest_id(self.path, meta)}
        self.vocab_size: int = resolve_vocab_size(meta, vocab_size, self.path)
        self.dtype = dtype_of(meta)
        self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
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
        self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")

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
        return torch.from_numpy(self.global_windows(step, batch_size, seed, split))

    def global_windows(self, step: int, batch_size: int, seed: int,
                       split: str = "train") -> np.ndarray:
        """``global_batch`` as a host array (int64)."""
        starts = self.window_starts(step, batch_size, seed, split)
        window = self.seq_len + 1
        rows = np.empty((batch_size, window), dtype=np.int64)  # (B, T + 1)
        for row, start in enumerate(starts):
            rows[row] = self._tokens[start : start + window]
        return rows
