"""Token files from records: each record one document, whatever the format and the workers."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from meshwise.data import corpus
from meshwise.data.bpe import save_tokenizer, train_bpe
from meshwise.data.readers import DataFormatError, ReadOptions, data_files
from meshwise.data.sources import resolve_data
from meshwise.data.tokenizer import load_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXTS = [c for c in (STDLIB / "argparse.py").read_text().split("\n\n") if c.strip()][:400]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    save_tokenizer(train_bpe([(STDLIB / "inspect.py").read_text()], 600), path)
    return path


def _expected(bpe_path: Path, texts: list[str]) -> list[int]:
    """Each record encoded by the tokenizers library itself, joined by <|endoftext|>."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe_path))
    out: list[int] = []
    for i, text in enumerate(texts):
        out += ([tok.token_to_id("<|endoftext|>")] if i else []) + tok.encode(
            text, add_special_tokens=False
        ).ids
    return out


def _shards(root: Path) -> Path:
    """The texts as a JSON-lines shard (with a blank line) and a Parquet shard."""
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    root.mkdir()
    half = len(TEXTS) // 2
    (root / "a.jsonl").write_text(
        "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(TEXTS[:half])) + "\n"
    )
    parquet.write_table(pa.table({"text": TEXTS[half:]}), root / "b.parquet", row_group_size=50)
    return root


def test_records_are_documents_whatever_the_workers(tmp_path, bpe_path, monkeypatch):
    monkeypatch.setattr(corpus, "PIECE_BYTES", 2048)  # many ranges, batches and tasks
    monkeypatch.setattr(corpus, "TASK_BYTES", 4096)
    root = _shards(tmp_path / "shards")
    tokenizer = load_tokenizer(bpe_path)
    built = {}
    for workers in (1, 2):
        dest = tmp_path / f"w{workers}.bin"
        stats = corpus.build_token_file(dest, data_files(root), tokenizer, str(root), workers)
        assert stats["documents"] == len(TEXTS) and stats["files"] == 2
        built[workers] = np.fromfile(dest, dtype="<u2").tolist()
    assert built[1] == built[2] == _expected(bpe_path, TEXTS)


def test_a_bad_line_read_by_a_worker_is_named_by_its_line_or_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "PIECE_BYTES", 1024)
    monkeypatch.setattr(corpus, "TASK_BYTES", 2048)
    lines = [json.dumps({"text": t}) for t in TEXTS[:200]]
    lines[150] = '{"text": "unterminated'
    lines[170] = json.dumps({"body": "x"})
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    files = data_files(path)
    tokenizer = load_tokenizer(None)
    with pytest.raises(DataFormatError, match=f"^{path}:151: not a JSON object"):
        corpus.build_token_file(tmp_path / "d.bin", files, tokenizer, "d", num_workers=2)
    assert not (tmp_path / "d.bin").exists()
    stats = corpus.build_token_file(
        tmp_path / "d.bin", files, tokenizer, "d", 2, options=ReadOptions(skip_bad_records=True)
    )
    assert stats["documents"] == 198 and stats["records"].skipped == 2
    assert f"{path}:171: the record has no field 'text'" in stats["records"].summary()
    kept = [t for i, t in enumerate(TEXTS[:200]) if i not in (150, 170)]
    assert np.fromfile(tmp_path / "d.bin", dtype="<u2").tolist() == list(
        "\n".join(kept).encode()
    )  # byte-level: records joined by newlines


def test_the_cache_key_holds_the_format_and_how_records_are_read(tmp_path):
    data = tmp_path / "records"
    data.write_text("".join(json.dumps({"text": t, "title": t[:20]}) + "\n" for t in TEXTS))
    with pytest.raises(DataFormatError, match="looks like JSON lines"):
        resolve_data(data, tmp_path / "c")
    as_text = resolve_data(data, tmp_path / "c", options=ReadOptions(data_format="text"))
    as_records = resolve_data(data, tmp_path / "c", options=ReadOptions(data_format="jsonl"))
    titles = resolve_data(
        data, tmp_path / "c", options=ReadOptions(text_field="title", data_format="jsonl")
    )
    assert len({as_text, as_records, titles}) == 3
    assert as_text.stat().st_size == 2 * data.stat().st_size  # the raw bytes, uint16
    assert np.fromfile(as_records, "<u2").tolist() == list("\n".join(TEXTS).encode())
