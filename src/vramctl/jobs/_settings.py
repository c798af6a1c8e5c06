"""The queue's settings: built-in defaults, then a TOML file, then ``VRAMCTL_*`` variables.

The file is ``$VRAMCTL_HOME/settings.toml`` (``$VRAMCTL_SETTINGS`` names another); its
``[jobs]`` table holds any of::

    [jobs]
    store = "/data/vramctl/jobs.db"   # the job store
    margin = 0.1                      # safety margin, a share of each job's need
    max_concurrent_jobs = 4           # jobs per device at most
    policy = "best-fit"               # best-fit, most-free, least-loaded, fragmentation
    wait_timeout = "30m"              # for jobs whose spec sets none
    run_timeout = "12h"

and each has a variable, which wins over the file: ``VRAMCTL_JOBS_STORE``,
``VRAMCTL_SAFETY_MARGIN``, ``VRAMCTL_MAX_CONCURRENT_JOBS``, ``VRAMCTL_PLACEMENT_POLICY``,
``VRAMCTL_WAIT_TIMEOUT``, ``VRAMCTL_RUN_TIMEOUT``. A command's own options win over both.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vramctl.jobs._spec import JobSpec, JobSpecError, parse_duration
from vramctl.jobs._store import vramctl_home

__all__ = ["ENV_SETTINGS", "POLICIES", "Settings", "load_settings"]

ENV_SETTINGS = "VRAMCTL_SETTINGS"
#: How a job's device is chosen among those with room (the placement module's policies):
#: ``best-fit`` (the least room left after it, which keeps large holes for large jobs),
#: ``most-free``, ``least-loaded`` (fewest jobs) and ``fragmentation`` (FGD's: where the
#: expected fragmentation for the mix of jobs seen grows least). Defined with the settings,
#: which check a configured policy without importing the scheduler (and PyTorch).
POLICIES = ("best-fit", "most-free", "least-loaded", "fragmentation")
_ENV = {
    "store": "VRAMCTL_JOBS_STORE",
    "margin": "VRAMCTL_SAFETY_MARGIN",
    "max_concurrent_jobs": "VRAMCTL_MAX_CONCURRENT_JOBS",
    "policy": "VRAMCTL_PLACEMENT_POLICY",
    "wait_timeout": "VRAMCTL_WAIT_TIMEOUT",
    "run_timeout": "VRAMCTL_RUN_TIMEOUT",
}


@dataclass(frozen=True)
class Settings:
    """The queue's settings (see the module for where each comes from)."""

    store: Path | None = None
    margin: float = 0.1
    max_concurrent_jobs: int | None = None
    policy: str = "best-fit"
    wait_timeout: float | None = None
    run_timeout: float | None = None

    def apply(self, spec: JobSpec) -> JobSpec:
        """``spec`` with the default timeouts where it sets none."""
        changes: dict[str, Any] = {}
        if spec.wait_timeout is None and self.wait_timeout is not None:
            changes["wait_timeout"] = self.wait_timeout
        if spec.run_timeout is None and self.run_timeout is not None:
            changes["run_timeout"] = self.run_timeout
        return replace(spec, **changes) if changes else spec


def _check(values: Mapping[str, Any], where: Mapping[str, str]) -> Settings:
    problems: list[str] = []
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = where[key]
        if key == "store":
            out[key] = Path(str(value)).expanduser()
        elif key == "margin":
            try:
                margin = float(value)
            except (TypeError, ValueError):
                margin = -1.0
            if not 0 <= margin <= 10:
                problems.append(f"{name}: a share of the need from 0 to 10, got {value!r}")
            out[key] = margin
        elif key == "max_concurrent_jobs":
            try:
                n = int(value)
            except (TypeError, ValueError):
                n = 0
            if n < 1 or isinstance(value, bool | float):
                problems.append(f"{name}: a whole number of at least 1, got {value!r}")
            out[key] = n
        elif key == "policy":
            if value not in POLICIES:
                problems.append(f"{name}: one of {', '.join(POLICIES)}, got {value!r}")
            out[key] = value
        else:  # the timeouts
            try:
                out[key] = parse_duration(value)
            except JobSpecError as exc:
                problems.append(f"{name}: {exc.problems[0].split(': ', 1)[-1]}")
    if problems:
        raise JobSpecError(problems, what="invalid job queue settings")
    return Settings(**out)


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """The settings: the file (``path``, else ``$VRAMCTL_SETTINGS``, else
    ``$VRAMCTL_HOME/settings.toml`` where it exists), then the variables over it."""
    explicit = path is not None or bool(os.environ.get(ENV_SETTINGS))
    file = Path(path or os.environ.get(ENV_SETTINGS) or vramctl_home() / "settings.toml")
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    if file.is_file():
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        try:
            doc = tomllib.loads(file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise JobSpecError(f"{file}: {exc}", what="invalid job queue settings") from None
        table = doc.get("jobs", {})
        if not isinstance(table, dict):
            raise JobSpecError(f"{file}: [jobs] must be a table", what="invalid job queue settings")
        unknown = sorted(set(table) - set(_ENV))
        if unknown:
            raise JobSpecError(
                [f"{file}: unknown setting jobs.{k}; settings: {', '.join(_ENV)}" for k in unknown],
                what="invalid job queue settings",
            )
        values.update(table)
        where.update({k: f"{file}: jobs.{k}" for k in table})
    elif explicit:
        raise JobSpecError(f"no settings file {file}", what="invalid job queue settings")
    for key, var in _ENV.items():
        if os.environ.get(var):
            values[key] = os.environ[var]
            where[key] = f"${var}"
    return _check(values, where)
