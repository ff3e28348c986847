"""Chat data built in the test (no downloads): a small byte-level BPE tokenizer with
ChatML's special tokens and a template that marks the assistant's text with
``{% generation %}`` (so transformers computes the assistant mask on its own),
and conversations written as JSON lines.

``hf_conversation`` is the independent side: transformers' ``apply_chat_template``
renders, tokenizes and masks a conversation, without meshwise."""

from __future__ import annotations

import json
import random

# ChatML, with the assistant's content and end-of-turn inside a generation block.
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['role'] == 'assistant' %}{% generation %}"
            "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
            "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|im_start|>", "<|im_end|>"]


def conversations(count: int = 24, seed: int = 0) -> list[list[dict]]:
    """Sums asked and answered; every third one with a system prompt and a second turn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        messages = [{"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
        if i % 3 == 0:
            messages = ([{"role": "system", "content": "You add numbers."}] + messages
                        + [{"role": "user", "content": "Twice that?"},
                           {"role": "assistant", "content": f"{2 * (a + b)}."}])
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
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def hf_conversation(folder, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' tokens of the rendered conversation and its assistant mask."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])
