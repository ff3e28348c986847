"""An ``argparse`` parser whose unknown flags get "did you mean" (as Python 3.14's
``suggest_on_error`` does; here by ``difflib``, for every Python meshwise runs on)."""

from __future__ import annotations

import argparse
import difflib


class SuggestingParser(argparse.ArgumentParser):
    """``ArgumentParser`` naming the closest flag of the command for an unknown one."""

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._command_parser(parsed)
            command.error(unknown_message(extras, command))
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The (sub)command parser that ``parsed`` went through last."""
        parser: argparse.ArgumentParser = self
        while True:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            chosen = getattr(parsed, subs[0].dest, None) if subs else None
            if chosen not in (subs[0].choices if subs else {}):
                return parser
            parser = subs[0].choices[chosen]


def unknown_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """``unrecognized arguments: ...``, with the closest flags of ``parser`` to each
    unknown one."""
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    suggestions = []
    for word in extras:
        if word.startswith("--"):
            name = word.split("=")[0]
            suggestions += difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
    hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
    return f"unrecognized arguments: {' '.join(extras)}{hint}"
