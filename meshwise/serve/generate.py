"""Sampling from a checkpoint on one process, with a KV cache (``meshwise generate``), in
the tokenizer the checkpoint was trained with (byte-level when it names none).
"""

from __future__ import annotations

import os
import sys

import torch

from meshwise.checkpoint.store import open_checkpoint
from meshwise.data.chat import generation_prompt
from meshwise.data.chat_templates import ChatTemplate, load_template
from meshwise.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from meshwise.models.kv_cache import LayerCache
from meshwise.serve.model import load_model, model_config


def continue_prompt(
    checkpoint: str | os.PathLike,
    prompt_text: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
    tokenizer_path: str | None = None,
    chat: bool = False,
    chat_template: str | None = None,
) -> str:
    """The text ``checkpoint``'s model generates after ``prompt_text``, encoded and
    decoded with the tokenizer it was trained with (``tokenizer_path``: a copy of
    it, when it has moved). ``chat``: ``prompt_text`` is a user's message, rendered
    with the chat template the model was fine-tuned with (or ``chat_template``), and
    the answer is the assistant's message, up to its end-of-turn marker."""
    ckpt = open_checkpoint(checkpoint)
    model, cfg = load_model(ckpt), model_config(ckpt)  # the config the model was built from
    data = ckpt.meta.get("config", {}).get("data", {})
    tokenizer = checkpoint_tokenizer(data, tokenizer_path)
    vocab_size = cfg.vocab_size
    if tokenizer.kind == ByteTokenizer.kind and vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"the checkpoint's vocabulary has {vocab_size} tokens and it names no "
            "tokenizer; --prompt text would be encoded byte-level (256): pass "
            "--tokenizer PATH"
        )
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"--tokenizer {tokenizer.describe()} has more tokens than the "
            f"checkpoint's vocabulary of {vocab_size}"
        )
    prompt, end = tokenizer.encode(prompt_text), None
    if chat:
        template = chat_template_of(data, chat_template, tokenizer)
        prompt, end = generation_prompt(
            template, tokenizer, [{"role": "user", "content": prompt_text}]
        )
    if not prompt or len(prompt) >= cfg.block_size:
        raise ValueError(
            f"--prompt is {len(prompt)} tokens; the model's context holds 1 to {cfg.block_size - 1}"
        )

    def ended(tokens: list[int]) -> bool:
        if not end:
            return False
        return end in tokenizer.decode_continuation(prompt, tokens)

    tokens = generate(model, prompt, max_new_tokens, temperature, top_k, seed, stop=ended)
    text = tokenizer.decode_continuation(prompt, tokens)
    return text.split(end)[0] if end else text


def chat_template_of(data: dict, name: str | None, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template ``--chat-template`` names, else the one the checkpoint's data was
    rendered with (the same by digest), else the tokenizer's own."""
    recorded, digest = data.get("chat_template"), data.get("chat_template_digest")
    template = load_template(name or recorded, tokenizer.path)
    if name is None and digest and template.digest != digest:
        raise ValueError(
            f"the chat template {template.name} changed since the model was "
            f"fine-tuned with it (digest {template.digest}, then {digest}); pass "
            "--chat-template to the one it was trained with"
        )
    return template


def checkpoint_tokenizer(data: dict, flag: str | None) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: ``data`` is its configuration's section,
    ``flag`` (``--tokenizer``) must be that file by digest. Raises ValueError naming the
    recorded path when it cannot be found or has changed.
    """
    path, digest = data.get("tokenizer"), data.get("tokenizer_digest")
    if flag:
        tokenizer = load_tokenizer(flag)
        if digest and tokenizer.digest != digest:
            raise ValueError(
                f"--tokenizer {tokenizer.describe()} is not the tokenizer the "
                f"checkpoint was trained with: {path} (digest {digest})"
            )
        return tokenizer
    if not path:
        return ByteTokenizer()
    try:
        tokenizer = load_tokenizer(path)
    except ValueError:
        raise ValueError(
            f"the checkpoint was trained with the tokenizer {path} (digest "
            f"{digest}), which cannot be read there; pass --tokenizer PATH to a "
            "copy of it"
        ) from None
    if tokenizer.digest != digest:
        raise ValueError(
            f"the tokenizer {path} changed since the checkpoint was trained with "
            f"it (digest {tokenizer.digest}, then {digest}); pass --tokenizer PATH "
            "to the one it was trained with"
        )
    return tokenizer


@torch.no_grad()
def generate(
    model,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
    stop=None,
) -> list[int]:
    """New tokens after ``prompt`` (stops when the model's context is full, or when
    ``stop(tokens so far)`` says so)."""
    gen = torch.Generator().manual_seed(seed)
    cache = [LayerCache() for _ in range(model.cfg.n_layer)]
    inputs = torch.tensor([prompt])  # (1, P)
    out: list[int] = []
    budget = min(max_new_tokens, model.cfg.block_size - len(prompt))
    for _ in range(budget):
        logits = model(inputs, cache=cache)[0, -1].float()  # (V,)
        token = _pick(logits, temperature, top_k, gen)
        out.append(token)
        if stop is not None and stop(out):
            return out
        inputs = torch.tensor([[token]])  # (1, 1): the cache holds the rest
    if budget < max_new_tokens:
        print(
            f"meshwise generate: stopped after {budget} tokens: the model's context of "
            f"{model.cfg.block_size} is full",
            file=sys.stderr,
        )
    return out


def _pick(logits: torch.Tensor, temperature: float, top_k: int, gen) -> int:
    if temperature == 0:
        return int(logits.argmax())
    if top_k:
        cutoff = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
