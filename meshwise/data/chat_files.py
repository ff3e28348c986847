"""Chat token files: ``FILE.bin`` (sidecar with ``chat``: the template and counts),
``FILE.bin.labels`` (a byte per token, 1 for the assistant's) and ``FILE.bin.conversations``
(int64 pairs: each conversation's first token and its record's number from 0).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshwise.data.chat import chat_problem, render
from meshwise.data.chat_templates import ChatTemplate
from meshwise.data.progress import Progress
from meshwise.data.readers import ReadOptions, iter_records
from meshwise.data.records import DataFormatError, RecordCounts
from meshwise.data.token_files import TOKEN_DTYPES, _atomic_write, _write_meta, dtype_for_vocab
from meshwise.data.tokenizer import Tokenizer

logger = logging.getLogger("meshwise")

LABELS_SUFFIX = ".labels"
CONVERSATIONS_SUFFIX = ".conversations"


def labels_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + LABELS_SUFFIX)


def conversations_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + CONVERSATIONS_SUFFIX)


def _conversations(
    source: Path,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    options: ReadOptions,
    counts: RecordCounts,
):
    """``(record number, ids, assistant mask)`` of every good chat record."""
    records = iter_records(source, options.data_format, options.skip_bad_records, counts)
    for number, (location, record) in enumerate(records):
        problem = chat_problem(record)
        if problem is None:
            try:
                ids, assistant = render(template, tokenizer, record["messages"])
            except DataFormatError as exc:
                problem = str(exc)
        if problem is not None:
            if not options.skip_bad_records:
                raise DataFormatError(
                    f"{location}: {problem}; --skip-bad-records skips such records"
                )
            counts.records -= 1
            counts.skip(location, problem)
            continue
        yield number, ids, assistant


def build_chat_file(
    dest: Path,
    source: Path,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    options: ReadOptions = ReadOptions(),
) -> dict:
    """Render and encode every chat record of ``source`` into ``dest`` (with its labels,
    conversations and sidecar), atomically. Returns the counts: ``conversations``,
    ``num_tokens``, ``assistant_tokens``, ``skipped`` (a summary), ``dtype``, ``seconds``."""
    start, counts = time.perf_counter(), RecordCounts()
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    stats = {"conversations": 0, "assistant_tokens": 0, "dtype": dtype}
    starts: list[tuple[int, int]] = []
    fd, labels_tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    total_bytes = sum(
        f.stat().st_size
        for f in ([source] if source.is_file() else source.rglob("*"))
        if f.is_file()
    )
    bar = Progress(f"rendering {source}")

    def chunks():
        num_tokens = done = 0
        with os.fdopen(fd, "wb") as labels:
            for number, ids, assistant in _conversations(
                source, tokenizer, template, options, counts
            ):
                starts.append((num_tokens, number))
                labels.write(assistant.astype(np.uint8).tobytes())
                num_tokens += len(ids)
                stats["assistant_tokens"] += int(assistant.sum())
                done += 4 * len(ids)  # about the record's bytes: for the bar only
                bar.update(done, total_bytes, f"{len(starts):,} conversations")
                yield ids.astype(TOKEN_DTYPES[dtype]).tobytes()

    def finish(tmp: Path) -> None:
        stats["num_tokens"] = tmp.stat().st_size // TOKEN_DTYPES[dtype].itemsize
        stats["conversations"] = len(starts)
        if not starts:
            raise DataFormatError(f"{source} holds no chat record (records with 'messages')")
        os.replace(labels_tmp, labels_path(dest))
        _atomic_write(conversations_path(dest), [np.asarray(starts, np.int64).tobytes()])
        _write_meta(
            dest,
            {
                "num_tokens": stats["num_tokens"],
                "vocab_size": tokenizer.vocab_size,
                "max_token": None,
                "source": str(source),
                "dtype": dtype,
                "tokenizer": tokenizer.identity(),
                "data_format": options.data_format,
                "chat": {
                    "template": template.name,
                    "template_digest": template.digest,
                    "conversations": len(starts),
                    "assistant_tokens": stats["assistant_tokens"],
                },
            },
        )

    try:  # each file renamed once complete: the sidecar last but one, the tokens last
        _atomic_write(dest, chunks(), before_replace=finish)
    finally:
        bar.close()
        Path(labels_tmp).unlink(missing_ok=True)
    stats["skipped"] = counts.summary()
    stats["seconds"] = time.perf_counter() - start
    return stats


@dataclass(frozen=True)
class ChatFile:
    """An opened chat token file: ``labels`` (uint8 per token, memory-mapped), each
    conversation's first token (``starts``) and record number (``records``)."""

    labels: np.ndarray
    starts: np.ndarray
    records: np.ndarray
    num_tokens: int
    source: str
    data_format: str = "auto"

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.append(self.starts, self.num_tokens))


def open_chat_file(path: str | os.PathLike, meta: dict) -> ChatFile | None:
    """The chat side of a token file (None for one that is not chat), checked against
    its tokens."""
    if "chat" not in meta:
        return None
    num_tokens = meta["num_tokens"]
    labels_file, index_file = labels_path(path), conversations_path(path)
    for file in (labels_file, index_file):
        if not file.is_file():
            raise ValueError(
                f"{path} is a chat token file but {file} is missing; prepare it "
                "again (meshwise data prepare --format chat)"
            )
    index = np.fromfile(index_file, dtype=np.int64).reshape(-1, 2)
    if (
        labels_file.stat().st_size != num_tokens
        or not len(index)
        or index[0, 0] != 0
        or index[-1, 0] >= num_tokens
    ):
        raise ValueError(
            f"{path}: its labels or conversations do not match its {num_tokens} "
            "tokens (written by another run?); prepare it again"
        )
    labels = np.memmap(labels_file, dtype=np.uint8, mode="r")
    return ChatFile(
        labels,
        index[:, 0].copy(),
        index[:, 1].copy(),
        num_tokens,
        meta.get("source", str(path)),
        meta.get("data_format", "auto"),
    )


def resolve_chat_data(
    path: str | os.PathLike,
    cache_dir: str | os.PathLike | None,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    options: ReadOptions = ReadOptions(),
) -> Path:
    """The chat token file of the records under ``path``, rendered with ``template`` and
    encoded with ``tokenizer``, built once and cached (the key: the files' sizes and
    times, the tokenizer's and the template's digests)."""
    from meshwise.data.sources import _cached, _hash_key, default_cache_dir

    source = Path(path).expanduser().resolve()
    if not source.exists():
        raise ValueError(
            f"data path {str(path)!r} does not exist; expected chat records "
            "(JSON lines, Parquet, a datasets folder) with 'messages'"
        )
    files = [source] if source.is_file() else sorted(f for f in source.rglob("*") if f.is_file())
    key = _hash_key(
        [
            str(source),
            "chat",
            tokenizer.digest,
            template.digest,
            options.data_format,
            options.skip_bad_records,
        ]
        + [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    )
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    dest = cache / f"{source.stem or 'chat'}-chat-{key}.bin"

    def build() -> Path:
        stats = build_chat_file(dest, source, tokenizer, template, options)
        logger.info(
            "built chat data %s: %d conversations, %d tokens (%d assistant) in %.1f s%s",
            dest,
            stats["conversations"],
            stats["num_tokens"],
            stats["assistant_tokens"],
            stats["seconds"],
            f"; {stats['skipped']}" if stats["skipped"] else "",
        )
        return dest

    cache.mkdir(parents=True, exist_ok=True)
    return _cached(dest, build)


def record_location(source: str, number: int, data_format: str = "auto") -> str:
    """Where record ``number`` (from 0) of ``source`` is (``chat.jsonl:18``), read again;
    ``record N of SOURCE`` when the source cannot be read."""
    try:
        for i, (location, _) in enumerate(iter_records(source, data_format, True)):
            if i == number:
                return str(location)
    except (OSError, ValueError):
        pass
    return f"record {number + 1} of {source}"
