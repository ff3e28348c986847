"""Chat data built in the test (no downloads): a small byte-level BPE tokenizer with
ChatML's special tokens and a template that marks the assistant's text with
``{% generation %}`` (so transformers computes the assistant mask on its own),
and conversations written as JSON lines.

``hf_conversation`` is the independent side: transformers' ``apply_chat_template``
renders, tokenizes and masks a conversation, without meshwise."""

from __future__ import annotations

import functools
import json
import random

import torch
import torch.nn.functional as F

# ChatML, with the assistant's content and end-of-turn inside a generation block.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|im_start|>", "<|im_end|>"]


def conversations(count: int = 24, seed: int = 0) -> list[list[dict]]:
    """Sums asked and answered; every third one with a system prompt and a second turn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        messages = [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
        ]
        if i % 3 == 0:
            messages = (
                [{"role": "system", "content": "You add numbers."}]
                + messages
                + [
                    {"role": "user", "content": "Twice that?"},
                    {"role": "assistant", "content": f"{2 * (a + b)}."},
                ]
            )
        out.append(messages)
    return out


def write_chat_jsonl(path, count: int = 24, seed: int = 0) -> list[list[dict]]:
    chats = conversations(count, seed)
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return chats


def save_chat_tokenizer(folder, vocab_size: int = 299):
    """``tokenizer.json`` (byte-level BPE + ChatML's tokens, ids below 301) and a
    ``tokenizer_config.json`` holding ``TEMPLATE``."""
    from meshwise.data.bpe import save_tokenizer, train_bpe

    texts = [m["content"] for chat in conversations(200, seed=1) for m in chat] * 3
    tokenizer = train_bpe(texts, vocab_size)
    tokenizer.add_special_tokens(SPECIAL)
    folder.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return folder


@functools.lru_cache(maxsize=2)
def hf_tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def chat_model_and_data(root, count: int = 40):
    """A random HF Llama in ``root / "hf"`` with the chat tokenizer beside it (its
    ``tokenizer.json`` the default ``--tokenizer`` of ``--init-from``), and ``count``
    conversations in ``root / "chat.jsonl"``: ``(hf_dir, conversations)``."""
    from tests.hf_llama import save_hf_llama

    hf_dir = save_chat_tokenizer(root / "hf")
    save_hf_llama(hf_dir, max_position_embeddings=256)
    return hf_dir, write_chat_jsonl(root / "chat.jsonl", count=count)


def hf_conversation(folder, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' tokens of the rendered conversation and its assistant mask."""
    out = hf_tokenizer(str(folder)).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def hf_reference(hf_dir, rows: torch.Tensor, chats, alone: bool = False) -> float:
    """Mean cross-entropy over the assistant tokens of ``rows``: each row's conversations
    found by transformers' own rendering, their labels its assistant masks; the logits
    of transformers' Llama over the whole row (``alone``: over each conversation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    rendered = [hf_conversation(hf_dir, messages) for messages in chats]
    total, count = 0.0, 0
    for row in rows.tolist():
        at, pieces = 0, []
        while at < len(row):
            found = [r for r in rendered if row[at : at + len(r[0])] == r[0]]
            if not found:
                assert not any(row[at:]), "a row is whole conversations, then padding (0)"
                break
            pieces.append((at, *found[0]))
            at += len(found[0][0])
        with torch.no_grad():
            whole = None if alone else model(torch.tensor([row])).logits[0]
            for start, ids, mask in pieces:
                logits = (
                    model(torch.tensor([ids])).logits[0]
                    if alone
                    else whole[start : start + len(ids)]
                )
                labelled = torch.tensor(mask[1:], dtype=torch.bool)  # targets: tokens 1..
                total += F.cross_entropy(
                    logits[:-1][labelled], torch.tensor(ids[1:])[labelled], reduction="sum"
                ).item()
                count += int(labelled.sum())
    return total / count
