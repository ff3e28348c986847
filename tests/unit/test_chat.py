"""Chat records: rendering against transformers, chat token files, packed rows."""

import json

import numpy as np
import pytest

from meshwise.data.batches import BatchSource
from meshwise.data.chat import chat_problem, generation_prompt, render
from meshwise.data.chat_files import build_chat_file, open_chat_file
from meshwise.data.chat_templates import BUILT_IN, load_template
from meshwise.data.dataset import TokenDataset, read_meta
from meshwise.data.packing import PackedRows
from meshwise.data.readers import ReadOptions
from meshwise.data.records import DataFormatError
from meshwise.data.tokenizer import ByteTokenizer, load_tokenizer
from tests.chat_data import (
    conversations,
    hf_conversation,
    hf_tokenizer,
    save_chat_tokenizer,
    write_chat_jsonl,
)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return save_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def test_tokens_and_assistant_labels_are_transformers(chat_tokenizer):
    tokenizer = load_tokenizer(chat_tokenizer)
    template = load_template(None, tokenizer.path)  # the tokenizer's own
    for messages in conversations(4):
        ids, assistant = render(template, tokenizer, messages)
        want_ids, want_mask = hf_conversation(chat_tokenizer, messages)
        assert ids.tolist() == want_ids
        assert assistant.astype(int).tolist() == want_mask
    question = conversations(2)[1][:1]
    prompt, end = generation_prompt(template, tokenizer, question)
    assert (
        prompt
        == hf_tokenizer(str(chat_tokenizer)).apply_chat_template(
            question, tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n") and end == "<|im_end|>"


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_each_shipped_template_labels_what_transformers_masks(chat_tokenizer, name):
    tokenizer, template = load_tokenizer(chat_tokenizer), load_template(name, None)
    hf = hf_tokenizer(str(chat_tokenizer))
    for messages in conversations(6):
        ids, assistant = render(template, tokenizer, messages)
        want = hf.apply_chat_template(
            messages,
            chat_template=BUILT_IN[name],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert ids.tolist() == list(want["input_ids"])
        assert assistant.astype(int).tolist() == list(want["assistant_masks"])
        assert any(assistant)


def test_a_template_the_tokenizer_lacks_names_what_is_available(chat_tokenizer, tmp_path):
    with pytest.raises(
        ValueError, match="byte-level text has no chat template; available: chatml, a .jinja file"
    ):
        load_template(None, None)
    with pytest.raises(
        ValueError, match="has no template 'tool_use'; available: tokenizer, chatml"
    ):
        load_template("tool_use", str(chat_tokenizer / "tokenizer.json"))
    ids, assistant = render(load_template("chatml", None), ByteTokenizer(), conversations(2)[1])
    text = bytes(ids.tolist()).decode()
    assert text.startswith("<|im_start|>user\nWhat is")
    assert bytes(ids[assistant].tolist()).decode().endswith(".<|im_end|>")  # not the newline


def test_bad_records_name_their_line(tmp_path):
    assert (
        chat_problem(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}
        )
        == "message 1 has role 'bot'; valid: system, user, assistant, tool"
    )
    assert chat_problem({"text": "hi"}) == "a chat record needs 'messages' (its fields: text)"
    path = tmp_path / "chat.jsonl"
    write_chat_jsonl(path, 3)
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace('"assistant"', '"robot"', 1)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match="chat.jsonl:2: message 1 has role 'robot'"):
        build_chat_file(tmp_path / "chat.bin", path, ByteTokenizer(), load_template("chatml", None))
    stats = build_chat_file(
        tmp_path / "chat.bin",
        path,
        ByteTokenizer(),
        load_template("chatml", None),
        ReadOptions(skip_bad_records=True),
    )
    assert stats["conversations"] == 2 and "1 bad record skipped" in stats["skipped"]


def test_rows_pack_whole_conversations_and_label_their_assistant_tokens(tmp_path):
    lengths = [30, 20, 50, 9, 70, 5]  # rows of 64: [30 20] [50 9] [70 -> 64] [5]
    rows = PackedRows(np.cumsum([0] + lengths[:-1]), sum(lengths), 64)
    assert rows.row_len.tolist() == [50, 59, 64, 5] and rows.truncated == 1
    assert rows.dropped_tokens == 6
    tokens = np.arange(sum(lengths)) % 7 + 1
    labels = np.zeros(sum(lengths), dtype=np.uint8)
    labels[10:35] = 1  # the end of conversation 0 and the start of conversation 1
    batch = rows.batch(np.array([0, 3]), tokens, labels, "assistant", document_mask=True)
    assert batch.tokens.shape == (2, 64) and batch.tokens[1, 5:].eq(0).all()
    label = batch.labels[0]  # target t is token t + 1
    assert label[9:29].all() and not label[29]  # token 30 starts conversation 1: no target
    assert label[30:34].all() and not label[34:].any()
    assert np.flatnonzero(batch.starts[0]).tolist() == [0, 30, 50]
    assert np.flatnonzero(batch.starts[1]).tolist() == [0, 5]  # padding: its own
    every = rows.batch(np.array([0]), tokens, labels, "all", document_mask=False)
    assert every.starts is None and every.num_labelled == 50 - 2


def test_a_conversation_too_long_to_refuse_is_named(tmp_path):
    path = tmp_path / "chat.jsonl"
    chats = conversations(12)
    chats[7][1]["content"] = "x" * 400
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    build_chat_file(tmp_path / "chat.bin", path, ByteTokenizer(), load_template("chatml", None))
    dataset = TokenDataset(tmp_path / "chat.bin", 255, vocab_size=256)
    source = BatchSource(dataset)
    assert (
        source.rows.truncated == 1 and "1 longer than --seq-len + 1 truncated" in source.summary()
    )
    with pytest.raises(
        ValueError,
        match=r"chat.jsonl:8: the conversation has \d+ tokens, more "
        "than --seq-len 255 \\+ 1; valid: --seq-len",
    ):
        BatchSource(dataset, long_conversations="refuse")
    chat = open_chat_file(tmp_path / "chat.bin", read_meta(tmp_path / "chat.bin"))
    assert chat.records.tolist() == list(range(12)) and chat.labels.sum() > 0


def test_labelled_targets_per_row_are_what_the_batches_label(tmp_path):
    lengths = [30, 20, 50, 9, 70, 5]
    rows = PackedRows(np.cumsum([0] + lengths[:-1]), sum(lengths), 64)
    labels = np.zeros(sum(lengths), dtype=np.uint8)
    labels[10:35] = 1
    labels[100:160] = 1  # conversation 4 (tokens 109 to 178): its first token is no target
    tokens = np.arange(sum(lengths)) % 7 + 1
    expected = [
        rows.batch(np.array([r]), tokens, labels, "assistant", False).num_labelled
        for r in range(len(rows))
    ]
    assert rows.labelled_per_row(labels).tolist() == expected == [24, 8, 50, 0]


def test_chat_data_truncated_to_no_assistant_token_is_refused_naming_the_fix(tmp_path):
    path = tmp_path / "chat.jsonl"
    chats = conversations(40)
    for chat in chats:  # a long user turn first: truncation leaves no reply
        chat[0]["content"] = "y" * 200
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    build_chat_file(tmp_path / "chat.bin", path, ByteTokenizer(), load_template("chatml", None))
    with pytest.raises(
        ValueError,
        match=r"chat.jsonl: \d+ of \d+ training rows of --seq-len 32 \+ 1 tokens keep no "
        r"assistant token.*valid: --seq-len \d+ or more .*--long-conversations refuse",
    ):
        BatchSource(TokenDataset(tmp_path / "chat.bin", 32, vocab_size=256))
    BatchSource(TokenDataset(tmp_path / "chat.bin", 32, vocab_size=256), loss_on="all")


def test_document_masks_need_an_end_of_text_token(tmp_path):
    path = tmp_path / "bytes.bin"
    np.arange(4000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(path)
    with pytest.raises(
        ValueError, match="--document-mask: .* byte-level, its documents joined by newlines"
    ):
        BatchSource(TokenDataset(path, 32), document_mask=True)


def test_epochs_read_every_training_row_once(tmp_path):
    path = tmp_path / "chat.jsonl"
    write_chat_jsonl(path, 60)
    build_chat_file(tmp_path / "chat.bin", path, ByteTokenizer(), load_template("chatml", None))
    source = BatchSource(TokenDataset(tmp_path / "chat.bin", 255, data_order="epochs"))
    train_rows = len(source.rows) - source.num_val
    width = source.rows.width
    first = [
        tuple(row)
        for step in range(1, train_rows + 1)
        for row in source.batch(step, 1, seed=3).tokens.tolist()
    ]
    wanted = {
        tuple(np.pad(source._tokens[s : s + n], (0, width - n)).tolist())
        for s, n in zip(source.rows.row_start[:train_rows], source.rows.row_len)
    }
    assert len(set(first)) == train_rows and set(first) == wanted
    assert source.epoch_position(train_rows, 1) == {
        "epoch": 1,
        "epoch_windows": train_rows,
        "windows_per_epoch": train_rows,
    }
