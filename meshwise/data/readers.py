"""Reading data as users hold it, each record one document: ``iter_records``,
``iter_documents`` and ``data_files`` over JSON lines, Parquet, ``datasets`` folders, CSV,
JSON arrays and text. Formats, folders, errors: docs/data.md "Records" and "Reading
records from Python".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from meshwise.data import tables
from meshwise.data.files import SNIFF_BYTES, file_problem, list_files

# Re-exported: the errors and counts are part of this module's interface.
from meshwise.data.records import (  # noqa: F401
    DataFormatError,
    LineLocation,
    RecordCounts,
    checked_text,
    document_text,
    jsonl_documents,
    jsonl_records,
)

logger = logging.getLogger("meshwise")

FORMATS = ("text", "jsonl", "json", "parquet", "csv", "hf-disk")
DATA_FORMATS = ("auto",) + FORMATS  # what --data-format accepts
EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
}  # a .json is sniffed: JSON lines or one array
FOLDER_DATA = (".jsonl", ".ndjson", ".parquet")  # a folder holding one of these is data
NOT_DATA = (".gz", ".zst", ".bz2", ".xz", ".zip", ".arrow")  # named, not read as text


@dataclass(frozen=True)
class ReadOptions:
    """How records become documents: ``--text-field``, ``--data-format``,
    ``--skip-bad-records``."""

    text_field: str = "text"
    data_format: str = "auto"
    skip_bad_records: bool = False


@dataclass(frozen=True)
class DataFile:
    """One file (or ``save_to_disk`` folder) of the data, and its format."""

    path: Path
    format: str


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def detect_format(path: Path, data_format: str = "auto") -> str:
    """The format of the file ``path`` (or ``"binary"``: a NUL byte in its first 8 KiB):
    ``data_format`` when named, else from its name and first bytes. Raises
    ``DataFormatError`` for a compressed file and for a text file that looks like JSON
    lines."""
    if data_format not in DATA_FORMATS:
        raise DataFormatError(
            f"--data-format {data_format!r} is not valid; valid: {', '.join(DATA_FORMATS)}"
        )
    if is_saved_dataset(path):
        return "hf-disk"
    if data_format not in ("auto", "text"):
        return data_format
    if data_format == "text":
        return "binary" if b"\0" in _head(path) else "text"
    suffix = path.suffix.lower()
    if suffix in EXTENSIONS:
        return EXTENSIONS[suffix]
    if suffix in NOT_DATA:
        raise DataFormatError(
            f"{path}: a {suffix} file is not a format meshwise reads; valid: "
            "JSON lines, Parquet, CSV, a save_to_disk folder or text "
            "(decompress or convert it first)"
        )
    if suffix != ".json":
        return text_format(path)
    first = _head(path).split(b"\n", 1)[0]
    if first.lstrip().startswith(b"["):
        return "json"
    if not _is_json_object(first):
        raise DataFormatError(
            f"{path}: one JSON document over several lines, neither JSON "
            "lines nor an array of records; valid: one record per line "
            "(.jsonl), or --data-format text to read it as text"
        )
    return "jsonl"


def text_format(path: Path) -> str:
    """``"text"``, ``"binary"``, or ``DataFormatError`` for a file whose first line is a
    JSON object: JSON lines are never read as text by guess."""
    head = _head(path)
    if b"\0" in head:
        return "binary"
    if _is_json_object(head.split(b"\n", 1)[0]):
        raise DataFormatError(
            f"{path}: its first line is a JSON object, so it looks like "
            "JSON lines, not text; valid: name it .jsonl, or "
            "--data-format jsonl, or --data-format text to read it as text"
        )
    return "text"


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(SNIFF_BYTES)


def _is_json_object(line: bytes) -> bool:
    if not line.lstrip().startswith(b"{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def data_files(path: str | Path, data_format: str = "auto") -> list[DataFile]:
    """The files of ``path`` (a file, a folder, a ``save_to_disk`` folder) with their
    formats, sorted. Raises ``DataFormatError`` naming a file that cannot be read.

    A folder holding ``.jsonl``, ``.ndjson`` or ``.parquet`` files is data (those and its
    ``.json``, ``.csv``, ``.tsv``; anything else skipped with a warning); any other is text.
    """
    path = Path(path).expanduser()
    if is_saved_dataset(path) or not path.is_dir():
        problem = None if path.is_dir() else file_problem(path)
        if problem:
            raise DataFormatError(f"data path {str(path)!r} is {problem}")
        return [DataFile(path, detect_format(path, data_format))]
    names = list_files(path, skip_dirs=frozenset({"__pycache__"}))
    suffixes = {n: Path(n).suffix.lower() for n in names}
    if data_format == "auto" and any(suffixes[n] in FOLDER_DATA for n in names):
        others = [n for n in names if suffixes[n] not in EXTENSIONS and suffixes[n] != ".json"]
        if others:
            logger.warning(
                "warning: %s holds data files; skipping %d other file%s: %s",
                path,
                len(others),
                "s" if len(others) > 1 else "",
                ", ".join(others[:5]),
            )
        return [DataFile(path / n, detect_format(path / n)) for n in names if n not in others]
    if data_format == "auto":  # a folder of text: a .json or .csv there is text too
        return [DataFile(path / n, text_format(path / n)) for n in names]
    return [DataFile(path / n, detect_format(path / n, data_format)) for n in names]


def iter_records(
    path: str | Path,
    data_format: str = "auto",
    skip_bad_records: bool = False,
    counts: RecordCounts | None = None,
) -> Iterator[tuple[str | LineLocation, dict]]:
    """``(location, record)`` for every record under ``path``, in order."""
    counts = counts if counts is not None else RecordCounts()
    for file in data_files(path, data_format):
        if file.format == "binary":
            continue
        if file.format == "text":
            counts.records += 1
            yield str(file.path), {"text": file.path.read_text(errors="replace")}
        elif file.format == "jsonl":
            yield from jsonl_records(file.path, skip_bad_records=skip_bad_records, counts=counts)
        else:
            yield from tables.records(file.path, file.format, counts)


def iter_documents(
    path: str | Path,
    text_field: str = "text",
    data_format: str = "auto",
    skip_bad_records: bool = False,
    counts: RecordCounts | None = None,
) -> Iterator[str]:
    """The text of every record under ``path``: its ``text_field`` (a plain text file:
    its whole content)."""
    counts = counts if counts is not None else RecordCounts()
    for file in data_files(path, data_format):
        yield from file_documents(file, text_field, skip_bad_records, counts)


def file_documents(
    file: DataFile, text_field: str, skip_bad_records: bool, counts: RecordCounts
) -> Iterator[str]:
    """The documents of one ``DataFile`` (none for a binary file)."""
    if file.format == "binary":
        return
    if file.format == "text":
        counts.records += 1
        yield file.path.read_text(errors="replace")
    elif file.format == "jsonl":
        yield from jsonl_documents(
            file.path, text_field=text_field, skip_bad_records=skip_bad_records, counts=counts
        )
    else:
        yield from tables.documents(file.path, file.format, text_field, skip_bad_records, counts)
