"""The ``vramctl`` command line (needs the ``cli`` extra: ``pip install 'vramctl[cli]'``)."""

from __future__ import annotations

import sys
from importlib.util import find_spec

__all__ = ["main"]


def main() -> None:
    """Entry point of the ``vramctl`` command."""
    missing = [m for m in ("typer", "rich") if find_spec(m) is None]
    if missing:
        sys.stderr.write(
            f"error: the vramctl command needs {' and '.join(missing)}: "
            "pip install 'vramctl[cli]'\n"
        )
        raise SystemExit(2)
    from vramctl.cli._app import app

    app()
