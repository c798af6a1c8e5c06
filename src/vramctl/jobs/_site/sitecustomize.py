"""vramctl's bootstrap for the Python processes of a job: holds them to the job's share.

The supervisor puts this folder first on a job's ``PYTHONPATH``. Python imports
``sitecustomize`` at start-up; this one imports nothing heavy. It waits for the job to
import ``torch`` and then holds the process to ``$VRAMCTL_RESERVED_BYTES`` of
``$VRAMCTL_DEVICE`` (see ``vramctl.jobs._run.hold_process``). With ``$VRAMCTL_GUARD``
set it also runs the spec's guarded function under ``vramctl.guarded`` once its module is
imported (see ``vramctl.jobs._run.guard_module``). Any other
``sitecustomize`` further on the path runs afterwards, as it would have without this one.
"""

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType


def _after_import(name: str, then: "Callable[[ModuleType], None]") -> None:
    """Call ``then(module)`` once the module ``name`` has been imported (its code run)."""
    import importlib.abc
    import importlib.util

    class _After(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                run(module)
                then(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _After())


def _no_vramctl(what: str) -> None:
    sys.stderr.write(f"vramctl: cannot import vramctl in this Python; {what}\n")


def _install() -> None:
    device = os.environ.get("VRAMCTL_DEVICE", "")
    try:
        reserved = int(os.environ.get("VRAMCTL_RESERVED_BYTES") or 0)
    except ValueError:
        return
    if reserved <= 0 or device in ("", "cpu") or "torch" in sys.modules:
        return

    def hold(module):  # type: ignore[no-untyped-def]
        try:
            from vramctl.jobs._run import hold_process
        except ImportError:
            _no_vramctl("the job is not held to its share")
            return
        hold_process(device, reserved)

    _after_import("torch", hold)


def _install_guard() -> None:
    """Guard the spec's function when its module is imported; say so if it never is."""
    import json

    try:
        options = json.loads(os.environ.get("VRAMCTL_GUARD") or "null")
        module_name = options["function"].partition(":")[0]
    except (ValueError, TypeError, KeyError, AttributeError):
        return
    done = []
    # The job's first Python process says when the guard never applied; its children
    # (data loader workers, tools it runs) guard too but leave that to it.
    first = os.environ.get("VRAMCTL_GUARD_WARNED") is None
    os.environ["VRAMCTL_GUARD_WARNED"] = "1"

    def guard(module):  # type: ignore[no-untyped-def]
        try:
            from vramctl.jobs._run import guard_module
        except ImportError:
            _no_vramctl(f"{options['function']} is not guarded")
            return
        guard_module(module, options)
        done.append(True)

    def never():  # type: ignore[no-untyped-def]
        if first and not done:
            sys.stderr.write(
                f"vramctl: the guard of {options['function']} was never applied: the job "
                f"did not import {module_name} (a script run as python {module_name}.py is "
                f"__main__; put the function in a module it imports)\n"
            )

    import atexit

    atexit.register(never)
    _after_import(module_name, guard)


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path, which this one hides."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_install()
_install_guard()
_chain()
