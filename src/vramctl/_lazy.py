"""A package's public names, imported on first use (PEP 562).

>>> import vramctl
>>> "estimate" in dir(vramctl)
True
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["CALLABLE_PACKAGES", "callable_package", "lazy_names"]

#: The packages of ``vramctl`` that are also called as the function of their name.
CALLABLE_PACKAGES = ("doctor", "optimize")


def lazy_names(
    package: str, sources: Mapping[str, str], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: each name of ``sources`` is taken
    from the module it maps to on first use, then kept on the package; ``dir()`` lists the
    ``public`` names with what the package already holds."""
    names = tuple(public)

    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__


def callable_package(package: str) -> None:
    """Make ``package`` callable as its function of the same name.

    ``vramctl.optimize`` is then both the package (``vramctl.optimize.find_blocks``,
    ``import vramctl.optimize as m``) and the function (``vramctl.optimize(model)``),
    whichever is imported first; so for ``vramctl.doctor``.
    """
    module = sys.modules[package]
    function = package.rpartition(".")[2]

    class CallablePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self, function)(*args, **kwargs)

    CallablePackage.__name__ = CallablePackage.__qualname__ = "CallablePackage"
    module.__class__ = CallablePackage
