"""The doctor's Python packages check, and reading a distribution's version (which the
driver's checks share)."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Mapping

from vramctl.doctor._report import Finding

__all__ = ["check_packages", "dist_version", "major_minor"]


def dist_version(dist: str) -> str | None:
    """An installed distribution's version, without importing it."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def major_minor(text: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


_PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "lightning",
    "pytorch-lightning",
    "nvidia-ml-py",
)


def check_packages(versions: Mapping[str, str | None] | None = None) -> list[Finding]:
    """``python.packages``: the versions of torch, transformers, accelerate, lightning and
    nvidia-ml-py (read from their metadata: nothing is imported), and the old ``pynvml``
    package, whose module would shadow nvidia-ml-py's."""
    found = (
        {d: dist_version(d) for d in (*_PACKAGES, "pynvml")} if versions is None else dict(versions)
    )
    out: list[Finding] = []
    old = found.get("pynvml")
    major = major_minor(old or "")
    if old is not None and major is not None and major[0] < 12:
        out.append(
            Finding(
                "python.packages",
                "warning",
                f"the pynvml package {old} is installed: its own pynvml module may shadow "
                "nvidia-ml-py's, with older NVML calls",
                "pip uninstall pynvml (nvidia-ml-py provides the module)",
                {"pynvml": old, "nvidia-ml-py": found.get("nvidia-ml-py")},
            )
        )
    shown = ", ".join(f"{d} {v}" for d in _PACKAGES if (v := found.get(d)) is not None)
    absent = [d for d in _PACKAGES if found.get(d) is None]
    text = shown + (f"; not installed: {', '.join(absent)}" if absent else "")
    out.append(Finding("python.packages", "ok", text, "", {d: found.get(d) for d in found}))
    return out
