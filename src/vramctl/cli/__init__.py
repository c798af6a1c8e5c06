"""The ``vramctl`` command line (needs the ``cli`` extra: ``pip install 'vramctl[cli]'``)."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

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
    app()


def _terminate_like_ctrl_c() -> None:
    """Let SIGTERM (``kill``, a service manager) stop a command as Ctrl-C does.

    The long-running commands (``monitor``, ``dashboard``, ``top``, ``status --watch``,
    ``process``) finish their work on Ctrl-C: write the plot, print the peaks, close
    the servers' streams, keep the progress store consistent. A SIGTERM's default
    action would end the process at once, without any of it.
    """
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # someone (a parent, an embedding program) chose otherwise

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
