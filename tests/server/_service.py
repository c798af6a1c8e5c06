"""A job service for a test module: on a free port, with its store and ``$VRAMCTL_HOME`` in
a folder of its own (the variables it sets are put back after, whatever happens)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vramctl.server import JobServer, serve_jobs


@contextlib.contextmanager
def job_service(home: Path, env: dict[str, str] | None = None, **kw: Any) -> Iterator[JobServer]:
    """``serve_jobs(port=0, store=home / "jobs.db", devices=["sim:8GiB"], **kw)`` with
    ``$VRAMCTL_HOME`` set to ``home`` (no ``$VRAMCTL_TOKEN``) and ``env`` set meanwhile."""
    changes = {"VRAMCTL_HOME": str(home), "VRAMCTL_TOKEN": None, **(env or {})}
    saved = {k: os.environ.get(k) for k in changes}
    try:
        for key, value in changes.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        kw.setdefault("devices", ["sim:8GiB"])
        with serve_jobs(port=0, store=home / "jobs.db", **kw) as srv:
            yield srv
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
