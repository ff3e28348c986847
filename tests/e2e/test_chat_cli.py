"""Fine-tuning on chat data from the command line, with document masks, against
transformers; ``generate --chat``; bad chat input refused before any rank starts."""

import json
import re

import pytest

from tests.chat_data import chat_model_and_data, hf_reference
from tests.e2e.conftest import read_metrics, run_cli, run_main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-cli")
    return (root, *chat_model_and_data(root))


@pytest.mark.timeout(300)
def test_masked_fine_tuning_loss_is_transformers_on_each_conversation(sft):
    from meshwise.data.batches import BatchSource
    from meshwise.data.dataset import TokenDataset

    root, hf_dir, chats = sft
    result = run_cli(
        "train",
        "--init-from",
        hf_dir,
        "--data",
        root / "chat.jsonl",
        "--format",
        "chat",
        "--document-mask",
        "--dp",
        1,
        "--seq-len",
        128,
        "--batch-size",
        8,
        "--steps",
        1,
        "--metrics",
        root / "m.jsonl",
        "--save",
        root / "ckpt",
        "-q",
        cwd=root,
    )
    assert result.returncode == 0, result.stderr
    [record] = read_metrics(root / "m.jsonl")
    [chat_bin] = (root / "cache").glob("chat-chat-*.bin")
    batch = BatchSource(TokenDataset(chat_bin, 128), document_mask=True).batch(1, 8, 1234)
    want = hf_reference(hf_dir, batch.tokens, chats, alone=True)
    assert record["loss"] == pytest.approx(want, rel=1e-5)
    assert record["labelled_tokens"] == batch.num_labelled < record["tokens"]
    config = json.loads((root / "m.jsonl.config.json").read_text())["config"]["data"]
    assert config["format"] == "chat" and config["chat_template"] == "tokenizer"
    answer = run_main(
        "generate",
        "--checkpoint",
        root / "ckpt",
        "--prompt",
        "What is 2 + 2?",
        "--chat",
        "--max-new-tokens",
        12,
        "--temperature",
        0,
        cwd=root,
    )
    assert answer.returncode == 0, answer.stderr
    assert "<|im_end|>" not in answer.stdout and "<|im_start|>" not in answer.stdout


def test_bad_chat_input_is_refused_before_any_rank_starts(sft, tmp_path, corpus):
    root, hf_dir, chats = sft
    bad = tmp_path / "bad.jsonl"
    lines = (root / "chat.jsonl").read_text().splitlines()
    lines[2] = lines[2].replace('"assistant"', '"bot"', 1)
    bad.write_text("\n".join(lines) + "\n")
    chat = ["--data", root / "chat.jsonl", "--format", "chat", "--seq-len", "32"]
    for args, message in [
        (
            ["--data", bad, "--format", "chat", "--tokenizer", hf_dir],
            "bad.jsonl:3: message 1 has role 'bot'; valid: system, user, assistant, tool",
        ),
        (chat, "byte-level text has no chat template; available: chatml, a .jinja file"),
        (
            chat + ["--tokenizer", hf_dir, "--chat-template", "tool_use"],
            "has no template 'tool_use'; available: tokenizer, chatml, a .jinja file",
        ),
        (
            chat + ["--tokenizer", hf_dir, "--long-conversations", "refuse"],
            "chat.jsonl:1: the conversation has",
        ),
        (["--data", corpus, "--document-mask"], "--document-mask: .* byte-level"),
        (
            ["--data", root / "chat.jsonl"],
            r"chat.jsonl:1: the record has no field 'text' \(its "
            r"fields: messages\); .* or --format chat",
        ),
    ]:
        result = run_main("train", *args, cwd=tmp_path)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and re.search(message, lines[0]), lines
