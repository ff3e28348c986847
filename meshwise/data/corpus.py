"""Token files built from documents by worker processes: tasks of about ``TASK_BYTES`` (long
texts cut where the tokenizer cuts cleanly, JSON lines by ranges of whole lines), written
in task order, so the tokens are those of each document encoded whole whatever the
workers. See docs/data.md.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from meshwise.data import tables
from meshwise.data.files import SNIFF_BYTES
from meshwise.data.readers import DataFile, ReadOptions, RecordCounts
from meshwise.data.records import jsonl_documents, jsonl_ranges
from meshwise.data.token_files import (
    ACCEPTED,
    TOKEN_DTYPES,
    _atomic_write,
    _write_meta,
    dtype_for_vocab,
)
from meshwise.data.tokenizer import Tokenizer, load_tokenizer
from meshwise.data.workers import ordered_results

logger = logging.getLogger("meshwise")

PIECE_BYTES = 1 << 18  # a long document, or a JSON-lines file, is cut about every 256 KiB
TASK_BYTES = 1 << 20  # what one worker encodes per round trip
_CUT_WINDOW = 1 << 16  # bytes searched at a time for a cut
_CONTEXT = 256  # bytes either side of a candidate cut that are encoded to check it
_MAX_CUT_TRIES = 32  # candidates checked per window before moving on


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of the file ``path``: of a text document (``first``: it
    starts here), or whole lines of a JSON-lines file (``records``: each a document)."""

    path: str
    start: int
    end: int
    first: bool
    records: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Texts:
    """Documents read here (rows of a columnar source); ``size``: the bytes of the
    source they stand for (progress)."""

    texts: tuple[str, ...]
    size: int


@dataclass
class Encoded:
    """A task's tokens, its documents joined by separators; ``starts``: whether its
    first item starts a document (a separator goes before it, unless it is the first)."""

    tokens: np.ndarray
    starts: bool
    documents: int
    counts: RecordCounts = field(default_factory=RecordCounts)


def plan_pieces(files: Iterable[Path], tokenizer: Tokenizer) -> tuple[list[Piece], dict]:
    """Every text document's pieces, in order, and counts: ``files``, ``skipped``
    (binary), ``content_bytes``."""
    pieces: list[Piece] = []
    stats = {"files": 0, "skipped": 0, "content_bytes": 0}
    for path in files:
        with open(path, "rb") as f:
            if b"\0" in f.read(SNIFF_BYTES):
                stats["skipped"] += 1
                continue
            size = os.fstat(f.fileno()).st_size
            cut = size > PIECE_BYTES and tokenizer.splits_at_lines
            cuts = _line_cuts(f, size, tokenizer) if cut else []
        bounds = [0, *cuts, size]  # an empty file is one empty piece: still a document
        pieces += [
            Piece(str(path), start, end, i == 0)
            for i, (start, end) in enumerate(zip(bounds, bounds[1:]))
        ]
        stats["files"] += 1
        stats["content_bytes"] += size
    return pieces, stats


def _line_cuts(f, size: int, tokenizer: Tokenizer) -> list[int]:
    """Offsets where a piece may start, about every ``PIECE_BYTES``: just after a
    ``\n`` where the tokenizer gives the same tokens cut as whole, judged on
    ``_CONTEXT`` bytes either side (its pre-tokenizer's words are shorter)."""
    cuts, target = [], PIECE_BYTES
    while target < size:
        base = target - _CONTEXT
        f.seek(base)
        window = f.read(_CONTEXT + _CUT_WINDOW + _CONTEXT)  # index i is offset base + i
        cut = _first_clean_cut(window, tokenizer)
        if cut is None:  # nothing here (or the file ends): try the next stretch
            target += _CUT_WINDOW
            continue
        cuts.append(base + cut)
        target = base + cut + PIECE_BYTES
    return cuts


def _first_clean_cut(window: bytes, tokenizer: Tokenizer) -> int | None:
    """Index just after the first ``\n`` of ``window``'s middle that cuts cleanly."""
    end = len(window) - _CONTEXT
    pos = window.find(b"\n", _CONTEXT - 1, end)
    for _ in range(_MAX_CUT_TRIES):
        if pos == -1:
            return None
        if tokenizer.cuts_cleanly(
            window[pos + 1 - _CONTEXT : pos + 1], window[pos + 1 : pos + 1 + _CONTEXT]
        ):
            return pos + 1
        pos = window.find(b"\n", pos + 1, end)
    return None


def source_bytes(file: DataFile) -> int:
    """The bytes of a source on disk (a ``save_to_disk`` folder: its files')."""
    if file.path.is_dir():
        return sum(p.stat().st_size for p in file.path.rglob("*") if p.is_file())
    return file.path.stat().st_size


def plan_items(
    files: list[DataFile], tokenizer: Tokenizer, options: ReadOptions, counts: RecordCounts
) -> tuple[Iterator[Piece | Texts], dict]:
    """The work, in document order (columnar sources are read as it is consumed), and
    counts: ``files``, ``skipped`` (binary), ``content_bytes``."""
    stats = {"files": 0, "skipped": 0, "content_bytes": 0}
    parts: list[Iterable[Piece | Texts]] = []
    for file in files:
        if file.format in ("text", "binary"):
            pieces, found = plan_pieces([file.path], tokenizer)
            for key in stats:
                stats[key] += found[key]
            parts.append(pieces)
            continue
        size = source_bytes(file)
        stats["files"] += 1
        stats["content_bytes"] += size
        if file.format == "jsonl":
            parts.append(
                [
                    Piece(str(file.path), start, end, True, records=True)
                    for start, end in jsonl_ranges(file.path, size, PIECE_BYTES)
                ]
            )
        else:
            parts.append(_read_texts(file, size, options, counts))
    return itertools.chain.from_iterable(parts), stats


def _read_texts(
    file: DataFile, size: int, options: ReadOptions, counts: RecordCounts
) -> Iterator[Texts]:
    """A columnar source's documents, read here in batches of about ``PIECE_BYTES``;
    each stands for the source's bytes in proportion to its rows, where their number
    is known."""
    rows = tables.row_count(file.path, file.format)
    mine = RecordCounts()
    batch: list[str] = []
    batch_chars = done = 0
    documents = tables.documents(
        file.path, file.format, options.text_field, options.skip_bad_records, mine
    )
    for text in itertools.chain(documents, [None]):
        if text is not None:
            batch.append(text)
            batch_chars += len(text)
        if batch and (text is None or batch_chars >= PIECE_BYTES):
            read = size * (mine.records + mine.skipped) // rows if rows else done + batch_chars
            reached = size if text is None else min(read, size)
            yield Texts(tuple(batch), max(reached - done, 0))
            done = max(reached, done)
            batch, batch_chars = [], 0
    counts.merge(mine)


def _tasks(items: Iterable[Piece | Texts]) -> Iterator[list[Piece | Texts]]:
    """Consecutive items grouped into tasks of about ``TASK_BYTES``."""
    current, size = [], 0
    for item in items:
        current.append(item)
        size += item.size if isinstance(item, Piece) else sum(map(len, item.texts))
        if size >= TASK_BYTES:
            yield current
            current, size = [], 0
    if current:
        yield current


def encode_task(
    tokenizer_path: str | None, dtype: str, options: ReadOptions, task: list[Piece | Texts]
) -> Encoded:
    """The tokens of ``task``'s documents, joined by separators (runs in a worker, or
    in-process)."""
    counts = RecordCounts()
    parts: list[tuple[bool, bytes | str]] = []
    for item in task:
        if isinstance(item, Texts):
            parts += [(True, text) for text in item.texts]
        elif item.records:
            parts += [
                (True, text)
                for text in jsonl_documents(
                    Path(item.path),
                    item.start,
                    item.end,
                    options.text_field,
                    options.skip_bad_records,
                    counts,
                    first_line=None,
                )
            ]
        else:
            parts.append((item.first, read_piece(item)))
    tokenizer = load_tokenizer(tokenizer_path)  # cached: parsed once per process
    separator = np.asarray(tokenizer.separator, TOKEN_DTYPES[dtype])
    arrays = []
    for i, ((starts, _), ids) in enumerate(
        zip(parts, tokenizer.encode_documents([data for _, data in parts]))
    ):
        if starts and i:
            arrays.append(separator)
        arrays.append(ids.astype(TOKEN_DTYPES[dtype]))
    tokens = np.concatenate(arrays) if arrays else np.empty(0, TOKEN_DTYPES[dtype])
    return Encoded(tokens, bool(parts) and parts[0][0], sum(s for s, _ in parts), counts)


def read_piece(piece: Piece) -> bytes:
    """The bytes of ``piece``."""
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        return f.read(piece.end - piece.start)


def build_token_file(
    dest: Path,
    files: Sequence[DataFile | Path],
    tokenizer: Tokenizer,
    source: str,
    num_workers: int = 1,
    progress: Callable[[int, int, int], None] | None = None,
    options: ReadOptions = ReadOptions(),
) -> dict:
    """Encode ``files`` (a plain ``Path`` is a text file) into the token file ``dest``
    and its sidecar, atomically.

    ``progress(done_bytes, total_bytes, num_tokens)`` is called after each task.
    Returns the counts (``files``, ``skipped``, ``content_bytes``, ``documents``,
    ``num_tokens``, ``dtype``, ``seconds``, ``records``: a ``RecordCounts``). Raises
    ValueError when there is nothing to encode, or for bad records (unless
    ``options.skip_bad_records``).
    """
    if num_workers < 1:
        raise ValueError(f"--workers must be >= 1, got {num_workers}")
    start = time.perf_counter()
    listed = [f if isinstance(f, DataFile) else DataFile(Path(f), "text") for f in files]
    counts = RecordCounts()
    items, stats = plan_items(listed, tokenizer, options, counts)
    if stats["content_bytes"] == 0:
        raise ValueError(
            f"data path {source!r} holds no text (empty corpus or only binary "
            f"files); expected {ACCEPTED}"
        )
    dtype = stats["dtype"] = dtype_for_vocab(tokenizer.vocab_size)
    separator = np.asarray(tokenizer.separator, TOKEN_DTYPES[dtype]).tobytes()
    tasks = _tasks(items)
    small = stats["content_bytes"] <= TASK_BYTES
    stats["documents"] = 0

    def chunks() -> Iterator[bytes]:
        done = num_tokens = 0
        encode = partial(encode_task, tokenizer.path, dtype, options)
        for task, encoded in ordered_results(encode, tasks, num_workers, in_process=small):
            if encoded.starts and stats["documents"]:
                yield separator
                num_tokens += len(tokenizer.separator)
            yield encoded.tokens.tobytes()
            num_tokens += len(encoded.tokens)
            stats["documents"] += encoded.documents
            counts.merge(encoded.counts)
            done += sum(item.size for item in task)
            if progress is not None:
                progress(done, stats["content_bytes"], num_tokens)

    def finish(tmp: Path) -> None:
        stats["num_tokens"] = tmp.stat().st_size // TOKEN_DTYPES[dtype].itemsize
        if not stats["num_tokens"]:
            raise ValueError(
                f"data path {source!r} holds no text: {stats['documents']} "
                f"documents, all empty{_skipped(counts)}"
            )
        # The sidecar goes first: a .bin present in a cache always has one.
        _write_meta(
            dest,
            {
                "num_tokens": stats["num_tokens"],
                "vocab_size": tokenizer.vocab_size,
                "max_token": None,
                "source": source,
                "dtype": dtype,
                "tokenizer": tokenizer.identity(),
            },
        )

    dest.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(dest, chunks(), before_replace=finish)
    stats["seconds"] = time.perf_counter() - start
    stats["records"] = counts
    return stats


def _skipped(counts: RecordCounts) -> str:
    return f"; {counts.summary()}" if counts.skipped else ""
