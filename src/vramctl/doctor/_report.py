"""The doctor's findings and its report: a :class:`Finding` per thing seen, the
:class:`DoctorReport` of one run, and its views (text, JSON, Markdown)."""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from vramctl._na import NA

__all__ = ["LEVELS", "DoctorReport", "Finding", "Level"]

Level = Literal["ok", "info", "warning", "error"]
#: The levels, from the best to the worst.
LEVELS: tuple[Level, ...] = ("ok", "info", "warning", "error")


@dataclass(frozen=True)
class Finding:
    """One thing doctor found: which check, how bad, what it saw, and what to change.

    ``level`` is "ok", "info" (worth knowing), "warning" (likely to cost memory, speed
    or a crash) or "error" (work on the GPU fails or is wrong until it is fixed).
    ``action`` is empty for "ok".
    """

    check: str
    level: Level
    message: str
    action: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level {self.level!r}: use one of {', '.join(LEVELS)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "level": self.level,
            "message": self.message,
            "action": self.action,
            "details": _plain(self.details),
        }


def _plain(value: Any) -> Any:
    """``value`` as JSON: ``NA`` is null, tuples are lists, other objects their text."""
    if value is NA or value is None:
        return None
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    return str(value)


@dataclass(frozen=True)
class DoctorReport:
    """Every finding of one :func:`doctor` run, with the versions it ran under."""

    findings: tuple[Finding, ...]
    #: When it ran (seconds since the epoch).
    created: float = field(default_factory=time.time)
    #: vramctl, torch, Python and the platform.
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def worst(self) -> Level:
        """The worst level among the findings ("ok" when there are none)."""
        return max((f.level for f in self.findings), key=LEVELS.index, default="ok")

    def counts(self) -> dict[str, int]:
        """How many findings of each level."""
        return {level: sum(f.level == level for f in self.findings) for level in LEVELS}

    def by_level(self) -> list[tuple[Level, list[Finding]]]:
        """The findings grouped by level, the worst first (levels with none left out)."""
        out: list[tuple[Level, list[Finding]]] = []
        for level in reversed(LEVELS):
            found = [f for f in self.findings if f.level == level]
            if found:
                out.append((level, found))
        return out

    def summary(self) -> str:
        """``"1 error, 2 warnings, 3 info, 10 ok"``."""
        c = self.counts()
        return (
            f"{c['error']} error{'s' * (c['error'] != 1)}, "
            f"{c['warning']} warning{'s' * (c['warning'] != 1)}, "
            f"{c['info']} info, {c['ok']} ok"
        )

    def to_dict(self) -> dict[str, Any]:
        """One JSON object: the worst level, the counts, the versions and every finding."""
        return {
            "schema": "vramctl.doctor/1",
            "created": _iso(self.created),
            "worst": self.worst,
            "counts": self.counts(),
            "versions": dict(self.versions),
            "findings": [f.to_dict() for f in self.findings],
        }

    def __str__(self) -> str:
        lines = [f"vramctl doctor: {self.summary()}"]
        for level, found in self.by_level():
            for f in found:
                lines.append(f"{level:<8} {f.check:<18} {f.message}")
                if f.action:
                    lines.append(f"{'':<27} -> {f.action}")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """The report for a person: the summary, then each level's findings and actions."""
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        out = [
            "# vramctl doctor report",
            "",
            f"Created {_iso(self.created)}; {versions}.",
            "",
            f"**{self.summary()}** (worst: {self.worst})",
        ]
        titles = {"error": "Errors", "warning": "Warnings", "info": "Info", "ok": "OK"}
        for level, found in self.by_level():
            out += ["", f"## {titles[level]}", ""]
            for f in found:
                out.append(f"- **`{f.check}`**: {f.message}")
                if f.action:
                    out.append(f"  - Action: {f.action}")
                for key, value in f.details.items():
                    shown = _plain(value)
                    text = shown if isinstance(shown, str) else json.dumps(shown)
                    out.append(f"  - {key}: `{text}`")
        return "\n".join(out) + "\n"


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")
