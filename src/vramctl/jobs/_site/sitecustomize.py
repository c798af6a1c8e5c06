"""vramctl's bootstrap for the Python processes of a job: holds them to the job's share.

The supervisor puts this folder first on a job's ``PYTHONPATH``. Python imports
``sitecustomize`` at start-up; this one imports nothing heavy. It waits for the job to
import ``torch`` and then holds the process to ``$VRAMCTL_RESERVED_BYTES`` of
``$VRAMCTL_DEVICE`` (see ``vramctl.jobs._run.hold_process``). Any other
``sitecustomize`` further on the path runs afterwards, as it would have without this one.
"""

import os
import sys


def _install() -> None:
    import importlib.abc
    import importlib.util

    device = os.environ.get("VRAMCTL_DEVICE", "")
    try:
        reserved = int(os.environ.get("VRAMCTL_RESERVED_BYTES") or 0)
    except ValueError:
        return
    if reserved <= 0 or device in ("", "cpu") or "torch" in sys.modules:
        return

    class _AfterTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec("torch")
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                run(module)
                try:
                    from vramctl.jobs._run import hold_process
                except ImportError:
                    sys.stderr.write(
                        "vramctl: cannot import vramctl in this Python; the job is not held "
                        "to its share\n"
                    )
                    return
                hold_process(device, reserved)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _AfterTorch())


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
_chain()
