"""Chat templates: a conversation rendered as text by a Jinja2 program (the tokenizer's,
``chatml`` or a ``.jinja`` file) in a sandbox set up as transformers sets up
``apply_chat_template``; ``assistant_spans`` finds the labels. See docs/fine-tuning.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path

# An assistant message's content and <|im_end|> are its generation (the newline after
# is the template's): transformers' return_assistant_tokens_mask marks them alone.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILT_IN = {"chatml": CHATML}
TOKENIZER_OWN = "tokenizer"  # --chat-template's default: the tokenizer's own template
# Around what a {% generation %} block renders (private-use characters, refused in messages).
GENERATION_START, GENERATION_END = "\ue000", "\ue001"
_MARKS = re.compile(f"([{GENERATION_START}{GENERATION_END}])")


@dataclass(frozen=True)
class ChatTemplate:
    """A template's source and what it renders with. ``name``: what ``--chat-template``
    names it by (``tokenizer``, ``tokenizer:NAME``, a built-in name, a file path)."""

    name: str
    source: str
    special: dict = field(default_factory=dict, hash=False)  # bos_token, eos_token, ...

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return _MARKS.sub("", self._marked(messages, add_generation_prompt))

    def _marked(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return _compiled(self.source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special
        )

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation rendered, and the ``[start, end)`` character spans of
        its assistant messages: what its ``{% generation %}`` blocks render, as
        transformers' ``return_assistant_tokens_mask`` takes them; in a template without
        such blocks, from the end of the conversation before the message rendered with
        the generation prompt to the end of the conversation up to and including it.
        ValueError when the template does not render a conversation's beginning as the
        beginning of the whole (its spans could not be found)."""
        for i, message in enumerate(messages):
            if _MARKS.search(message["content"]):
                raise ValueError(
                    f"message {i} holds U+E000 or U+E001, which mark the template's "
                    "generation blocks; valid: text without them"
                )
        marked = self._marked(messages)
        if GENERATION_START in marked:
            return _generation_spans(marked)
        text = _MARKS.sub("", marked)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(prompt) and text.startswith(upto)):
                raise ValueError(
                    f"the chat template {self.name} renders the conversation up "
                    f"to message {i} differently inside the whole conversation, "
                    "so its assistant tokens cannot be found; valid: "
                    "--chat-template chatml, or a template that renders each "
                    "message the same whatever follows it"
                )
            spans.append((len(prompt), len(upto)))
        return text, spans


def _generation_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """``marked`` without its marks, and the spans its generation blocks rendered."""
    text, spans, at, start = [], [], 0, 0
    for piece in _MARKS.split(marked):
        if piece == GENERATION_START:
            start = at
        elif piece == GENERATION_END:
            if at > start:
                spans.append((start, at))
        else:
            text.append(piece)
            at += len(piece)
    return "".join(text), spans


@lru_cache(maxsize=8)
def _compiled(source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %} ... {% endgeneration %}``: its body, as rendered, between
        ``GENERATION_START`` and ``GENERATION_END``."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_marked")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _marked(self, caller) -> str:
            return GENERATION_START + caller() + GENERATION_END

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt)
    )
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            f"the chat template does not parse: {exc.message} (line {exc.lineno})"
        ) from None


def _tokenizer_config(tokenizer_path: str | None) -> tuple[Path | None, dict]:
    """The folder of a ``tokenizer.json`` and its ``tokenizer_config.json`` (or {})."""
    if tokenizer_path is None:
        return None, {}
    folder = Path(tokenizer_path)
    folder = folder if folder.is_dir() else folder.parent
    config = folder / "tokenizer_config.json"
    try:
        loaded = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config}: not a readable JSON file ({exc})") from None
    return folder, loaded if isinstance(loaded, dict) else {}


def _special_tokens(config: dict) -> dict:
    """The tokenizer's special tokens by name, as templates read them (strings)."""
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def tokenizer_templates(tokenizer_path: str | None) -> dict[str, str]:
    """The tokenizer's own templates by name (``default`` for a single one)."""
    folder, config = _tokenizer_config(tokenizer_path)
    own = config.get("chat_template")
    if isinstance(own, str):
        return {"default": own}
    if isinstance(own, list):
        return {
            item["name"]: item["template"]
            for item in own
            if isinstance(item, dict) and "name" in item and "template" in item
        }
    if folder is not None and (folder / "chat_template.jinja").is_file():
        return {"default": (folder / "chat_template.jinja").read_text()}
    return {}


def load_template(name: str | None, tokenizer_path: str | None) -> ChatTemplate:
    """The template ``--chat-template NAME`` names: ``tokenizer`` (or None: the
    tokenizer's own), one of its named templates (``tokenizer:tool_use`` or just
    ``tool_use``), a built-in (``chatml``) or a ``.jinja`` file. ValueError naming what
    is available when the tokenizer lacks it."""
    name = name or TOKENIZER_OWN
    _, config = _tokenizer_config(tokenizer_path)
    special = _special_tokens(config)
    own = tokenizer_templates(tokenizer_path)
    key = name.removeprefix(TOKENIZER_OWN + ":") if name != TOKENIZER_OWN else "default"
    if key in own:
        return ChatTemplate(name, own[key], special)
    if name in BUILT_IN:
        return ChatTemplate(name, BUILT_IN[name], special)
    if name.endswith(".jinja") and Path(name).is_file():
        return ChatTemplate(str(Path(name).resolve()), Path(name).read_text(), special)
    whose = f"the tokenizer {tokenizer_path}" if tokenizer_path else "byte-level text"
    available = [f"{TOKENIZER_OWN}:{n}" if n != "default" else TOKENIZER_OWN for n in own]
    available += list(BUILT_IN) + ["a .jinja file"]
    lacks = "has no chat template" if not own else f"has no template {name!r}"
    raise ValueError(f"--chat-template {name}: {whose} {lacks}; available: {', '.join(available)}")
