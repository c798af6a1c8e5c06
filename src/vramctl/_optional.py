"""Optional dependencies, in one place: which extra brings each, and one check for all.

Imports of optional packages happen at the point of use, never at module level
(ruff's ``banned-module-level-imports`` enforces it), so that ``import vramctl``
needs only the core dependencies.

>>> from vramctl._optional import available, require
>>> available("torch")
True
>>> try:
...     require("no_such_module", extra="plot", what="this example")
... except ModuleNotFoundError as exc:
...     print(exc)
this example needs no_such_module: pip install 'vramctl[plot]'
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from importlib.util import find_spec
from types import ModuleType

from vramctl._errors import VramctlError

__all__ = ["EXTRAS", "MissingDependencyError", "available", "missing", "require"]

#: The modules each extra of ``pyproject.toml`` brings (the ones vramctl imports).
EXTRAS: dict[str, tuple[str, ...]] = {
    "cli": ("typer", "rich"),
    "zoo": ("transformers",),
    "audio": ("orjson", "soundfile", "lhotse"),
    "monitor": ("prometheus_client",),
    "plot": ("matplotlib",),
    "server": ("fastapi", "uvicorn", "prometheus_client"),
    "ray": ("ray",),
    "lightning": ("lightning",),
    "transformers": ("transformers", "accelerate"),
    "accelerate": ("accelerate",),
    "cache": ("safetensors", "zstandard", "numpy"),
    "finetune": ("peft",),
}


class MissingDependencyError(VramctlError, ModuleNotFoundError):
    """An optional package that the call needs is not installed; the message says which
    extra to install."""


def available(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(modules: Sequence[str]) -> list[str]:
    """The modules of ``modules`` that are not installed, in order."""
    return [m for m in modules if not available(m)]


def require(
    modules: str | Sequence[str],
    *,
    extra: str,
    what: str,
    hint: str = "",
    error: type[Exception] = MissingDependencyError,
) -> ModuleType:
    """Import and return the first of ``modules``, or raise ``error`` naming the extra.

    ``what`` is what needs them ("the dashboard"); ``hint`` is added after the install
    line (another way to do without). ``error`` lets a caller raise its own error class.
    """
    names = [modules] if isinstance(modules, str) else list(modules)
    absent = missing(names)
    if absent:
        message = f"{what} needs {', '.join(absent)}: pip install 'vramctl[{extra}]'" + (
            f" {hint}" if hint else ""
        )
        if issubclass(error, ModuleNotFoundError):
            raise error(message, name=absent[0])
        raise error(message)
    return importlib.import_module(names[0])
