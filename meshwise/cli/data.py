"""``meshwise data prepare`` (documents to a token file) and ``meshwise data train-tokenizer``
(a byte-level BPE); bad input exits 2 with one line. See docs/data.md.
"""

from __future__ import annotations

import itertools
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from meshwise.cli import launch
from meshwise.data.corpus import plan_pieces, read_piece
from meshwise.data.files import available_cpus
from meshwise.data.readers import (
    DATA_FORMATS,
    DataFile,
    ReadOptions,
    RecordCounts,
    data_files,
    file_documents,
)
from meshwise.data.token_files import _ours, exclusive_build, sidecar_path
from meshwise.data.tokenizer import ByteTokenizer

TEXT_INPUT = (
    "a text, JSON lines, Parquet or CSV file, a folder of them, or a datasets save_to_disk folder"
)


def add_data_arguments(parser) -> None:
    """The ``prepare`` and ``train-tokenizer`` subcommands of ``meshwise data``."""
    commands = parser.add_subparsers(dest="data_command", required=True)
    prepare = _text_command(
        commands,
        "prepare",
        "tokenize text into a token file for --data",
        "Tokenize a file, or every file under a folder (sorted; binary files skipped), into "
        "FILE.bin and its sidecar FILE.bin.meshwise.json, in parallel processes. A text "
        "file is one document; each record of a JSON lines (.jsonl), Parquet, CSV or "
        "datasets save_to_disk source is one (its --text-field). Documents are joined by "
        "the tokenizer's end-of-text token; byte-level joins them with a newline.",
    )
    prepare.add_argument(
        "--out",
        required=True,
        metavar="FILE.bin",
        help="the token file to write (replaced atomically if meshwise wrote it)",
    )
    prepare.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a Hugging Face tokenizer.json, or a folder holding one "
        "(default: byte-level, vocab 256)",
    )
    prepare.add_argument(
        "--workers",
        type=int,
        default=available_cpus(),
        metavar="N",
        help="processes encoding in parallel (default: the CPUs available, "
        f"{available_cpus()} here)",
    )
    prepare.add_argument(
        "--format",
        choices=("text", "chat"),
        default="text",
        help="chat: each record's 'messages' ([{role, content}, ...]) rendered "
        "with --chat-template, one conversation each, with the assistant's "
        "tokens marked in FILE.bin.labels for --loss-on (default: text)",
    )
    prepare.add_argument(
        "--chat-template",
        metavar="NAME",
        default=None,
        help="with --format chat: tokenizer (its tokenizer_config.json's "
        "chat_template), tokenizer:NAME, chatml (built in) or a .jinja "
        "file (default: tokenizer)",
    )
    train = _text_command(
        commands,
        "train-tokenizer",
        "train a byte-level BPE tokenizer on local text",
        "Learn a byte-level BPE (GPT-2's scheme, <|endoftext|> as id 0) from a text file or "
        "a folder of text files, without downloading anything; write it as a tokenizer.json "
        "for --tokenizer, tokenizers.Tokenizer.from_file and "
        "transformers.PreTrainedTokenizerFast(tokenizer_file=...).",
    )
    train.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        metavar="N",
        help="entries in the vocabulary: 256 bytes, <|endoftext|> and the "
        "merges (fewer if the text runs out of repeated pairs)",
    )
    train.add_argument(
        "--out",
        required=True,
        metavar="tokenizer.json",
        help="where to write the tokenizer (a folder: FOLDER/tokenizer.json)",
    )


def _text_command(commands, name: str, help_text: str, description: str):
    """A subcommand whose first argument is the data to read, and how records are read."""
    command = commands.add_parser(name, help=help_text, description=description)
    command.add_argument("input", metavar="INPUT", help=TEXT_INPUT)
    add_read_arguments(command)
    return command


def add_read_arguments(parser) -> None:
    """``--text-field``, ``--data-format`` and ``--skip-bad-records``, as ``train`` has them."""
    from meshwise.cli.train_flags import TRAIN_FLAGS

    defaults = ReadOptions()
    for flag, _, field, kind, help_text in TRAIN_FLAGS:
        if not hasattr(defaults, field):
            continue
        if kind is bool:
            parser.add_argument(flag, dest=field, action="store_true", help=help_text)
        else:
            default = getattr(defaults, field)
            parser.add_argument(
                flag,
                dest=field,
                type=kind,
                default=default,
                help=f"{help_text} (default: {default})",
            )


def read_options(args) -> ReadOptions:
    if args.data_format not in DATA_FORMATS:
        raise ValueError(
            f"--data-format {args.data_format!r} is not valid; valid: {', '.join(DATA_FORMATS)}"
        )
    return ReadOptions(args.text_field, args.data_format, args.skip_bad_records)


def run_data(args) -> int:
    """Run ``meshwise data ...``; a ValueError becomes exit status 2 and one line.

    Ctrl-C or SIGTERM stop it at once, leaving no temporary file behind."""
    previous = signal.signal(signal.SIGTERM, launch.raise_stopped)
    try:
        if args.data_command == "prepare":
            print(_prepare(args))
        else:
            print(_train_tokenizer(args))
    except ValueError as exc:
        print(f"meshwise data {args.data_command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, launch.Stopped) as exc:
        signum = exc.signum if isinstance(exc, launch.Stopped) else signal.SIGINT
        print(
            f"meshwise data {args.data_command}: {signal.Signals(signum).name}: stopped, "
            "nothing written",
            file=sys.stderr,
        )
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _input_files(text: str, options: ReadOptions) -> tuple[Path, list[DataFile]]:
    path = Path(text).expanduser()
    if not path.exists():
        what = "is a symbolic link to nothing" if path.is_symlink() else "does not exist"
        raise ValueError(f"INPUT {text} {what}; expected {TEXT_INPUT}")
    if path.is_file() and path.suffix == ".bin":
        raise ValueError(f"INPUT {text} is a .bin (already tokens?); expected {TEXT_INPUT}")
    return path, data_files(path.resolve(), options.data_format)


def _check_out(out: Path) -> None:
    """``--out`` must name a ``.bin`` that is new or one meshwise wrote (its sidecar says so)."""
    if out.suffix != ".bin" or out.is_dir():
        raise ValueError(f"--out {out} is not valid; expected a file name ending in .bin")
    if out.exists():
        side = sidecar_path(out)
        if not side.exists():
            raise ValueError(
                f"--out {out} exists and was not written by meshwise; it is left "
                "alone: choose another name or remove it"
            )
        _ours(side)  # raises for a file of that name someone else wrote


def _prepare(args) -> str:
    from meshwise.data.sources import build_with_progress
    from meshwise.data.tokenizer import load_tokenizer

    options = read_options(args)
    path, files = _input_files(args.input, options)
    out = Path(args.out).expanduser()
    _check_out(out)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.format == "chat":
        return _prepare_chat(args, options, path, out, tokenizer)
    try:
        with exclusive_build(out):
            stats = build_with_progress(
                out, files, tokenizer, str(path.resolve()), args.workers, options
            )
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    skipped = f" ({stats['skipped']} binary skipped)" if stats["skipped"] else ""
    bad = stats["records"].summary()
    workers = f"{args.workers} worker{'s' if args.workers > 1 else ''}"
    return (
        f"wrote {out}: {stats['num_tokens']:,} {stats['dtype']} tokens from "
        f"{stats['files']:,} files{skipped} in {stats['seconds']:.1f} s "
        f"({stats['content_bytes'] / 1e6 / stats['seconds']:.1f} MB/s, {workers}); "
        f"tokenizer {tokenizer.describe()}; {stats['documents']:,} documents"
        f"{'; ' + bad if bad else ''}"
    )


def _prepare_chat(args, options: ReadOptions, path: Path, out: Path, tokenizer) -> str:
    """``data prepare --format chat``: rendered conversations and their labels."""
    from meshwise.data.chat_files import build_chat_file
    from meshwise.data.chat_templates import load_template

    template = load_template(args.chat_template, tokenizer.path)
    try:
        with exclusive_build(out):
            stats = build_chat_file(out, path.resolve(), tokenizer, template, options)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    skipped = "; " + stats["skipped"] if stats["skipped"] else ""
    return (
        f"wrote {out}: {stats['num_tokens']:,} {stats['dtype']} tokens, "
        f"{stats['conversations']:,} conversations ({stats['assistant_tokens']:,} "
        f"assistant tokens) in {stats['seconds']:.1f} s; template {template.name}; "
        f"tokenizer {tokenizer.describe()}{skipped}"
    )


def _texts(files: list[DataFile], options: ReadOptions, stats: dict) -> Iterator[str]:
    """The text of every document: text files in pieces of a few hundred KiB (cut after a
    newline), records whole. ``stats``: ``files``, ``text_bytes`` (UTF-8), ``records``."""
    counts = stats["records"] = RecordCounts()
    for file in files:
        if file.format in ("text", "binary"):
            pieces, found = plan_pieces([file.path], ByteTokenizer())
            stats["files"] += found["files"]
            stats["text_bytes"] += found["content_bytes"]
            for piece in pieces:
                yield read_piece(piece).decode("utf-8", errors="replace")
            continue
        stats["files"] += 1
        for text in file_documents(file, options.text_field, options.skip_bad_records, counts):
            stats["text_bytes"] += len(text.encode())
            yield text


def _train_tokenizer(args) -> str:
    from meshwise.data.bpe import check_vocab_size, save_tokenizer, train_bpe

    check_vocab_size(args.vocab_size)
    options = read_options(args)
    path, files = _input_files(args.input, options)
    out = Path(args.out).expanduser()
    if out.is_dir():
        out = out / "tokenizer.json"
    stats: dict[str, Any] = {"files": 0, "text_bytes": 0}  # and "records", by _texts
    start = time.perf_counter()
    texts = (text for text in _texts(files, options, stats) if text)
    first = next(texts, None)
    if first is None:
        raise ValueError(
            f"INPUT {args.input} holds no text (empty, or only binary files); expected {TEXT_INPUT}"
        )
    tokenizer = train_bpe(
        itertools.chain([first], texts), args.vocab_size, show_progress=sys.stderr.isatty()
    )
    try:
        save_tokenizer(tokenizer, out)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    short = (
        ""
        if size == args.vocab_size
        else (f"; asked {args.vocab_size:,}, but the text has no more pairs seen twice")
    )
    bad = stats["records"].summary()
    return (
        f"wrote {out}: byte-level BPE, vocab {size:,}{short}; from {stats['files']:,} files "
        f"({stats['text_bytes'] / 1e6:.1f} MB) in "
        f"{time.perf_counter() - start:.1f} s{'; ' + bad if bad else ''}"
    )
