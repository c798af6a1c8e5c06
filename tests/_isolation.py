"""A pytest plugin that fails any test which leaves a stand-in or a changed global behind.

After each test's teardown (whether or not a teardown failed part way, as a
``monkeypatch.undo()`` that raises stops undoing at the first error), it compares
what the tests stand in for with what was there when the session started:

- ``pynvml``'s functions (``tests/fake_nvml.py`` replaces them with fake GPUs);
- ``torch.cuda``'s functions (tests make CUDA look unavailable, or fake its readings);
- PyTorch's process-wide settings: TF32 and reduced-precision matmuls, cuDNN's flags,
  the float32 matmul precision, the intra-op threads, the default dtype, grad mode and
  deterministic algorithms;
- the dispatch and ``__torch_function__`` mode stacks (a simulated device or a
  ``FakeTensorMode`` whose ``with`` block was never left).

What it finds left over it puts back, so that the tests after it run on the real
thing, and it reports the test as an error naming each leftover.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pynvml
import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.overrides import _pop_mode as _pop_function_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._python_dispatch import _pop_mode as _pop_dispatch_mode

__all__ = ["leftovers", "restore", "snapshot"]

_MATMUL = (
    "allow_tf32",
    "allow_fp16_reduced_precision_reduction",
    "allow_bf16_reduced_precision_reduction",
)
_CUDNN = ("benchmark", "allow_tf32", "enabled", "deterministic")


def _functions(module: Any) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("__") and callable(value) and not isinstance(value, type)
    }


def _settings() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """Each global setting: how to read it and how to put a value back."""
    matmul = torch.backends.cuda.matmul
    cudnn = torch.backends.cudnn
    out: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
    for name in _MATMUL:
        out[f"torch.backends.cuda.matmul.{name}"] = (
            lambda n=name: getattr(matmul, n),
            lambda v, n=name: setattr(matmul, n, v),
        )
    for name in _CUDNN:
        out[f"torch.backends.cudnn.{name}"] = (
            lambda n=name: getattr(cudnn, n),
            lambda v, n=name: setattr(cudnn, n, v),
        )
    out["torch.get_float32_matmul_precision()"] = (
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    )
    out["torch.get_num_threads()"] = (torch.get_num_threads, torch.set_num_threads)
    out["torch.get_default_dtype()"] = (torch.get_default_dtype, torch.set_default_dtype)
    out["torch.is_grad_enabled()"] = (torch.is_grad_enabled, torch.set_grad_enabled)
    out["torch.are_deterministic_algorithms_enabled()"] = (
        torch.are_deterministic_algorithms_enabled,
        torch.use_deterministic_algorithms,
    )
    return out


class Snapshot:
    """What the real thing looked like: functions by identity, settings by value."""

    def __init__(self) -> None:
        self.modules: dict[str, tuple[Any, dict[str, Any]]] = {
            "pynvml": (pynvml, _functions(pynvml)),
            "torch.cuda": (torch.cuda, _functions(torch.cuda)),
        }
        self.settings = {name: get() for name, (get, _) in _settings().items()}


def snapshot() -> Snapshot:
    return Snapshot()


def leftovers(snap: Snapshot) -> list[str]:
    """What differs from ``snap``, one line each (empty when all is as it was)."""
    found: list[str] = []
    for label, (module, functions) in snap.modules.items():
        now = vars(module)
        for name, original in functions.items():
            if now.get(name) is not original:
                found.append(f"{label}.{name} is replaced")
    for name, (get, _) in _settings().items():
        if name in snap.settings and get() != snap.settings[name]:
            found.append(f"{name} is {get()!r}, was {snap.settings[name]!r}")
    if _get_current_dispatch_mode_stack():
        modes = ", ".join(type(m).__name__ for m in _get_current_dispatch_mode_stack())
        found.append(f"dispatch modes still active: {modes}")
    if _get_current_function_mode_stack():
        modes = ", ".join(type(m).__name__ for m in _get_current_function_mode_stack())
        found.append(f"__torch_function__ modes still active: {modes}")
    return found


def restore(snap: Snapshot) -> None:
    """Put back what ``snap`` saw (the mode stacks are emptied)."""
    for module, functions in snap.modules.values():
        for name, original in functions.items():
            if vars(module).get(name) is not original:
                setattr(module, name, original)
    for name, (get, put) in _settings().items():
        if name in snap.settings and get() != snap.settings[name]:
            put(snap.settings[name])
    while _get_current_dispatch_mode_stack():
        _pop_dispatch_mode()
    while _get_current_function_mode_stack():
        _pop_function_mode()


_SESSION: list[Snapshot] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _SESSION.append(snapshot())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    # What follows the ``yield`` runs after every fixture's teardown, those that raised
    # included.
    try:
        result = yield
    except BaseException as exc:
        found = _put_back()
        if found and hasattr(exc, "add_note"):
            exc.add_note("left behind (now put back): " + "; ".join(found))
        raise
    found = _put_back()
    if found:
        pytest.fail(
            f"{item.nodeid} left behind what it replaced (now put back):\n  " + "\n  ".join(found),
            pytrace=False,
        )
    return result


def _put_back() -> list[str]:
    if not _SESSION:
        return []
    found = leftovers(_SESSION[-1])
    if found:
        restore(_SESSION[-1])
    return found
