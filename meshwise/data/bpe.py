"""Train a byte-level BPE tokenizer locally with the ``tokenizers`` library.

GPT-2's recipe (Radford et al. 2019, section 2.2): every byte in the initial alphabet,
so any text encodes and decodes back exactly; ``<|endoftext|>`` is id 0 (docs/data.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT,)
NUM_BYTES = 256
MIN_VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)
MAX_VOCAB_SIZE = 1 << 22  # far past any real vocabulary; ids stay well inside uint32


def check_vocab_size(vocab_size: int) -> None:
    """Raise ValueError unless a byte-level BPE can have ``vocab_size`` entries."""
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"--vocab-size {vocab_size} is not valid: a byte-level BPE holds the "
            f"{NUM_BYTES} bytes and {END_OF_TEXT}, so valid: {MIN_VOCAB_SIZE} to "
            f"{MAX_VOCAB_SIZE:,}"
        )


def train_bpe(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2, show_progress: bool = False
):
    """A ``tokenizers.Tokenizer``: byte-level BPE with at most ``vocab_size`` entries.

    Fewer when the texts run out of pairs seen ``min_frequency`` times.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: decode(encode(text)) must give back text, first character included.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_tokenizer(tokenizer, out: Path) -> None:
    """Write ``tokenizer.json`` to ``out`` atomically (a temp file, then a rename)."""
    from meshwise.data.token_files import _atomic_write

    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(out, [tokenizer.to_str(pretty=True).encode()])
