"""Readers: every format gives its records in order, and bad input names its place."""

import json
import os
from pathlib import Path

import pytest

from meshwise.data.readers import (
    DataFormatError,
    RecordCounts,
    data_files,
    iter_documents,
    iter_records,
)
from meshwise.data.records import jsonl_documents, jsonl_ranges

TEXTS = [f"document {i}: {'é' * (i % 3)} line\nsecond line" for i in range(7)]


def _jsonl(path: Path, texts=TEXTS, extra: str = "") -> Path:
    path.write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)) + extra
    )
    return path


def test_jsonl_records_are_documents_with_their_line_numbers(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", extra="\n  \n")  # blank lines are not records
    records = list(iter_records(path))
    assert [loc for loc, _ in records] == [f"{path}:{i + 1}" for i in range(len(TEXTS))]
    assert [r["id"] for _, r in records] == list(range(len(TEXTS)))
    assert list(iter_documents(path)) == TEXTS


def test_a_malformed_line_is_named_or_skipped_and_counted(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", extra='{"text": oops}\n[1, 2]\n{"body": "b", "id": 9}\n')
    n = len(TEXTS)
    with pytest.raises(
        DataFormatError,
        match=rf"a.jsonl:{n + 1}: not a JSON object .*"
        "--skip-bad-records",
    ):
        list(iter_documents(path))
    counts = RecordCounts()
    assert list(iter_documents(path, skip_bad_records=True, counts=counts)) == TEXTS
    assert (counts.records, counts.skipped) == (n, 3)
    assert f"a.jsonl:{n + 2}: not a JSON object (a JSON list" in counts.summary()
    with pytest.raises(DataFormatError) as err:
        list(iter_documents(tmp_path / "a.jsonl", text_field="id"))
    assert "field 'id' is int, not a string" in str(err.value)


def test_a_record_without_the_field_names_the_fields_it_has(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [], "source": "x"}) + "\n")
    with pytest.raises(DataFormatError) as err:
        list(iter_documents(path))
    message = str(err.value)
    assert (
        message.startswith(
            f"{path}:1: the record has no field 'text' (its fields: messages, source)"
        )
        and "\n" not in message
    )


def test_ranges_read_by_workers_cover_every_line_once_and_name_lines_lazily(tmp_path):
    texts = [f"t{i} " * (i % 13) for i in range(300)]
    path = _jsonl(tmp_path / "a.jsonl", texts, extra='{"text": 1\n')
    ranges = jsonl_ranges(path, path.stat().st_size, target_bytes=500)
    assert len(ranges) > 5 and ranges[0][0] == 0 and ranges[-1][1] == path.stat().st_size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    got = []
    with pytest.raises(DataFormatError, match=f"a.jsonl:{len(texts) + 1}: not a JSON"):
        for start, end in ranges:  # first_line=None: counted only for the message
            got += jsonl_documents(path, start, end, first_line=None)
    assert got == texts


def test_a_text_file_that_looks_like_json_lines_is_never_read_as_text(tmp_path):
    path = _jsonl(tmp_path / "data.txt")
    with pytest.raises(DataFormatError, match="looks like JSON lines.*--data-format text"):
        data_files(path)
    assert list(iter_documents(path, data_format="jsonl")) == TEXTS
    assert list(iter_documents(path, data_format="text")) == [path.read_text()]
    (tmp_path / "x.gz").write_bytes(b"\x1f\x8b\0\0")
    with pytest.raises(DataFormatError, match=r"x.gz: a .gz file is not a format"):
        data_files(tmp_path / "x.gz")


def test_a_folder_of_shards_skips_what_is_not_data(tmp_path, caplog):
    folder = tmp_path / "shards"
    folder.mkdir()
    _jsonl(folder / "b.jsonl", TEXTS[3:])
    _jsonl(folder / "a.jsonl", TEXTS[:3])
    (folder / "README.md").write_text("# about")
    os.mkfifo(folder / "pipe.jsonl")
    assert list(iter_documents(folder)) == TEXTS
    assert "skipping 1 other file: README.md" in caplog.text
    assert "skipping" in caplog.text and "pipe.jsonl: not a regular file (a FIFO)" in caplog.text
    (folder / "c.jsonl").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="c.jsonl is a symbolic link to nothing"):
        data_files(folder)


def test_a_folder_of_text_stays_text(tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "a.py").write_text("print(1)\n")
    (folder / "package.json").write_text('{\n  "name": "x"\n}\n')  # a .json there is text
    (folder / "blob.bin").write_bytes(b"\0\1")
    assert [f.format for f in data_files(folder)] == ["text", "binary", "text"]
    assert list(iter_documents(folder)) == ["print(1)\n", '{\n  "name": "x"\n}\n']


def test_parquet_streams_row_groups_and_names_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i}" for i in range(2500)]
    texts[1777] = None
    path = tmp_path / "part-0.parquet"
    parquet.write_table(pa.table({"text": texts, "n": list(range(2500))}), path, row_group_size=600)
    with pytest.raises(DataFormatError, match="part-0.parquet row 1777: field 'text' is null"):
        list(iter_documents(path))
    counts = RecordCounts()
    assert list(iter_documents(path, skip_bad_records=True, counts=counts)) == [
        t for t in texts if t is not None
    ]
    assert counts.skipped == 1
    assert dict(iter_records(path))[f"{path} row 2499"] == {"text": "row 2499", "n": 2499}
    with pytest.raises(
        DataFormatError,
        match=r"part-0.parquet: no column 'body' \(its "
        r"columns: text, n\)",
    ):
        list(iter_documents(path, text_field="body"))


def test_datasets_saved_to_disk_and_local_files_through_load_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))})
    datasets.DatasetDict({"train": data, "test": data.select([0])}).save_to_disk(tmp_path / "dd")
    assert [f.format for f in data_files(tmp_path / "dd")] == ["hf-disk"]
    assert list(iter_documents(tmp_path / "dd")) == TEXTS  # the train split
    assert list(iter_documents(tmp_path / "dd" / "test")) == TEXTS[:1]
    (tmp_path / "arr.json").write_text(json.dumps([{"text": t} for t in TEXTS]))
    assert list(iter_documents(tmp_path / "arr.json")) == TEXTS
    (tmp_path / "t.csv").write_text(
        "id,text\n" + "".join(f'{i},"{t}"\n' for i, t in enumerate(TEXTS))
    )
    assert [r["id"] for _, r in iter_records(tmp_path / "t.csv")] == list(range(len(TEXTS)))
    assert list(iter_documents(tmp_path / "t.csv")) == TEXTS


def test_a_missing_library_names_the_pip_install(tmp_path, monkeypatch):
    import sys

    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if absent
    with pytest.raises(
        ValueError,
        match=r"needs the pyarrow package; install it with: pip "
        r"install 'meshwise\[parquet\]'",
    ):
        list(iter_documents(tmp_path / "p.parquet"))


def test_skipped_lines_are_counted_and_only_the_first_three_numbered(tmp_path, monkeypatch):
    from meshwise.data import records

    path = tmp_path / "a.jsonl"
    path.write_text("".join('{"text": "ok"}\n' if i % 2 else "not json\n" for i in range(100)))
    counted = []
    real = records._lines_before
    monkeypatch.setattr(records, "_lines_before", lambda *a: counted.append(a) or real(*a))
    counts = RecordCounts()
    for start, end in jsonl_ranges(path, path.stat().st_size, target_bytes=100):
        assert all(
            t == "ok"
            for t in jsonl_documents(
                path, start, end, skip_bad_records=True, counts=counts, first_line=None
            )
        )
    assert (counts.records, counts.skipped) == (50, 50) and not counted
    summary = counts.summary()
    assert summary.startswith(f"50 bad records skipped ({path}:1: not a JSON object")
    assert f"{path}:5: not a JSON object" in summary and summary.endswith("; ...)")
    assert len(counted) == 3  # lines counted for the three named, not for all fifty
