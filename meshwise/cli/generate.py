"""``meshwise generate --checkpoint CKPT --prompt TEXT ...`` (``meshwise.serve.generate``)."""

from __future__ import annotations

from meshwise.data.tokenizer import printable
from meshwise.serve.generate import continue_prompt


def add_generate_arguments(parser) -> None:
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoint directory, or a --save directory (its newest)",
    )
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=200,
        help="tokens to generate (default 200; fewer if the context fills)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="softmax temperature; 0 picks the most likely token (default 0.8)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sample among the K most likely tokens; 0: all (default 0)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="--prompt is a user's message: render it with the chat template the "
        "model was fine-tuned with (--format chat) and print the "
        "assistant's answer, up to its end-of-turn marker",
    )
    parser.add_argument(
        "--chat-template",
        metavar="NAME",
        help="with --chat: tokenizer, tokenizer:NAME, chatml or a .jinja file "
        "(default: the one the checkpoint was fine-tuned with, else the "
        "tokenizer's own)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="the tokenizer.json the checkpoint was trained with, when it is no "
        "longer where training found it (default: the one its "
        "configuration names; byte-level if none)",
    )


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
    """What ``meshwise generate`` prints: the prompt and its continuation."""
    check_generate_arguments(args)
    if args.chat_template and not args.chat:
        raise ValueError("--chat-template needs --chat")
    text = continue_prompt(
        args.checkpoint,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
        args.tokenizer,
        args.chat,
        args.chat_template,
    )
    return printable(text if args.chat else args.prompt + text)
