"""The README and docs/ as pasted: every command parses, every link resolves.

Commands are read from the shell blocks (```bash, ```sh, ```console) of README.md
and docs/*.md, and from ``$ `` lines of any other block. A ``meshwise ...``
command (also under ``torchrun -m meshwise`` or ``python -m meshwise``) must
parse with the real parser, and a ``meshwise train`` one must pass the same
validation as before any rank starts, unless its line says it ``exits 2``. A
``python benchmarks/X.py`` or ``examples/X.py`` line must name a script that
exists and whose argument parser declares the flags given. Nothing is run.
"""

import ast
import functools
import re
import shlex
from pathlib import Path

import pytest

from meshwise.cli.main import build_parser
from meshwise.cli.train_flags import config_from_args

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL = {"bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", "|", ";"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def shell_lines(text: str):
    """(raw logical line, tokens) of every command in the page's shell code."""
    for kind, body in FENCE.findall(text):
        lines = body.splitlines()
        if kind not in SHELL:
            lines = [line[2:] for line in lines if line.startswith("$ ")]
        yield from _logical_lines(line.removeprefix("$ ") for line in lines)


def _logical_lines(lines):
    """Join continuations and open quotes; skip here-documents' bodies."""
    pending, heredoc = "", None
    for line in lines:
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        pending += line + "\n"
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1] + " "
            continue
        try:
            tokens = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: a multi-line python -c '...'
            continue
        marker = re.search(r"<<-?\s*'?(\w+)'?", pending)
        if marker:
            heredoc = marker.group(1)
        yield pending, tokens
        pending = ""
    assert not pending.strip(), f"unterminated command: {pending!r}"


def simple_commands(tokens: list[str]):
    """Each command of a line split at ``&&``, ``|``, ..., without leading VAR=value."""
    command = []
    for token in [*tokens, ";"]:
        if token in SEPARATORS:
            while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", command[0]):
                command.pop(0)
            if command:
                yield command
            command = []
        elif not token.startswith("<<"):  # a here-document's marker
            command.append(token)


def meshwise_argv(command: list[str]) -> list[str] | None:
    if command[0] == "meshwise":
        return command[1:]
    for launcher in ("torchrun", "python"):
        if command[0] == launcher and "-m" in command:
            at = command.index("-m")
            if command[at + 1 : at + 2] == ["meshwise"]:
                return command[at + 2 :]
    return None


def commands():
    found = []
    for page in PAGES:
        for raw, tokens in shell_lines(page.read_text()):
            for command in simple_commands(tokens):
                found.append((page.relative_to(ROOT).as_posix(), raw.strip(), command))
    return found


COMMANDS = commands()
PARSER = build_parser()


def test_the_pages_hold_commands():
    argvs = [meshwise_argv(command) for _, _, command in COMMANDS]
    assert sum(argv is not None for argv in argvs) > 100
    assert {argv[0] for argv in argvs if argv} >= {
        "train",
        "plan",
        "schedule",
        "data",
        "export",
        "generate",
        "bench",
        "plot",
    }


def meshwise_problem(argv: list[str], raw: str, capsys) -> str | None:
    """Why ``meshwise ARGV`` would not start, or None: the parser's error, or for ``train``
    the validation's (unless the line says it exits 2)."""
    try:
        args = PARSER.parse_args(argv)
    except SystemExit:
        return capsys.readouterr().err.strip().splitlines()[-1]
    if args.command == "train" and "exits 2" not in raw:
        try:
            config_from_args(args)[0].validate()
        except ValueError as exc:
            return str(exc)
    return None


def test_every_meshwise_command_parses_and_every_train_command_validates(capsys):
    bad = []
    for page, raw, command in COMMANDS:
        argv = meshwise_argv(command)
        problem = argv is not None and meshwise_problem(argv, raw, capsys)
        if problem:
            bad.append(f"{page}: {raw}\n    {problem}")
    assert not bad, "\n".join(bad)


@functools.cache
def _declared(script: Path) -> set[str]:
    """String constants of a benchmark and the benchmarks modules it imports: its flags,
    choices and sub-commands."""
    seen, todo, strings = set(), [script], set()
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.update(node.value.split())
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                todo.append(ROOT / (node.module.replace(".", "/") + ".py"))
    return strings


def test_every_script_a_page_runs_exists_and_takes_its_flags(capsys):
    bad = []
    for page, raw, command in COMMANDS:
        if command[0] != "python" or len(command) < 2:
            continue
        if command[1] == "-m" and command[2:3] == ["pytest"]:
            args = command[3:]
            # a path: a word that is neither an option nor an option's value (-n 2)
            paths = [
                a
                for a, before in zip(args, ["", *args])
                if not a.startswith("-") and not before.startswith("-")
            ]
            bad += [
                f"{page}: {raw}: no {p}" for p in paths if not (ROOT / p.split("::")[0]).exists()
            ]
            continue
        script = command[1]
        if not script.startswith(("benchmarks/", "examples/")):
            continue
        if not (ROOT / script).exists():
            bad.append(f"{page}: {raw}: no {script}")
            continue
        declared = _declared(ROOT / script)
        own = command[2:]
        if "--" in own:  # two_nodes.py -- a meshwise command to run across the link
            own, wrapped = own[: own.index("--")], own[own.index("--") + 1 :]
            problem = meshwise_problem(wrapped, raw, capsys)
            if problem:
                bad.append(f"{page}: {raw}: meshwise {' '.join(wrapped)}: {problem}")
        words = [w.split("=")[0] for w in own if w.startswith("-") or w.isalpha()]
        bad += [f"{page}: {raw}: {script} declares no {w}" for w in words if w not in declared]
    assert not bad, "\n".join(bad)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found, counts = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE):
        base = slug(heading)
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_every_relative_link_resolves_to_a_file_and_anchor():
    bad = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not resolved.exists():
                bad.append(f"{where}: no such file")
            elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
                bad.append(f"{where}: no heading #{anchor}")
    assert not bad, "\n".join(bad)


def test_the_readme_links_every_page_of_docs():
    readme = FENCE.sub("", (ROOT / "README.md").read_text())
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(readme) if t.startswith("docs/")}
    pages = {page.name for page in PAGES[1:]}
    assert pages - linked == set(), f"README.md does not link {sorted(pages - linked)}"


def _train_options() -> set[str]:
    train = PARSER._subparsers._group_actions[0].choices["train"]
    return {
        option
        for action in train._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    }


def test_the_flag_reference_lists_exactly_the_parsers_flags():
    text = (ROOT / "docs" / "flags.md").read_text()
    rows = [
        re.split(r"(?<!\\)\|", line)[1]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| flag")
    ]
    listed = {flag for cell in rows for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", cell)}
    assert listed == _train_options(), (
        f"not listed: {sorted(_train_options() - listed)}; "
        f"not flags of meshwise train: {sorted(listed - _train_options())}"
    )


@pytest.mark.parametrize(
    "line, words",
    [
        (
            "MALLOC_X=1 meshwise train --dp 2 \\\n    --zero 3   # ZeRO-3\n",
            [["meshwise", "train", "--dp", "2", "--zero", "3"]],
        ),
        (
            "python - <<'EOF'\nprint('meshwise train --dp x')\nEOF\nmeshwise plan --world 2\n",
            [["python", "-"], ["meshwise", "plan", "--world", "2"]],
        ),
        (
            "pip install x && torchrun --nnodes 2 -m meshwise train --tp 2\n",
            [
                ["pip", "install", "x"],
                ["torchrun", "--nnodes", "2", "-m", "meshwise", "train", "--tp", "2"],
            ],
        ),
    ],
)
def test_lines_are_read_as_a_shell_reads_them(line, words):
    found = [c for _, tokens in _logical_lines(line.splitlines()) for c in simple_commands(tokens)]
    assert found == words
