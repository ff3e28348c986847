"""Global batches with labels and document starts (``BatchSource``): a text token file's
windows, every target labelled; a chat token file's rows packed from conversations,
labelled per ``loss_on``, drawn as windows are, the last rows held out for validation.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from meshwise.data.chat_files import ChatFile, open_chat_file, record_location
from meshwise.data.dataset import SPLITS, VAL_MIN_SEQUENCES, TokenDataset
from meshwise.data.order import epoch_position, window_offsets
from meshwise.data.packing import LONG_CONVERSATIONS, LOSS_ON, Batch, PackedRows, separator_starts
from meshwise.data.token_files import read_meta

logger = logging.getLogger("meshwise")


def document_separator(meta: dict, source) -> int:
    """The end-of-text id that separates a text token file's documents; ValueError
    when its separator is not one (byte-level and newline-joined files)."""
    tokenizer = meta.get("tokenizer") or {}
    end_of_text = tokenizer.get("end_of_text")
    if end_of_text is None:
        what = (
            "byte-level, its documents joined by newlines"
            if tokenizer.get("kind", "byte-level") == "byte-level" or not tokenizer
            else f"by {tokenizer.get('path')}, which has no end-of-text token"
        )
        raise ValueError(
            f"--document-mask: {source} was tokenized {what}, which also occur "
            "inside documents; valid: --tokenizer with an end-of-text token "
            "(<|endoftext|>, <|end_of_text|>, </s>, <eos>), or chat data "
            "(--format chat)"
        )
    return int(end_of_text)


class BatchSource:
    """Global batches of ``dataset`` (a ``TokenDataset``) with their labels and, with
    ``document_mask``, their document starts. ValueError for data the settings cannot
    serve (documents without an end-of-text token, a conversation too long to
    ``refuse``, too few rows)."""

    def __init__(
        self,
        dataset: TokenDataset,
        document_mask: bool = False,
        loss_on: str = "assistant",
        long_conversations: str = "truncate",
    ):
        if loss_on not in LOSS_ON or long_conversations not in LONG_CONVERSATIONS:
            raise ValueError(
                f"loss_on {loss_on!r} / long_conversations "
                f"{long_conversations!r}; valid: {LOSS_ON} / {LONG_CONVERSATIONS}"
            )
        self.dataset, self.document_mask, self.loss_on = dataset, document_mask, loss_on
        meta = read_meta(dataset.path, dataset.dtype.name)
        self.chat = open_chat_file(dataset.path, meta)
        self.rows: PackedRows | None = None  # packed from the chat file, when there is one
        self.separator: int | None = None
        if self.chat is not None:
            self._tokens = np.memmap(dataset.path, dtype=dataset.dtype, mode="r")
            self.rows = PackedRows(self.chat.starts, self.chat.num_tokens, dataset.seq_len + 1)
            self._check_rows(self.rows, self.chat, long_conversations)
        elif document_mask:
            self.separator = document_separator(meta, dataset.path)

    def _check_rows(self, rows: PackedRows, chat: ChatFile, long_conversations: str) -> None:
        if rows.truncated and long_conversations == "refuse":
            number = rows.too_long
            where = record_location(chat.source, int(chat.records[number]), chat.data_format)
            raise ValueError(
                f"{where}: the conversation has {chat.lengths[number]} tokens, "
                f"more than --seq-len {self.dataset.seq_len} + 1; valid: --seq-len "
                f"{chat.lengths.max() - 1} or more, or --long-conversations "
                "truncate"
            )
        self.num_val = max(int(len(rows) * self.dataset.val_fraction), VAL_MIN_SEQUENCES)
        if len(rows) <= self.num_val:
            raise ValueError(
                f"the chat data {chat.source} packs into {len(rows)} rows of "
                f"--seq-len {self.dataset.seq_len} + 1 tokens; it needs more than "
                f"{self.num_val} ({self.num_val} held out for validation)"
            )
        if self.loss_on == "assistant":
            self._check_labelled(rows, chat)

    def _check_labelled(self, rows: PackedRows, chat: ChatFile) -> None:
        """Refuse data whose training rows mostly keep no assistant token: truncation cut
        every reply, so most batches would train on nothing (a loss of 0)."""
        train = rows.labelled_per_row(chat.labels)[: len(rows) - self.num_val]
        empty = int((train == 0).sum())
        if empty * 2 <= len(train):
            return
        longest = int(chat.lengths.max())
        raise ValueError(
            f"the chat data {chat.source}: {empty:,} of {len(train):,} training rows of "
            f"--seq-len {self.dataset.seq_len} + 1 tokens keep no assistant token to learn "
            f"from ({rows.truncated:,} conversations longer than a row were truncated); "
            f"valid: --seq-len {longest - 1} or more (the longest conversation has "
            f"{longest} tokens), or --long-conversations refuse to name the long ones"
        )

    def epoch_position(self, step: int, batch_size: int) -> dict:
        """Where ``--data-order epochs`` is after global batch ``step`` (of windows, or of
        rows for chat data)."""
        if self.rows is None:
            return epoch_position(
                step, batch_size, self.dataset.num_train_tokens, self.dataset.seq_len
            )
        return epoch_position(step, batch_size, len(self.rows) - self.num_val + 1, 1)

    def summary(self) -> str:
        """What packing did to the conversations ("" for text)."""
        rows, chat = self.rows, self.chat
        if rows is None:
            return ""
        assert chat is not None, "rows are packed from the chat file"
        text = (
            f"{len(chat.starts):,} conversations packed into {len(rows):,} rows of "
            f"{rows.width} tokens ({rows.padding_share:.1%} padding)"
        )
        if rows.truncated:
            text += (
                f"; {rows.truncated:,} longer than --seq-len + 1 truncated "
                f"({rows.dropped_tokens:,} tokens dropped)"
            )
        return text

    def batch(self, step: int, batch_size: int, seed: int, split: str = "train") -> Batch:
        """Global batch ``step``: the same on every rank, whatever the layout."""
        packed, chat = self.rows, self.chat
        if packed is None:
            tokens = self.dataset.global_windows(step, batch_size, seed, split)  # (B, T + 1)
            starts = None
            if self.separator is not None:
                starts = separator_starts(tokens[:, :-1], self.separator)
            return Batch(torch.from_numpy(tokens), None, starts)
        assert chat is not None, "rows are packed from the chat file"
        lo, hi = (
            (0, len(packed) - self.num_val)
            if split == "train"
            else (len(packed) - self.num_val, len(packed))
        )
        order = self.dataset.data_order if split == "train" else "random-windows"
        # Rows are items as windows are: windows of one token at a stride of one over
        # hi - lo + 1 "tokens" are the indices 0 .. hi - lo - 1.
        picked = lo + window_offsets(order, step, batch_size, seed, SPLITS[split], hi - lo + 1, 1)
        return packed.batch(picked, self._tokens, chat.labels, self.loss_on, self.document_mask)
