"""What every command shares: the Typer ``app``, the consoles, one-line errors, input checks."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

import vramctl
from vramctl import VramctlError

__all__ = [
    "app",
    "check_can_write",
    "check_seconds",
    "console",
    "emit_json",
    "err",
    "library_log_to",
    "parse_batches",
    "user_errors",
]

#: Click's UsageError (bad option values, unknown options, missing arguments), from the
#: Click that Typer runs on: its own copy in recent Typers, the ``click`` package before.
_USAGE_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError"
)

#: Pydantic's wording of Typer's range and type checks, and vramctl's.
_REWORDED = [
    (re.compile(r"Input should be greater than or equal to (\S+)"), r"must be at least \1"),
    (re.compile(r"Input should be less than or equal to (\S+)"), r"must be at most \1"),
    (re.compile(r"Input should be greater than (\S+)"), r"must be more than \1"),
    (re.compile(r"Input should be less than (\S+)"), r"must be less than \1"),
    (re.compile(r"Input should be a valid integer.*"), "must be a whole number"),
    (re.compile(r"Input should be a valid number.*"), "must be a number"),
    (re.compile(r"Input should be a valid boolean.*"), "must be true or false"),
]


def _usage_line(exc: Exception, command: str) -> str:
    """A usage error as one line: the command, what was given, what is wrong, where to look.

    ``vramctl estimate: --seq-len 0: must be at least 1 (see 'vramctl estimate --help')``.
    ``command`` is the command's path where the error does not carry it.
    """
    ctx = getattr(exc, "ctx", None)
    param = getattr(exc, "param", None)
    message = str(getattr(exc, "message", "") or "")
    if param is not None and message and type(exc).__name__ == "BadParameter":
        opts = [o for o in getattr(param, "opts", ()) if o.startswith("--")]
        if getattr(param, "param_type_name", "") == "argument" or not opts:
            name = str(param.name or "").upper()
        else:
            name = max(opts, key=len)
        # The value, where the check kept it (Typer's pydantic checks do).
        errors = getattr(exc.__cause__, "errors", None)
        given = errors()[0].get("input") if callable(errors) and errors() else None
        for pattern, words in _REWORDED:
            message = pattern.sub(words, message)
        what = f"{name} {given}" if isinstance(given, str) else name
        text = f"{what}: {message}"
    else:
        text = str(getattr(exc, "format_message", lambda: str(exc))())
        if text[:1].isupper() and not text[1:2].isupper():
            text = text[0].lower() + text[1:]
    text = " ".join(text.split()).rstrip(".")
    path = command if ctx is None else ctx.command_path
    return f"{path}: {text} (see '{path} --help')"


@contextlib.contextmanager
def _usage_errors_on_one_line(command: Callable[[], str]) -> Iterator[None]:
    try:
        yield
    except _USAGE_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            raise  # `vramctl` alone: the help was printed, as asked
        line = escape(_usage_line(exc, command()))
        err.print(f"[bold red]error:[/] {line}", highlight=False, soft_wrap=True)
        raise typer.Exit(getattr(exc, "exit_code", 2)) from None


_COMMAND_KEY = "vramctl.command"


#: The widest line of a help text kept as written: Click indents it by 2, and 80 columns fit it.
_HELP_TEXT_WIDTH = 78


def _keep_examples(text: str) -> str:
    """Mark the indented paragraphs of a help text (examples) to be printed as written.

    Click rewraps every paragraph unless a line holding only ``\\b`` precedes it, which
    would run an example's lines together. A one-line example too wide for 80 columns is
    left to be wrapped.
    """
    paragraphs = text.split("\n\n")
    for i, par in enumerate(paragraphs):
        lines = par.splitlines()
        if (
            lines
            and all(line.startswith(" ") for line in lines)
            and (len(lines) > 1 or len(lines[0]) <= _HELP_TEXT_WIDTH)
        ):
            paragraphs[i] = "\b\n" + par
    return "\n\n".join(paragraphs)


class _Commands(TyperGroup):
    """vramctl's command group: a usage error of any command is one line on stderr, status 2,
    and the help is Click's plain layout, whole at 80 columns.

    (Typer draws usage errors in a box of several lines; vramctl's own bad-input errors
    are one line, see :func:`user_errors`. Typer's boxed help squeezes long option names
    into a narrow column and cuts them, and shows ``<bool>`` beside flags.)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for command in (self, *self.commands.values()):
            if command.help:
                command.help = _keep_examples(command.help)

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        with _usage_errors_on_one_line(lambda: str(info_name or self.name)):
            return super().make_context(info_name, args, parent=parent, **extra)

    def resolve_command(self, ctx: Any, args: Any) -> Any:
        name, cmd, rest = super().resolve_command(ctx, args)
        ctx.meta[_COMMAND_KEY] = name  # for the errors that come without their context
        return name, cmd, rest

    def invoke(self, ctx: Any) -> Any:
        def command() -> str:
            name = ctx.meta.get(_COMMAND_KEY)
            return f"{ctx.command_path} {name}" if name else str(ctx.command_path)

        with _usage_errors_on_one_line(command):
            return super().invoke(ctx)


app = typer.Typer(
    cls=_Commands,
    name="vramctl",
    help=(
        "See, predict, fit and share GPU memory for PyTorch work.\n\n"
        "Every command works without a GPU: the CPU is a device whose memory is the host's."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
console = Console()
err = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Print vramctl's bad-input errors as one line and exit 2, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except VramctlError as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def check_seconds(option: str, value: float, example: str, *, zero: bool = False) -> float:
    """``value`` of ``option`` as a finite number of seconds, positive (or 0 with ``zero``)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        what = "0 or more" if zero else "a positive number of"
        raise VramctlError(f"{option} {value:g}: give {what} seconds, e.g. {option} {example}")
    return value


def check_can_write(
    option: str, path: str | Path, *, folder: bool = False, make_parents: bool = False
) -> None:
    """Refuse, before any work, an output the command could only fail to write at its end.

    ``folder``: ``path`` is a folder, made here if missing. Else it is a file: its folder
    must exist (``make_parents``: the nearest existing one is probed, as the missing ones
    are made when it is written). A probe file is made and removed in that folder.
    """
    shown = str(path)
    target = Path(path).expanduser()
    if folder:
        if target.exists() and not target.is_dir():
            raise VramctlError(f"{option} {shown!r}: a file, not a folder; give a folder's path")
        place = target
    else:
        if target.is_dir():
            raise VramctlError(f"{option} {shown!r}: a folder; give a file name")
        place = target.absolute().parent
        if make_parents:
            while not place.exists() and place != place.parent:
                place = place.parent
        elif not place.is_dir():
            raise VramctlError(f"{option} {shown!r}: the folder {str(place)!r} does not exist")
    try:
        if folder:
            place.mkdir(parents=True, exist_ok=True)
        if not place.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        tempfile.TemporaryFile(dir=place).close()
        if not folder and target.exists() and not os.access(target, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise VramctlError(
            f"{option} {shown!r}: cannot write there: {exc.strerror or exc}; "
            "choose a path in a writable folder"
        ) from None


@contextlib.contextmanager
def library_log_to(handler: logging.Handler, name: str = "vramctl") -> Iterator[None]:
    """While the block runs, the library's log records go to ``handler`` only.

    (A logger that neither propagates nor has a handler would fall back to
    ``logging.lastResort`` and print on stderr: ``logging.NullHandler()`` drops them.)
    """
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vramctl {vramctl.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """See, predict, fit and share GPU memory for PyTorch work."""


def emit_json(doc: dict[str, Any], *, indent: bool) -> None:
    sys.stdout.write(json.dumps(doc, indent=2 if indent else None) + "\n")
    sys.stdout.flush()


def parse_batches(text: str | Sequence[int]) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``; every size must be a positive integer."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        try:
            n = int(str(item).strip())
        except ValueError:
            raise VramctlError(
                f"batch sizes are positive integers like 1,8,32; got {text!r}"
            ) from None
        if n < 1:
            raise VramctlError(f"batch sizes must be at least 1; got {n}")
        out.append(n)
    return out
