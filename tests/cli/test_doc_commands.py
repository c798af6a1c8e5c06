"""Every ``vramctl`` command line in the README's and the docs' shell blocks parses as written.

Each line is parsed by the real command-line app (its commands, options, choices and
value types), without running it: a renamed option or a misspelled choice in a doc fails
here. The Python examples are run by ``tests/test_docs.py``.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from vramctl.cli._app import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
#: Where a command line ends: a pipe, a redirect, the next command or a comment.
_END = re.compile(r"\s(\||&&|;|>|2>|&>|#|&)(\s|$)")


def command_lines() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` for each ``vramctl`` command line of a ``bash`` or ``sh`` block."""
    found = []
    for path in PAGES:
        blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", path.read_text(), re.S)
        for block in blocks:
            text = re.sub(r"\\\n\s*", " ", block)  # continued lines
            pending = ""
            for raw in text.splitlines():
                line = (pending + "\n" + raw if pending else raw).strip().removeprefix("$ ")
                try:
                    words = shlex.split(_END.split(line)[0], comments=False)
                except ValueError:  # a quoted argument over several lines
                    pending = line
                    continue
                pending = ""
                while words and _ENV.match(words[0]):
                    words.pop(0)
                if words[:1] == ["vramctl"]:
                    found.append((f"{path.relative_to(ROOT)}: {line[:60]}", words[1:]))
                elif words[:3] == ["python", "-m", "vramctl"]:
                    found.append((f"{path.relative_to(ROOT)}: {line[:60]}", words[3:]))
    return found


def parse(argv: list[str]) -> None:
    """Parse ``argv`` down to its command, as ``vramctl`` would before running it."""
    command: Any = typer.main.get_command(app)
    parent = None
    while True:
        ctx = command.make_context("vramctl", list(argv), parent=parent)
        if not hasattr(command, "resolve_command"):
            return
        # The command name and what follows it (Click keeps the name apart from the args).
        protected = getattr(ctx, "protected_args", None) or getattr(ctx, "_protected_args", [])
        rest = [*protected, *ctx.args]
        if not rest:
            return
        _, command, argv = command.resolve_command(ctx, rest)
        parent = ctx


LINES = command_lines()


def test_the_docs_have_command_lines_to_check() -> None:
    assert len(LINES) > 50, LINES


@pytest.mark.parametrize(("where", "argv"), LINES, ids=[w for w, _ in LINES])
def test_each_command_line_parses(where: str, argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            parse(argv)
        except Exception as exc:
            if type(exc).__name__ == "Exit" and getattr(exc, "exit_code", 0) == 0:
                return  # --help, --version
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            pytest.fail(f"{where}: vramctl {shlex.join(argv)}: {message}")


def test_a_wrong_option_fails_the_check() -> None:
    with pytest.raises(Exception, match="No such option"):
        parse(["estimate", "gpt2", "--no-such-option"])
    with pytest.raises(Exception, match="No such command"):
        parse(["estimat", "gpt2"])
