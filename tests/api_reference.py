"""docs/api.md: every public name of vramctl, by package, with its one-line summary.

The page is made from the code (each package's ``__all__`` and each name's docstring), and
``tests/test_exported_members.py`` fails when it is out of date. Write it again with::

    python tests/api_reference.py
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"

#: Each package with a public surface, and the guide that says how to use it.
PACKAGES = {
    "vramctl": "../README.md",
    "vramctl.device": "devices.md",
    "vramctl.estimator": "estimate.md",
    "vramctl.fit": "fit.md",
    "vramctl.guard": "guard.md",
    "vramctl.batching": "batching.md",
    "vramctl.cache": "cache.md",
    "vramctl.optimize": "optimize.md",
    "vramctl.doctor": "doctor.md",
    "vramctl.monitor": "monitor.md",
    "vramctl.integrations": "integrations.md",
    "vramctl.jobs": "jobs.md",
    "vramctl.server": "serve.md",
    "vramctl.cli": "../README.md",
}


def package(name: str) -> ModuleType:
    """The package ``name`` (``vramctl.optimize`` and ``vramctl.doctor`` are also callable)."""
    importlib.import_module(name)
    return sys.modules[name]


def _kind(value: Any) -> str:
    if inspect.isclass(value):
        return "exception" if issubclass(value, BaseException) else "class"
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return "function"
    if isinstance(value, ModuleType):
        # A package called as its function (vramctl.optimize(model)), or a module.
        return "function" if callable(value) else "module"
    return "constant"


def summary(value: Any) -> str:
    """The first sentence of ``value``'s docstring; for a constant, its value."""
    if isinstance(value, ModuleType) and callable(value):  # vramctl.doctor: the function's
        value = getattr(value, value.__name__.rpartition(".")[2])
    kind = _kind(value)
    if kind == "constant":
        doc = type(value).__doc__ if type(value).__module__.startswith("vramctl") else None
        text = repr(value) if doc is None else doc
        if doc is None:
            return f"`{text if len(text) <= 70 else text[:67] + '...'}`"
    elif isinstance(value, ModuleType):
        text = value.__doc__ or ""
    elif inspect.isclass(value):
        text = value.__dict__.get("__doc__") or ""  # its own, not inherited (str, Enum)
    else:
        text = inspect.getdoc(value) or ""
    first = " ".join(text.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.:!?])(\s|$)", first)
    sentence = match.group(1) if match else first
    return sentence.rstrip(":").replace("|", "\\|") + ("." if sentence.endswith(":") else "")


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Every public name of vramctl, by package: what each package's `__all__` holds, with",
        "the first sentence of its docstring (`help(name)` gives the rest). The guide linked",
        "under each package says how to use them. This page is made from the code by",
        "`python tests/api_reference.py`, and a test fails when it is out of date.",
        "",
        "Names with a leading underscore, and the private modules (`_name.py`), are not the",
        "public surface and may change in any release.",
        "",
    ]
    for name, guide in PACKAGES.items():
        module = package(name)
        lines += [f"## `{name}`", "", f"Guide: [{Path(guide).name}]({guide}).", ""]
        lines += ["| name | kind | what it is |", "| --- | --- | --- |"]
        for public in sorted(module.__all__, key=str.casefold):
            value = getattr(module, public)
            lines.append(f"| `{public}` | {_kind(value)} | {summary(value)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
