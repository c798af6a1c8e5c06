"""``torch.compile`` with a way back: a model whose compilation fails runs eagerly.

``torch.compile`` compiles at the first call, so that is where a compile error appears.
:class:`CompiledForward` takes the model's ``forward`` (the module itself, its parameters,
state dict and identity are unchanged), calls the compiled one, and where that raises but
the eager forward runs, keeps to the eager forward from then on and says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["CompiledForward", "compile_forward", "short_error", "short_error_of"]


def short_error(exc: BaseException, limit: int = 240) -> str:
    """``Type: message`` on one line, at most ``limit`` characters; a wrapped error (a
    compile error's backend exception) is named after its wrapper.

    >>> short_error(ValueError("bad\\nvalue"))
    'ValueError: bad value'
    """
    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, BaseException) and inner is not exc:
        return short_error_of(f"{type(exc).__name__}: {type(inner).__name__}", inner, limit)
    return short_error_of(type(exc).__name__, exc, limit)


def short_error_of(name: str, exc: BaseException, limit: int) -> str:
    words = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    text = f"{name}: {words}" if words else name
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CompiledForward:
    """A module's forward, compiled; the eager forward where compiling it fails."""

    def __init__(
        self,
        module: nn.Module,
        options: Mapping[str, Any],
        on_fallback: Callable[[BaseException], None],
        memory_budget: float | None = None,
    ) -> None:
        self.module = module
        #: The instance's own ``forward`` before this one, if it had one.
        self.previous = module.__dict__.get("forward")
        self.eager: Callable[..., Any] = (
            self.previous
            if self.previous is not None
            else type(module).forward.__get__(module, type(module))
        )
        self.compiled: Callable[..., Any] = torch.compile(self.eager, **dict(options))
        self.on_fallback = on_fallback
        #: ``torch._functorch.config.activation_memory_budget`` while compiling and running.
        self.memory_budget = memory_budget
        #: The error that made it fall back to the eager forward, or None.
        self.error: BaseException | None = None

    def _budget(self) -> contextlib.AbstractContextManager[Any]:
        if self.memory_budget is None:
            return contextlib.nullcontext()
        from torch._functorch import config

        return config.patch(activation_memory_budget=self.memory_budget)  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.error is not None:
            return self.eager(*args, **kwargs)
        try:
            with self._budget():
                return self.compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            # The eager forward decides: where it raises too, the fault is the model's or
            # the input's (its error propagates and compilation stays); where it runs, the
            # compiled one is dropped.
            out = self.eager(*args, **kwargs)
            self.error = exc
            self.on_fallback(exc)
            return out


def compile_forward(
    module: nn.Module,
    options: Mapping[str, Any],
    on_fallback: Callable[[BaseException], None],
    memory_budget: float | None = None,
) -> CompiledForward:
    """Compile ``module``'s forward in place (see :class:`CompiledForward`)."""
    wrapper = CompiledForward(module, options, on_fallback, memory_budget)
    module.forward = wrapper
    return wrapper
