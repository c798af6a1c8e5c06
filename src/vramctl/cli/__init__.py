"""The ``vramctl`` command line (needs the ``cli`` extra: ``pip install 'vramctl[cli]'``)."""

from __future__ import annotations

import copy
import os
import signal
import sys
import types
import typing

__all__ = ["main"]


def main() -> None:
    """Entry point of the ``vramctl`` command."""
    from vramctl._optional import EXTRAS, MissingDependencyError, require

    try:
        require(EXTRAS["cli"], extra="cli", what="the vramctl command")
    except MissingDependencyError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    from vramctl.cli._app import app

    _terminate_like_ctrl_c()
    # transformers' own warnings (about configs of the built-in models, which vramctl builds
    # with random weights) are not the user's to act on; TRANSFORMERS_VERBOSITY overrides.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _only_the_command(app, sys.argv[1:])()


def _only_the_command(app: typing.Any, args: list[str]) -> typing.Any:
    """``app``, or a copy that holds only the command ``args`` name.

    Typer builds every registered command's parameters before it runs one (a tenth of
    a second for all of them); a command named first on the line needs only its own.
    Anything else (``--help``, ``--version``, a group such as ``ray``, a misspelled
    name that wants the list of commands) gets the whole app.
    """
    if not args or args[0].startswith("-"):
        return app
    named = [c for c in app.registered_commands if _command_name(c) == args[0]]
    if len(named) != 1:
        return app
    only = copy.copy(app)
    only.registered_commands = named
    return only


def _command_name(info: typing.Any) -> str | None:
    if info.name:
        return str(info.name)
    if info.callback is None:
        return None
    return str(info.callback.__name__).lower().replace("_", "-")


def _terminate_like_ctrl_c() -> None:
    """Let SIGTERM (``kill``, a service manager) stop a command as Ctrl-C does.

    The long-running commands (``monitor``, ``dashboard``, ``top``, ``status --watch``,
    ``process``) finish their work on Ctrl-C: write the plot, print the peaks, close
    the servers' streams, keep the progress store consistent. A SIGTERM's default
    action would end the process at once, without any of it.
    """
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # someone (a parent, an embedding program) chose otherwise

    def interrupt(signum: int, frame: types.FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
