"""Tokenizers: byte-level, tokenizer.json files, and a BPE trained here."""

import sysconfig
from pathlib import Path

import pytest

from meshwise.data.bpe import (
    END_OF_TEXT,
    MIN_VOCAB_SIZE,
    check_vocab_size,
    save_tokenizer,
    train_bpe,
)
from meshwise.data.tokenizer import ByteTokenizer, check_vocab_fits, decode_sample, load_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ("inspect.py", "argparse.py", "dataclasses.py")


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory) -> Path:
    """A 1,000-token byte-level BPE trained on three standard library modules."""
    texts = [(STDLIB / name).read_text() for name in SOURCES]
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    save_tokenizer(train_bpe(texts, 1000), path)
    return path


def test_byte_level_is_the_default():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    assert tok.encode("hé") == [104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
    assert tok.separator == (10,) and tok.digest == "byte-level"


def test_trained_bpe_round_trips_text(bpe_path):
    tok = load_tokenizer(bpe_path)
    assert tok.vocab_size == 1000 and tok.separator == (0,)  # <|endoftext|> is id 0
    text = (STDLIB / "typing.py").read_text()[:20_000] + "\nünïcode 中文 \t tabs\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) / 2  # it learned merges
    assert tok.decode(ids) == text
    assert [a.tolist() for a in tok.encode_documents([text.encode()])] == [ids]


def test_trained_bpe_loads_in_transformers(bpe_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_path))
    text = "def main(argv):\n    return 0\n"
    ours = load_tokenizer(bpe_path).encode(text)
    assert fast(text)["input_ids"] == ours
    assert Tokenizer.from_file(str(bpe_path)).encode(text).ids == ours
    assert fast.decode(ours) == text and fast.convert_ids_to_tokens(0) == END_OF_TEXT


def test_digest_is_the_files_and_a_folder_finds_its_tokenizer_json(bpe_path):
    tok = load_tokenizer(bpe_path)
    assert load_tokenizer(bpe_path.parent).digest == tok.digest
    assert len(tok.digest) == 16 and tok.path == str(bpe_path.resolve())


def test_cuts_are_judged_by_the_tokens(bpe_path):
    tok = load_tokenizer(bpe_path)
    assert tok.splits_at_lines
    assert tok.cuts_cleanly(b"x = 1\n", b"y = 2\n")
    # GPT-2's pattern keeps a run of spaces before a word apart from the word's own space
    assert not tok.cuts_cleanly(b"x = 1\n   ", b"  y = 2\n")
    assert ByteTokenizer().cuts_cleanly(b"ab", b"c")


def test_a_tokenizer_that_marks_the_start_of_text_is_cut_only_before_a_space(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sp_like = Tokenizer(models.BPE(unk_token="<unk>"))  # SentencePiece style: "▁word"
    sp_like.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    sp_like.decoder = decoders.Metaspace(prepend_scheme="first")
    texts = [(STDLIB / name).read_text() for name in SOURCES]
    sp_like.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=["<unk>"])
    )
    sp_like.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    # "▁" starts each text: a cut is clean only where the next line starts with a space
    assert not tok.cuts_cleanly(b"x = 1\n", b"y = 2\n")
    assert tok.cuts_cleanly(b"def f(a):\n", b"    return a\n")
    assert tok.separator == tuple(tok.encode("\n"))  # no end-of-text token: a newline


def test_bpe_vocab_size_bounds():
    check_vocab_size(MIN_VOCAB_SIZE)
    for bad in (1, 256):
        with pytest.raises(ValueError, match=f"--vocab-size {bad} is not valid.*valid: 257"):
            check_vocab_size(bad)


def test_vocab_size_must_hold_the_tokenizer(bpe_path):
    tok = load_tokenizer(bpe_path)
    check_vocab_fits(tok, 0)
    check_vocab_fits(tok, 1024)
    with pytest.raises(
        ValueError,
        match="--vocab-size 999 is smaller than the vocabulary of "
        "1000.*valid: --vocab-size 1000 or more",
    ):
        check_vocab_fits(tok, 999)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        (b"{not json", "is not a tokenizer.json"),
        (b'{"hello": "world"}', "is not a tokenizer.json"),
        (b"\x80\x81binary", "is not a tokenizer.json"),
    ],
)
def test_bad_tokenizer_files_name_the_path(tmp_path, content, message):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        load_tokenizer(path)
    text = str(err.value)
    assert message in text and str(path.name) in text and "tokenizer.json file" in text
    assert "\n" not in text


def test_samples_decode_with_the_runs_tokenizer(bpe_path):
    tok = load_tokenizer(bpe_path)
    prompt, new = tok.encode("def f("), tok.encode("x):\n")
    assert decode_sample(str(bpe_path), prompt, new, 1000) == ("def f(", "x):\n")
    assert decode_sample(None, [104, 195], [169], 256) == ("h\ufffd", "é")  # é made whole
    assert decode_sample(None, [300], [301], 512) == ("300", " 301")  # no tokenizer: ids
