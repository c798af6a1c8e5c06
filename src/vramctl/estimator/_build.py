"""Building a model on fake tensors: the module from its factory, fresh fake parameters and
buffers for it, a private copy for a wrapper to change, and what the optimizer steps."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes

from vramctl._blocks import find_blocks
from vramctl._errors import VramctlError
from vramctl.estimator._spec import EstimateError

__all__ = [
    "build_module",
    "fake_state",
    "largest_block",
    "private_copy",
    "reparametrized",
    "trainable",
]


def build_module(name: str, obj: Any) -> nn.Module:
    """``obj`` itself if it is a module, else what its factory builds (under the fake mode)."""
    try:
        model = obj if isinstance(obj, nn.Module) else _build(obj)
    except VramctlError:
        raise
    except Exception as exc:
        raise EstimateError(f"model {name} failed to build: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise EstimateError(f"model {name}'s factory returned a {type(model).__name__}")
    return model


def trainable(model: nn.Module) -> list[torch.Tensor]:
    """The parameters that take a gradient, each once (tied ones are one)."""
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def largest_block(model: nn.Module) -> int:
    """Parameters of the model's largest repeated block (what ZeRO-3 gathers at once)."""
    return max((sum(p.numel() for p in b.parameters()) for b in find_blocks(model)), default=0)


def _build(factory: Callable[[], Any]) -> Any:
    """Call ``factory`` under the fake mode; if it converts a parameter (``.to(dtype)``
    in ``__init__``), which a fake parameter refuses (``Module._apply`` swaps a fake
    tensor, and the fake mode holds a weak reference to it), build it on the meta device
    instead: the session gives every parameter and buffer a fresh fake tensor anyway."""
    try:
        return factory()
    except RuntimeError as exc:
        if "Couldn't swap" not in str(exc):
            raise
    with _disable_current_modes(), torch.device("meta"):
        return factory()


def fake_state(
    model: nn.Module, dtype: torch.dtype | None, keep: Collection[int] = ()
) -> dict[str, torch.Tensor]:
    """Fresh fake parameters and buffers for ``model`` (tied ones stay tied), cast to
    ``dtype``; those whose ids are in ``keep`` (an adapter's own) keep their dtype."""
    made: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    named: list[tuple[str, torch.Tensor]] = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        if id(t) not in made:
            cast = dtype is not None and t.is_floating_point() and id(t) not in keep
            dt = dtype if cast else t.dtype
            f = torch.empty_strided(t.size(), t.stride(), dtype=dt, device="cpu")
            if isinstance(t, nn.Parameter):
                f.requires_grad_(t.requires_grad)
            made[id(t)] = f
        state[name] = made[id(t)]
    return state


@contextlib.contextmanager
def reparametrized(model: nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``model`` with ``state``'s tensors (:func:`fake_state`) in place of its own, and its
    own back after.

    Each module's attribute is swapped once. A module reachable by several paths (timm's
    CoaT shares one under every block) appears under each in ``state``; PyTorch's
    ``_reparametrize_module`` would refuse them as tied values, or swap the one attribute
    once per path and put a fake tensor back into the model on leaving. A parameter tied
    between two modules (an embedding and an output head) is two attributes, each swapped."""
    seen: set[tuple[int, str]] = set()
    given: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        owner, _, attr = name.rpartition(".")
        try:
            mod = model.get_submodule(owner) if owner else model
        except AttributeError:
            given[name] = t
            continue
        if (id(mod), attr) not in seen:
            seen.add((id(mod), attr))
            given[name] = t
    with _reparametrize_module(model, given, tie_weights=False, strict=False):
        yield


def private_copy(
    model: nn.Module, state: dict[str, torch.Tensor], drop: Iterable[object] = ()
) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are ``state``'s fake tensors (tied
    ones stay tied), for a wrapper that changes the model it wraps (FSDP2 swaps in its
    shards, DDP's stand-in adds hooks): the model given is left as it was, and no weight is
    copied. The objects in ``drop`` are None in the copy (states the caller replaces)."""
    memo: dict[int, Any] = {id(obj): None for obj in drop}
    named: list[tuple[str, torch.Tensor]] = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        if id(t) not in memo and name in state:
            fake = state[name]
            memo[id(t)] = (
                nn.Parameter(fake, requires_grad=t.requires_grad)
                if isinstance(t, nn.Parameter)
                else fake
            )
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise EstimateError(
            f"could not copy {type(model).__name__} to wrap it: {type(exc).__name__}: {exc}"
        ) from exc
