"""What every reader shares: ``DataFormatError``, ``RecordCounts``, ``document_text``;
and the JSON-lines reader, from any byte range that starts at a line (``jsonl_ranges``).

A line's number is counted from the file's start only when a message names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

MAX_NAMED_FIELDS = 12
MAX_NAMED_SKIPS = 3


class DataFormatError(ValueError):
    """Data that cannot be read as asked; the message is one line naming the place."""


@dataclass
class RecordCounts:
    """Records read and bad ones skipped (``skip_bad_records``), with the first few named:
    ``(location, problem)``, a location printed only in ``summary`` (a worker's
    ``LineLocation`` counts the lines before it then, for three records at most)."""

    records: int = 0
    skipped: int = 0
    skipped_at: list[tuple[object, str]] = field(default_factory=list)

    def skip(self, location, problem: str) -> None:
        self.skipped += 1
        if len(self.skipped_at) < MAX_NAMED_SKIPS:
            self.skipped_at.append((location, problem))

    def merge(self, other: "RecordCounts") -> None:
        self.records += other.records
        self.skipped += other.skipped
        self.skipped_at += other.skipped_at[: MAX_NAMED_SKIPS - len(self.skipped_at)]

    def summary(self) -> str:
        """``""``, or what was skipped: ``2 bad records skipped (a.jsonl:3: ...; ...)``."""
        if not self.skipped:
            return ""
        named = "; ".join(f"{location}: {problem}" for location, problem in self.skipped_at)
        more = "; ..." if self.skipped > MAX_NAMED_SKIPS else ""
        return (
            f"{self.skipped:,} bad record{'s' if self.skipped > 1 else ''} skipped ({named}{more})"
        )


def text_problem(record: dict, text_field: str) -> str | None:
    """Why ``record`` has no text in ``text_field`` (naming the fields it has), or None."""
    value = record.get(text_field)
    if isinstance(value, str):
        return None
    if text_field not in record:
        fields = list(record)
        named = ", ".join(fields[:MAX_NAMED_FIELDS]) + (
            ", ..." if len(fields) > MAX_NAMED_FIELDS else ""
        )
        chat = ", or --format chat for chat records" if "messages" in record else ""
        return (
            f"the record has no field {text_field!r} (its fields: {named or 'none'}); "
            f"name the text's field with --text-field{chat}"
        )
    return (
        f"field {text_field!r} is {'null' if value is None else type(value).__name__}, not a string"
    )


def document_text(location, record: dict, text_field: str) -> str:
    """``record[text_field]``, a string, or ``DataFormatError`` naming the location and
    what is there."""
    problem = text_problem(record, text_field)
    if problem:
        raise DataFormatError(f"{location}: {problem}")
    return record[text_field]


# ----------------------------------------------------------------- JSON lines
def jsonl_records(
    path: Path,
    start: int = 0,
    end: int | None = None,
    skip_bad_records: bool = False,
    counts: RecordCounts | None = None,
    first_line: int | None = 1,
) -> Iterator[tuple[str | LineLocation, dict]]:
    """``(location, record)`` for the lines in bytes ``[start, end)`` of a JSON-lines file
    (``start`` at a line's beginning). ``first_line``: the number of the line at
    ``start``; None (a range in a worker) counts it only when a message names it, and
    the locations are then ``LineLocation`` objects that print as ``path:line``."""
    counts = counts if counts is not None else RecordCounts()
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        for index, line in enumerate(f):
            if end is not None and offset >= end:
                break
            line_start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            location = (
                f"{path}:{first_line + index}"
                if first_line is not None
                else LineLocation(path, line_start)
            )
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"a JSON {type(record).__name__}, not an object")
            except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                problem = f"not a JSON object ({_short(exc)})"
                if not skip_bad_records:
                    raise DataFormatError(
                        f"{location}: {problem}; --skip-bad-records skips such lines"
                    ) from None
                counts.skip(location, problem)
                continue
            counts.records += 1
            yield location, record


def jsonl_documents(
    path: Path,
    start: int = 0,
    end: int | None = None,
    text_field: str = "text",
    skip_bad_records: bool = False,
    counts: RecordCounts | None = None,
    first_line: int | None = 1,
) -> Iterator[str]:
    """The ``text_field`` of each record in bytes ``[start, end)`` (``jsonl_records``)."""
    counts = counts if counts is not None else RecordCounts()
    for location, record in jsonl_records(path, start, end, skip_bad_records, counts, first_line):
        text = checked_text(location, record, text_field, skip_bad_records, counts)
        if text is not None:
            yield text


def checked_text(
    location, record: dict, text_field: str, skip_bad_records: bool, counts: RecordCounts
) -> str | None:
    """``document_text``, or None for a bad record skipped (and counted as skipped)."""
    problem = text_problem(record, text_field)
    if problem is None:
        return record[text_field]
    if not skip_bad_records:
        raise DataFormatError(f"{location}: {problem}")
    counts.records -= 1
    counts.skip(location, problem)
    return None


class LineLocation:
    """``path:line`` of the line starting at byte ``line_start``, its number counted
    from the file's start only when printed (a worker reading a range does not know
    how many lines came before it)."""

    def __init__(self, path: Path, line_start: int):
        self.path, self.line_start = path, line_start

    def __str__(self) -> str:
        return f"{self.path}:{_lines_before(self.path, self.line_start) + 1}"


def _lines_before(path: Path, offset: int) -> int:
    """Line breaks in the first ``offset`` bytes of ``path`` (read in 1 MiB chunks)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


def jsonl_ranges(path: Path, size: int, target_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``target_bytes`` covering ``path``, each cut just after a
    line break, so every range is whole lines (records) that a worker reads alone."""
    ranges, start = [], 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + target_bytes, size))
            f.readline()  # to the end of the line the target falls in
            end = min(f.tell(), size) if start + target_bytes < size else size
            ranges.append((start, end))
            start = end
    return ranges or [(0, 0)]


def _short(exc: Exception) -> str:
    return " ".join(str(exc).split())[:120]
