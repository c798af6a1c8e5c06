"""Replacing a library's attribute for the duration of a trace, in that trace alone.

A trace changes a few functions of PyTorch and transformers while it runs (``Module.to``,
``UntypedStorage.resize_``, transformers' ``is_tracing``, the checkpoint's recomputation).
Estimates may run at once in several threads (a server, a fit, a test). Swapping the
attribute in and out per trace would then restore it out of order: the later trace puts
back the earlier one's replacement, which stays in the process for good. So the attribute
is replaced once while any trace needs it (counted, under a lock) by a function that calls
the replacement of the trace running in this thread, and the original elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["patched"]

_LOCK = threading.Lock()


class _Patch:
    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name
        self.users = 0
        self.original: Any = None
        self.own = False
        self.active: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
            f"vramctl_patch_{name}", default=None
        )

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            fn = self.active.get()
            return (fn or self.original)(*args, **kwargs)

        self.dispatch = dispatch


_PATCHES: dict[tuple[int, str], _Patch] = {}


@contextlib.contextmanager
def patched(
    owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """``owner.name`` replaced by ``make(original)`` while the block runs, for calls made
    in this thread (and task); calls elsewhere reach the original."""
    with _LOCK:
        p = _PATCHES.setdefault((id(owner), name), _Patch(owner, name))
        if p.users == 0:
            p.own = name in vars(owner)
            p.original = getattr(owner, name)
            setattr(owner, name, p.dispatch)
        p.users += 1
    token = p.active.set(make(p.original))
    try:
        yield
    finally:
        p.active.reset(token)
        with _LOCK:
            p.users -= 1
            if p.users == 0:
                if p.own:
                    setattr(owner, name, p.original)
                else:
                    delattr(owner, name)
                p.original = None
