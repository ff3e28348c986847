"""``meshwise generate``: sample from a checkpoint on one process, with a KV cache.

The prompt goes through the model once (filling each layer's keys and values);
each new token then costs one position's forward instead of the whole prefix.
Text is byte-level, as the default training corpus is.
"""

from __future__ import annotations

import sys

import torch

from meshwise.checkpoint.model import load_model, open_checkpoint
from meshwise.models.kv_cache import LayerCache


def add_generate_arguments(parser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory, or a --save directory (its newest)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200,
                        help="tokens to generate (default 200; fewer if the context fills)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature; 0 picks the most likely token (default 0.8)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the K most likely tokens; 0: all (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


def check_generate_arguments(args) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {args.top_k}")
    if not args.prompt:
        raise ValueError("--prompt must not be empty")


def run_generate(args) -> str:
    check_generate_arguments(args)
    model = load_model(open_checkpoint(args.checkpoint))
    if model.cfg.vocab_size != 256:
        raise ValueError(f"the checkpoint's vocabulary has {model.cfg.vocab_size} tokens; "
                         "--prompt text is encoded byte-level (256)")
    prompt = list(args.prompt.encode("utf-8"))
    if len(prompt) >= model.cfg.block_size:
        raise ValueError(f"--prompt is {len(prompt)} bytes; the model's context is "
                         f"{model.cfg.block_size}")
    tokens = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                      args.seed)
    return bytes(tokens).decode("utf-8", errors="replace")


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (but newlines and tabs) escaped."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0) -> list[int]:
    """New tokens after ``prompt`` (stops when the model's context is full)."""
    gen = torch.Generator().manual_seed(seed)
    cache = [LayerCache() for _ in model.blocks]
    inputs = torch.tensor([prompt])  # (1, P)
    out: list[int] = []
    budget = min(max_new_tokens, model.cfg.block_size - len(prompt))
    for _ in range(budget):
        logits = model(inputs, cache=cache)[0, -1].float()  # (V,)
        token = _pick(logits, temperature, top_k, gen)
        out.append(token)
        inputs = torch.tensor([[token]])  # (1, 1): the cache holds the rest
    if budget < max_new_tokens:
        print(f"meshwise generate: stopped after {budget} tokens: the model's context of "
              f"{model.cfg.block_size} is full", file=sys.stderr)
    return out


def _pick(logits: torch.Tensor, temperature: float, top_k: int, gen) -> int:
    if temperature == 0:
        return int(logits.argmax())
    if top_k:
        cutoff = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
