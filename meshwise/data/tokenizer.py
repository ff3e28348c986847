"""Tokenizers, byte-level (the default) and Hugging Face ``tokenizer.json``: ``encode``,
``decode``, ``vocab_size``, ``digest`` (SHA-256 of the file's bytes, stable across library
versions), ``separator`` between documents and ``splits_at_lines``. See docs/data.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

BYTE_LEVEL = "byte-level"
BYTE_VOCAB_SIZE = 256
# End-of-text tokens by the names common tokenizers give them: GPT-2, Qwen and
# ours; Llama 3; Llama 2, Mistral, T5; Gemma.
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
EXPECTED = "a Hugging Face tokenizer.json file (or a folder holding one)"
# Texts with line breaks: a tokenizer that gives the same tokens for none of
# them cut after a newline as whole is never fed pieces of a document.
_CUT_PROBES = (
    "x = 1\ny = 2\nprint(x)",
    "Hello world.\n\nSecond line here\n#end",
    "def f(a):\n    return a\n\n\nf(1)\n",
    "é\nü\n中文\nend",
)


class Tokenizer:
    """What meshwise asks of a tokenizer; ``ByteTokenizer`` and ``HFTokenizer`` answer."""

    kind: str
    path: str | None = None
    vocab_size: int
    digest: str
    separator: tuple[int, ...]
    end_of_text: int | None = None  # the separator when it is an end-of-text token

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_documents(self, documents: Sequence[bytes | str]) -> list[np.ndarray]:
        """Token ids of each document, given as the bytes of a text file or as a string."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_with_ends(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of ``text`` (int64) and where each token ends in it (the character
        offset after its last character), to tell which part of a text a token is of."""
        raise NotImplementedError

    def cuts_cleanly(self, left: bytes, right: bytes) -> bool:
        """Whether ``left + right`` encodes to the tokens of ``left`` then those of ``right``."""
        whole, first, second = self.encode_documents([left + right, left, right])
        return np.array_equal(whole, np.concatenate([first, second]))

    @cached_property
    def splits_at_lines(self) -> bool:
        """Whether a long document may be cut after some line breaks at all
        (``cuts_cleanly`` then checks each cut): a quick test on a few texts."""
        try:
            return any(
                self.cuts_cleanly(text[: i + 1], text[i + 1 :])
                for text in (t.encode() for t in _CUT_PROBES)
                for i in range(len(text) - 1)
                if text[i] == 0x0A
            )
        except ValueError:  # it cannot encode a probe: encode documents whole
            return False

    def describe(self) -> str:
        return f"{self.path} (digest {self.digest}, vocab {self.vocab_size})"

    def decode_continuation(self, prompt: list[int], new: list[int]) -> str:
        """The text ``new`` adds after ``prompt``.

        Decoded together and then cut, so a character whose bytes straddle the
        boundary comes out whole (the prompt alone ends in U+FFFD there).
        """
        head = self.decode(prompt).rstrip("\ufffd")
        whole = self.decode(prompt + new)
        return whole[len(head) :] if whole.startswith(head) else self.decode(new)

    def identity(self) -> dict:
        """What a token file's sidecar records about the tokenizer that wrote it."""
        return {
            "kind": self.kind,
            "path": self.path,
            "digest": self.digest,
            "vocab_size": self.vocab_size,
            "separator": list(self.separator),
            "end_of_text": self.end_of_text,
        }


class ByteTokenizer(Tokenizer):
    """Every byte of the text is a token (vocabulary 256)."""

    kind = digest = BYTE_LEVEL
    vocab_size = BYTE_VOCAB_SIZE
    separator = (ord("\n"),)
    splits_at_lines = True

    def cuts_cleanly(self, left: bytes, right: bytes) -> bool:
        return True  # a byte's token never depends on its neighbours

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_documents(self, documents: Sequence[bytes | str]) -> list[np.ndarray]:
        return [
            np.frombuffer(data.encode() if isinstance(data, str) else data, np.uint8)
            for data in documents
        ]  # bytes as they are

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_with_ends(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
        widths = [len(c.encode("utf-8")) for c in text]  # each character's bytes end with it
        return ids, np.repeat(np.arange(1, len(text) + 1), widths)

    def describe(self) -> str:
        return "byte-level (vocab 256)"


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``, run by the ``tokenizers`` library."""

    kind = "tokenizer.json"

    def __init__(self, path: str, tokenizer, digest: str):
        self.path, self.digest, self._tok = path, digest, tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError(f"--tokenizer {path} has an empty vocabulary; expected {EXPECTED}")
        self.vocab_size = max(vocab.values()) + 1  # ids may have holes: size by the largest
        eot = next((vocab[name] for name in END_OF_TEXT if name in vocab), None)
        self.separator = (eot,) if eot is not None else tuple(self.encode("\n"))
        self.end_of_text = eot

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_documents(self, documents: Sequence[bytes | str]) -> list[np.ndarray]:
        """Each document's bytes read as UTF-8 (invalid bytes become U+FFFD), encoded.

        ``encode_batch_fast`` skips the offsets ``encode`` computes: about 3x faster.
        """
        texts = [
            data if isinstance(data, str) else data.decode("utf-8", errors="replace")
            for data in documents
        ]
        with serial_tokenizers():
            try:
                encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
            except Exception as exc:  # e.g. a WordLevel model without an unknown token
                raise ValueError(
                    f"--tokenizer {self.path} cannot encode the text: "
                    f"{' '.join(str(exc).split())[:160]}"
                ) from None
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_with_ends(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        ends = np.asarray([end for _, end in encoding.offsets], dtype=np.int64)
        return np.asarray(encoding.ids, dtype=np.int64), ends


@contextlib.contextmanager
def serial_tokenizers() -> Iterator[None]:
    """Run the ``tokenizers`` library on this thread only: our parallelism is processes, and
    once its pool is used every later fork (the ranks) warns and switches it off.
    """
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer at ``path``: None (or ``"byte-level"``) is the byte-level one.

    ``path`` may be a ``tokenizer.json`` or a folder holding one (a transformers
    model folder). Raises ValueError naming the path for a missing, unreadable
    or malformed file.
    """
    if path is None or str(path) == BYTE_LEVEL:
        return ByteTokenizer()
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"--tokenizer {path}: no such file; expected {EXPECTED}")
    file = file.resolve()
    try:
        st = file.stat()
        return _load_file(str(file), st.st_size, st.st_mtime_ns)
    except OSError as exc:
        raise ValueError(
            f"--tokenizer {path}: cannot read it ({exc.strerror or exc}); expected {EXPECTED}"
        ) from None


def load_unchanged(path: str, digest: str | None) -> Tokenizer | None:
    """The tokenizer recorded at ``path`` if it is still there unchanged (same
    ``digest``); None where it is gone, unreadable or different."""
    try:
        tokenizer = load_tokenizer(path)
    except ValueError:
        return None
    return tokenizer if tokenizer.digest == digest else None


@lru_cache(maxsize=4)
def _load_file(path: str, size: int, mtime_ns: int) -> HFTokenizer:
    """Parse a ``tokenizer.json`` once per (path, size, mtime): workers and the
    trainer's sample load it again and again."""
    from tokenizers import Tokenizer as RustTokenizer

    raw = Path(path).read_bytes()
    try:
        tok = RustTokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # the library raises plain Exception with serde's message
        hint = (
            " (a SentencePiece .model: load it with transformers' AutoTokenizer and "
            "save_pretrained to get a tokenizer.json)"
            if path.endswith(".model")
            else ""
        )
        reason = " ".join(str(exc).split())[:160]
        raise ValueError(
            f"--tokenizer {path} is not a tokenizer.json ({reason}){hint}; expected {EXPECTED}"
        ) from None
    return HFTokenizer(path, tok, hashlib.sha256(raw).hexdigest()[:16])


def check_vocab_fits(tokenizer: Tokenizer, vocab_size: int) -> None:
    """``--vocab-size`` (0: the tokenizer's) must hold every id of the tokenizer."""
    if vocab_size and vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"--vocab-size {vocab_size} is smaller than the vocabulary of "
            f"{tokenizer.vocab_size} of the tokenizer {tokenizer.describe()}; "
            f"valid: --vocab-size {tokenizer.vocab_size} or more, or leave it out"
        )


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (but newlines and tabs) escaped."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def decode_sample(
    path: str | None, prompt: list[int], new: list[int], vocab_size: int
) -> tuple[str, str]:
    """A prompt and its continuation as text (as ids when no tokenizer covers them)."""
    if path is None and vocab_size > BYTE_VOCAB_SIZE:
        return " ".join(map(str, prompt)), " " + " ".join(map(str, new))
    tokenizer = load_tokenizer(path)
    return tokenizer.decode(prompt), tokenizer.decode_continuation(prompt, new)
