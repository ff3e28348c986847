"""Token files built from text: documents encoded by worker processes, written in order.

A corpus is a sorted list of documents, one per text file (a file with a NUL
byte in its first 8 KiB is binary and skipped). Documents are joined by the
tokenizer's ``separator``. A document longer than ``PIECE_BYTES`` is cut into
pieces just after line breaks where the tokenizer gives the same tokens cut as
whole (checked at each cut), when it ``splits_at_lines``; pieces are grouped
into tasks of about ``TASK_BYTES`` for the workers. Results are written
in task order, so the file holds exactly the tokens of encoding every document
whole, whatever the number of workers.

Workers are forked where the platform allows it: they start in milliseconds
(a spawned one would import torch through the package first) and find the
tokenizer by its path, each parsing it once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from meshwise.data.files import SNIFF_BYTES
from meshwise.data.token_files import (ACCEPTED, TOKEN_DTYPES, _atomic_write,
                                  _write_meta, dtype_for_vocab)
from meshwise.data.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("meshwise")

PIECE_BYTES = 1 << 18  # a long document is cut about every 256 KiB
TASK_BYTES = 1 << 20  # what one worker encodes per round trip
_CUT_WINDOW = 1 << 16  # bytes searched at a time for a cut
_CONTEXT = 256  # bytes either side of a candidate cut that are encoded to check it
_MAX_CUT_TRIES = 32  # candidates checked per window before moving on


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of the file ``path``; ``first``: its document starts here."""

    path: str
    start: int
    end: int
    first: bool


def plan_pieces(files: list[Path], tokenizer: Tokenizer) -> tuple[list[Piece], dict]:
    """Every document's pieces, in order, and counts: ``files``, ``skipped``, ``content_bytes``."""
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
        pieces += [Piece(str(path), start, end, i == 0)
                   for i, (start, end) in enumerate(zip(bounds, bounds[1:]))]
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
        if tokenizer.cuts_cleanly(window[pos + 1 - _CONTEXT:pos + 1],
                                  window[pos + 1:pos + 1 + _CONTEXT]):
            return pos + 1
        pos = window.find(b"\n", pos + 1, end)
    return None


def _tasks(pieces: list[Piece]) -> list[list[Piece]]:
    """Consecutive pieces grouped into tasks of about ``TASK_BYTES``."""
    tasks, current, size = [], [], 0
    for piece in pieces:
        current.append(piece)
        size += piece.end - piece.start
        if size >= TASK_BYTES:
            tasks.append(current)
            current, size = [], 0
    return tasks + [current] if current else tasks


def _encode_task(tokenizer_path: str | None, dtype: str, task: list[Piece]) -> list[np.ndarray]:
    """Token ids of each piece of ``task`` (runs in a worker, or in-process)."""
    data = [read_piece(piece) for piece in task]
    tokenizer = load_tokenizer(tokenizer_path)  # cached: parsed once per process
    return [ids.astype(TOKEN_DTYPES[dtype]) for ids in tokenizer.encode_documents(data)]


def read_piece(piece: Piece) -> bytes:
    """The bytes of ``piece``."""
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        return f.read(piece.end - piece.start)


def _worker_init() -> None:
    # Ctrl-C reaches the whole process group: the parent stops the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encoded(tokenizer: Tokenizer, dtype: str, tasks: list[list[Piece]],
             num_workers: int) -> Iterator[list[np.ndarray]]:
    """Each task's token arrays, in task order; at most 2 tasks per worker in flight.

    Only a small job is encoded in this process: a tokenizer busy in native code
    cannot be interrupted, so anything longer runs in workers, and Ctrl-C or
    SIGTERM here ends them at once (their work is lost anyway).
    """
    if len(tasks) <= 1 and sum(p.end - p.start for t in tasks for p in t) <= TASK_BYTES:
        for task in tasks:
            yield _encode_task(tokenizer.path, dtype, task)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    pool = ProcessPoolExecutor(num_workers, mp_context=context, initializer=_worker_init)
    finished = False
    try:
        todo = iter(tasks)
        pending = deque(pool.submit(_encode_task, tokenizer.path, dtype, task)
                        for _, task in zip(range(2 * num_workers), todo))
        while pending:
            result = pending.popleft().result()
            task = next(todo, None)
            if task is not None:
                pending.append(pool.submit(_encode_task, tokenizer.path, dtype, task))
            yield result
        finished = True
    finally:
        if not finished:  # interrupted, or a task failed: do not wait for the others
            _stop_workers(pool)
        pool.shutdown(wait=True, cancel_futures=True)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Kill the pool's worker processes (the executor has no public way before 3.14)."""
    kill = getattr(pool, "kill_workers", None)
    if kill is not None:
        kill()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()


def build_token_file(dest: Path, files: list[Path], tokenizer: Tokenizer, source: str,
                     num_workers: int = 1,
                     progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Encode ``files`` into the token file ``dest`` and its sidecar, atomically.

    ``progress(done_bytes, total_bytes, num_tokens)`` is called after each task.
    Returns the counts (``files``, ``skipped``, ``content_bytes``, ``num_tokens``,
    ``dtype``, ``seconds``). Raises ValueError when there is no text to encode.
    """
    if num_workers < 1:
        raise ValueError(f"--workers must be >= 1, got {num_workers}")
    start = time.perf_counter()
    pieces, stats = plan_pieces(files, tokenizer)
    if stats["content_bytes"] == 0:
        raise ValueError(f"data path {source!r} holds no text (empty corpus or only binary "
                         f"files); expected {ACCEPTED}")
    dtype = stats["dtype"] = dtype_for_vocab(tokenizer.vocab_size)
    separator = np.asarray(tokenizer.separator, TOKEN_DTYPES[dtype]).tobytes()
    tasks = _tasks(pieces)

    def chunks() -> Iterator[bytes]:
        done = num_tokens = 0
        for task, arrays in zip(tasks, _encoded(tokenizer, dtype, tasks, num_workers)):
            for piece, ids in zip(task, arrays):
                if piece.first and piece is not pieces[0]:
                    yield separator
                    num_tokens += len(tokenizer.separator)
                yield ids.tobytes()
                num_tokens += len(ids)
                done += piece.end - piece.start
            if progress is not None:
                progress(done, stats["content_bytes"], num_tokens)

    def finish(tmp: Path) -> None:
        stats["num_tokens"] = tmp.stat().st_size // TOKEN_DTYPES[dtype].itemsize
        # The sidecar goes first: a .bin present in a cache always has one.
        _write_meta(dest, {"num_tokens": stats["num_tokens"], "vocab_size": tokenizer.vocab_size,
                           "max_token": None, "source": source, "dtype": dtype,
                           "tokenizer": tokenizer.identity()})

    dest.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(dest, chunks(), before_replace=finish)
    stats["seconds"] = time.perf_counter() - start
    return stats
