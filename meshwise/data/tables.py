"""Columnar data, a batch of rows at a time: Parquet through ``pyarrow`` (pages read as
needed), ``save_to_disk`` folders memory-mapped, CSV and JSON arrays streamed by
``datasets.load_dataset``. Rows count from 0 per file; the libraries load only here.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Iterator

from meshwise.data.records import DataFormatError, RecordCounts, checked_text

BATCH_ROWS = 1024  # rows per batch read
_READ_BUFFER = 1 << 20  # Parquet: bytes read from the file at a time
EXTRAS = {"pyarrow": "parquet", "datasets": "datasets"}  # module -> meshwise's extra


def require(module: str, why: str):
    """Import ``module`` or raise a ``ValueError`` naming the ``pip install`` to run."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"{why} needs the {module.split('.')[0]} package; install it with: "
            f"pip install 'meshwise[{EXTRAS[module.split('.')[0]]}]'"
        ) from None


def records(
    path: Path, data_format: str, counts: RecordCounts | None = None
) -> Iterator[tuple[str, dict]]:
    """``(location, record)`` of every row of a ``parquet``, ``hf-disk``, ``json`` or ``csv``
    source, each row a dict of its columns."""
    counts = counts if counts is not None else RecordCounts()
    for location, row in _rows(path, data_format, None):
        counts.records += 1
        yield location, row


def documents(
    path: Path,
    data_format: str,
    text_field: str,
    skip_bad_records: bool = False,
    counts: RecordCounts | None = None,
) -> Iterator[str]:
    """The ``text_field`` of every row (a row without a string there is a bad record)."""
    counts = counts if counts is not None else RecordCounts()
    for location, row in _rows(path, data_format, text_field):
        counts.records += 1
        text = checked_text(location, row, text_field, skip_bad_records, counts)
        if text is not None:
            yield text


def _rows(path: Path, data_format: str, column: str | None) -> Iterator[tuple[str, dict]]:
    """Rows as dicts (only ``column`` when given) with their locations."""
    if data_format == "parquet":
        batches, name = _parquet_batches(path, column), str(path)
    elif data_format == "hf-disk":
        batches, name = _saved_batches(path, column), str(path)
    elif data_format in ("json", "csv"):
        batches, name = _loaded_batches(path, data_format, column), str(path)
    else:
        raise ValueError(f"{path}: {data_format!r} is not a columnar format")
    row = 0
    for batch in batches:  # {column: [values]}
        names = list(batch)
        for values in zip(*(batch[n] for n in names)):
            yield f"{name} row {row}", dict(zip(names, values))
            row += 1


def _check_column(path: Path, names: list[str], column: str | None) -> None:
    if column is not None and column not in names:
        raise DataFormatError(
            f"{path}: no column {column!r} (its columns: "
            f"{', '.join(names) or 'none'}); name the text's column with "
            "--text-field"
        )


def _parquet_batches(path: Path, column: str | None) -> Iterator[dict]:
    parquet = require("pyarrow.parquet", f"reading the Parquet file {path}")
    file = _parquet_file(parquet, path)
    _check_column(path, file.schema_arrow.names, column)
    columns = None if column is None else [column]
    for batch in file.iter_batches(batch_size=BATCH_ROWS, columns=columns):
        yield batch.to_pydict()


def row_count(path: Path, data_format: str) -> int | None:
    """Rows of a Parquet file or a saved dataset (None for a streamed CSV or JSON)."""
    if data_format == "parquet":
        parquet = require("pyarrow.parquet", f"reading the Parquet file {path}")
        return _parquet_file(parquet, path).metadata.num_rows
    if data_format == "hf-disk":
        return len(_saved(path))
    return None


def _parquet_file(parquet, path: Path):
    try:
        return parquet.ParquetFile(path, buffer_size=_READ_BUFFER, pre_buffer=False)
    except Exception as exc:  # pyarrow raises ArrowInvalid and others for a bad file
        raise DataFormatError(
            f"{path}: not a readable Parquet file ({' '.join(str(exc).split())[:120]})"
        ) from None


def _saved(path: Path):
    """The dataset ``save_to_disk`` wrote to ``path`` (a DatasetDict's train split, or
    its only one)."""
    datasets = require("datasets", f"reading the saved dataset {path}")
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        splits = list(saved)
        if "train" not in saved and len(splits) != 1:
            raise DataFormatError(
                f"{path}: a DatasetDict with the splits "
                f"{', '.join(splits)} and no 'train'; valid: --data "
                f"{path / splits[0]} (one split's folder)"
            )
        saved = saved["train" if "train" in saved else splits[0]]
    return saved


def _saved_batches(path: Path, column: str | None) -> Iterator[dict]:
    saved = _saved(path)
    _check_column(path, list(saved.column_names), column)
    if column is not None:
        saved = saved.select_columns([column])
    yield from saved.iter(batch_size=BATCH_ROWS)


def _loaded_batches(path: Path, data_format: str, column: str | None) -> Iterator[dict]:
    datasets = require("datasets", f"reading {path}")
    options = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    try:
        loaded = datasets.load_dataset(
            data_format, data_files=[str(path)], split="train", streaming=True, **options
        )  # nothing cached
        first = True
        for batch in loaded.iter(batch_size=BATCH_ROWS):
            if first:
                _check_column(path, list(batch), column)
                first = False
            yield batch if column is None else {column: batch[column]}
    except DataFormatError:
        raise
    except Exception as exc:  # the builders raise many kinds for a file they cannot parse
        raise DataFormatError(
            f"{path}: not readable as {data_format} ({' '.join(str(exc).split())[:120]})"
        ) from None
