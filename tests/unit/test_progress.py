"""Progress on stderr: a bar redrawn in place on a terminal, plain lines otherwise."""

import io

from meshwise.data.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_plain_lines_only_every_few_seconds():
    log = io.StringIO()
    progress = Progress("tokenizing x", stream=log, every_s=0.0)
    progress.update(5_000_000, 10_000_000, "1,234 tokens")
    progress.close()
    line = log.getvalue()
    assert line.startswith("tokenizing x:  50% 5.0/10.0 MB, 1,234 tokens, ") and "\r" not in line
    assert line.endswith(" s\n") and line.count("\n") == 1
    quiet = io.StringIO()
    slow = Progress("tokenizing x", stream=quiet)  # the default: a line every 10 s
    slow.update(1, 2)
    assert quiet.getvalue() == ""


def test_a_terminal_gets_a_bar_redrawn_and_cleared():
    tty = Terminal()
    progress = Progress("tokenizing x", stream=tty)
    progress.last -= 1  # as if the last redraw were a second ago
    progress.update(10, 10)
    progress.close()
    text = tty.getvalue()
    assert text.startswith("\r\033[K[" + "#" * 24 + "] tokenizing x: 100%")
    assert text.endswith("\r\033[K") and "\n" not in text
