"""Chat records rendered into tokens, each conversation encoded whole (the tokens of
``apply_chat_template(tokenize=True)``), with the tokens each assistant message adds after
its generation prompt marked as labels (docs/fine-tuning.md "Fine-tuning on chat data").
"""

from __future__ import annotations

import numpy as np

from meshwise.data.chat_templates import ChatTemplate
from meshwise.data.records import MAX_NAMED_FIELDS, DataFormatError
from meshwise.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


def chat_problem(record: dict) -> str | None:
    """Why ``record`` is not a chat record (a missing ``messages``, a message without
    string content, an unknown role), or None."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        if "messages" not in record:
            fields = ", ".join(list(record)[:MAX_NAMED_FIELDS]) or "none"
            return f"a chat record needs 'messages' (its fields: {fields})"
        return "'messages' must be a non-empty list of {role, content} objects"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f"message {i} is not a {{role, content}} object with string content"
        if message.get("role") not in ROLES:
            return f"message {i} has role {message.get('role')!r}; valid: {', '.join(ROLES)}"
    return None


def render(
    template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict]
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int64) of the rendered conversation, and whether each is an assistant
    token (bool). ``DataFormatError`` (without the record's place) when the template
    cannot render it or find its assistant tokens."""
    try:
        text, spans = template.assistant_spans(messages)
    except ValueError as exc:
        raise DataFormatError(str(exc)) from None
    except Exception as exc:  # the template's own raise_exception, or its bugs
        raise DataFormatError(
            f"the chat template {template.name} cannot render it: "
            f"{' '.join(str(exc).split())[:160]}"
        ) from None
    ids, ends = tokenizer.encode_with_ends(text)
    assistant = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        assistant |= (ends > start) & (ends <= end)
    return ids, assistant


def generation_prompt(
    template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict]
) -> tuple[list[int], str]:
    """The tokens that ask the model for the next assistant message after ``messages``,
    and the text that ends an assistant message (where generation stops)."""
    prompt = template.render(messages, add_generation_prompt=True)
    marker = "\x00"  # a content that no template changes: what follows it ends the turn
    whole = template.render(messages + [{"role": "assistant", "content": marker}])
    end = whole[whole.index(marker) + 1 :].strip() if marker in whole else ""
    return tokenizer.encode(prompt), end
