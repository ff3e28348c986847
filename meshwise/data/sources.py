"""What the user gave as data, turned into a token file once before the ranks start, cached
atomically under a key of every file's name, size and mtime, its format, the tokenizer's
digest and the ``ReadOptions``; a ``.bin`` is used as is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sysconfig
from pathlib import Path
from typing import Iterable, Sequence

from meshwise.data.corpus import build_token_file
from meshwise.data.files import list_files
from meshwise.data.progress import Progress
from meshwise.data.readers import DataFile, ReadOptions, data_files
from meshwise.data.token_files import (
    ACCEPTED,
    check_tokenizer,
    exclusive_build,
    read_meta,
    sidecar_path,
)
from meshwise.data.tokenizer import BYTE_LEVEL, ByteTokenizer, Tokenizer

logger = logging.getLogger("meshwise")


def default_cache_dir() -> Path:
    """``$MESHWISE_CACHE`` if set, else ``~/.cache/meshwise``."""
    return Path(os.environ.get("MESHWISE_CACHE") or "~/.cache/meshwise").expanduser()


def _hash_key(parts: Iterable[object]) -> str:
    """Short stable hash of the reprs of ``parts`` (a cache key)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode())
    return digest.hexdigest()[:16]


def _build_corpus(
    dest: Path,
    files: Sequence[DataFile | Path],
    source: str,
    tokenizer: Tokenizer,
    num_workers: int,
    options: ReadOptions = ReadOptions(),
) -> Path:
    """Build the token file ``dest`` (and sidecar) from ``files``, atomically."""
    stats = build_with_progress(dest, files, tokenizer, source, num_workers, options)
    skipped = stats["records"].summary()
    logger.info(
        "built corpus %s: %d tokens from %d documents in %d files (%d binary skipped%s) in %.1f s",
        dest,
        stats["num_tokens"],
        stats["documents"],
        stats["files"],
        stats["skipped"],
        f"; {skipped}" if skipped else "",
        stats["seconds"],
    )
    return dest


def build_with_progress(
    dest: Path,
    files: Sequence[DataFile | Path],
    tokenizer: Tokenizer,
    source: str,
    num_workers: int,
    options: ReadOptions = ReadOptions(),
) -> dict:
    """``meshwise.data.corpus.build_token_file`` with its progress shown on stderr."""
    bar = Progress(f"tokenizing {source}")
    try:
        return build_token_file(
            dest,
            files,
            tokenizer,
            source,
            num_workers,
            lambda done, total, tokens: bar.update(done, total, f"{tokens:,} tokens"),
            options,
        )
    finally:
        bar.close()


def _cached(dest: Path, build) -> Path:
    """``dest`` if it is already built (with its sidecar), else ``build()``; builders take
    turns on a lock beside it, so ranks started together tokenize once.
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
    key = _hash_key(
        _tokenizer_key(tokenizer) + [(rel, (root / rel).stat().st_size) for rel in files]
    )
    dest = cache_dir / f"stdlib-{platform.python_version()}-{key}.bin"
    return _cached(
        dest,
        lambda: _build_corpus(
            dest, [root / rel for rel in files], f"stdlib:{root}", tokenizer, num_workers
        ),
    )


def _data_corpus(
    path: Path, cache_dir: Path, tokenizer: Tokenizer, num_workers: int, options: ReadOptions
) -> Path:
    """Tokens of a file, or of every file under a folder, in any format the readers know."""
    path = path.resolve()
    files = data_files(path, options.data_format)
    parts: list = [str(path)]
    for file in files:
        # A format other than text, and how records are read, are part of the key: a
        # corpus cached from a .jsonl read as text must never be found for its records.
        kind = [] if file.format in ("text", "binary") else [file.format]
        parts += [(rel, st.st_size, st.st_mtime_ns, *kind) for rel, st in _stats(path, file)]
    if options != ReadOptions():
        parts.append(("read", options.text_field, options.data_format, options.skip_bad_records))
    key = _hash_key(_tokenizer_key(tokenizer) + parts)
    dest = cache_dir / f"{path.stem or 'corpus'}-{key}.bin"
    return _cached(
        dest, lambda: _build_corpus(dest, files, str(path), tokenizer, num_workers, options)
    )


def _stats(root: Path, file: DataFile) -> Iterable[tuple[str, os.stat_result]]:
    """The relative name and stat of each file of ``file`` (a folder: the files in it)."""
    inside = (
        sorted(p for p in file.path.rglob("*") if p.is_file())
        if file.path.is_dir()
        else [file.path]
    )
    for p in inside:
        rel = p.relative_to(root).as_posix() if root.is_dir() else ""
        yield rel, p.stat()


def _tokenizer_key(tokenizer: Tokenizer) -> list:
    """The tokenizer's part of a cache key: nothing for byte-level, so corpora
    cached before tokenizers existed keep their names."""
    if tokenizer.kind == BYTE_LEVEL:
        return []
    return [("tokenizer", tokenizer.digest, tuple(tokenizer.separator))]


def resolve_data(
    path: str | os.PathLike | None,
    cache_dir: str | os.PathLike | None = None,
    tokenizer: Tokenizer | None = None,
    num_workers: int = 1,
    token_dtype: str | None = None,
    options: ReadOptions = ReadOptions(),
) -> Path:
    """Path of the token ``.bin`` for ``path``, building and caching it if needed.

    ``None`` is the default corpus; a file or folder the readers know is encoded with
    ``tokenizer`` (default byte-level) by ``num_workers`` processes into ``cache_dir``; a
    ``.bin`` is checked against ``tokenizer`` when given. Raises ValueError for a missing
    path, an empty corpus or another tokenizer's token file.
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
        return _data_corpus(path, cache, tokenizer, num_workers, options)
    except OSError as exc:
        origin = (
            "--cache-dir"
            if cache_dir is not None
            else "MESHWISE_CACHE"
            if os.environ.get("MESHWISE_CACHE")
            else "the default"
        )
        raise ValueError(
            f"cannot build the corpus in the cache directory {cache} (from "
            f"{origin}): {exc.strerror or exc}; point MESHWISE_CACHE or "
            "--cache-dir at a writable folder"
        ) from None
