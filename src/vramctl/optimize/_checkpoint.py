"""Activation checkpointing of a model's repeated blocks.

:func:`find_blocks` finds the blocks a model repeats (a transformer's layers, a ResNet's
residual blocks); :func:`apply_checkpointing` checkpoints them, fully or selectively, and
returns a function that undoes it exactly, so that a variant can be applied for a while
(to price it with the estimator) and taken off again.

- ``"full"``: transformers' own activation checkpointing where the model has it
  (``activation_checkpointing_enable``, ``gradient_checkpointing_enable`` before
  transformers 5), else each block's forward runs under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: a block keeps only its
  inputs, and its forward runs again in the backward pass;
- ``"selective"``: each block under ``checkpoint`` with a selective policy
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of matrix
  multiplications, convolutions and attention are kept (expensive to recompute), the rest
  (norms, activations, dropout, element-wise arithmetic) is recomputed;
- ``"none"``: nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from vramctl._blocks import find_blocks
from vramctl.optimize._errors import OptimizeError

__all__ = [
    "KINDS",
    "apply_checkpointing",
    "find_blocks",
    "has_transformers_checkpointing",
    "is_checkpointed",
]

KINDS = ("none", "selective", "full")

#: ATen operators whose outputs selective checkpointing keeps: matrix multiplications,
#: convolutions and attention (the expensive ones to recompute).
_SAVED_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "convolution",
    "_convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


@functools.cache
def _saved_ops() -> frozenset[Any]:
    """The overload packets of :data:`_SAVED_OPS` this PyTorch has."""
    found = []
    for name in _SAVED_OPS:
        try:
            found.append(getattr(torch.ops.aten, name))
        except AttributeError:
            continue
    return frozenset(found)


def _policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    """Keep matmul, convolution and attention outputs; recompute everything else."""
    if getattr(op, "overloadpacket", op) in _saved_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[Any, Any]:
    contexts: tuple[Any, Any] = create_selective_checkpoint_contexts(_policy)
    return contexts


# -- applying it ----------------------------------------------------------------------


class _CheckpointedForward:
    """A block's forward run under ``torch.utils.checkpoint`` while gradients are recorded.

    An object (not a closure) so that ``copy.deepcopy`` of the model gives the copy's
    blocks a forward of their own, and the model still pickles.
    """

    def __init__(self, module: nn.Module, previous: Any, selective: bool) -> None:
        self.module = module
        #: The instance's own ``forward`` before this one, if it had one.
        self.previous = previous
        self.selective = selective

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._eager(*args, **kwargs)
        if self.selective:
            return checkpoint(
                self._eager, *args, use_reentrant=False, context_fn=_selective_context, **kwargs
            )
        return checkpoint(self._eager, *args, use_reentrant=False, **kwargs)


def _transformers_enable(model: nn.Module) -> Callable[..., Any] | None:
    """transformers' checkpointing switch on ``model`` (the version 5 name first), or None."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        enable = getattr(model, name, None)
        if callable(enable):
            return enable  # type: ignore[no-any-return]
    return None


def is_checkpointed(model: nn.Module) -> bool:
    """Whether ``model`` checkpoints already: blocks wrapped by :func:`apply_checkpointing`,
    or transformers' checkpointing switched on."""
    return any(
        isinstance(m.__dict__.get("forward"), _CheckpointedForward)
        or m.__dict__.get("gradient_checkpointing") is True
        for m in model.modules()
    )


def has_transformers_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` checkpoints its own layers (a transformers model that supports it)."""
    return _transformers_enable(model) is not None


#: Attributes transformers' checkpointing sets on a model's modules.
_HF_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")


def _transformers_full(model: nn.Module, enable: Callable[..., Any]) -> Callable[[], None]:
    saved = [(m, {a: m.__dict__[a] for a in _HF_ATTRS if a in m.__dict__}) for m in model.modules()]
    had_hook = "_require_grads_hook" in model.__dict__
    if enable.__name__ == "activation_checkpointing_enable":
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def undo() -> None:
        for m, attrs in saved:
            for a in _HF_ATTRS:
                if a in attrs:
                    m.__dict__[a] = attrs[a]
                else:
                    m.__dict__.pop(a, None)
        hook = model.__dict__.get("_require_grads_hook")
        if hook is not None and not had_hook:
            hook.remove()
            del model.__dict__["_require_grads_hook"]

    return undo


def _wrap_blocks(model: nn.Module, selective: bool) -> Callable[[], None]:
    blocks = find_blocks(model)
    if not blocks:
        raise OptimizeError(
            f"{type(model).__name__} has no repeated blocks to checkpoint (no nn.ModuleList or "
            "nn.Sequential of two or more modules of one type); wrap the parts that hold the "
            "activations in torch.utils.checkpoint.checkpoint yourself"
        )
    previous = [(b, b.__dict__.get("forward")) for b in blocks]
    for block, prev in previous:
        block.forward = _CheckpointedForward(block, prev, selective)
    # A transformers model's key/value cache grows in the forward and again in the
    # recomputation, which then differs from it: no cache while checkpointed (as
    # transformers' own checkpointing does in training).
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False  # type: ignore[union-attr]

    def undo() -> None:
        for block, prev in previous:
            if prev is None:
                block.__dict__.pop("forward", None)
            else:
                block.__dict__["forward"] = prev
        if use_cache:
            config.use_cache = use_cache  # type: ignore[union-attr]

    return undo


def apply_checkpointing(model: nn.Module, kind: str) -> Callable[[], None]:
    """Checkpoint ``model``'s activations (``kind``: ``"none"``, ``"selective"`` or
    ``"full"``; see the module) and return a function that undoes it exactly.

    Raises :class:`OptimizeError` for an unknown ``kind``, and when ``model`` has no
    repeated blocks to wrap (see :func:`find_blocks`).

    >>> import torch
    >>> from torch import nn
    >>> layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    >>> enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    >>> undo = apply_checkpointing(enc, "full")
    >>> enc(torch.randn(2, 5, 16)).sum().backward()
    >>> undo()
    >>> "forward" in enc.layers[0].__dict__
    False
    """
    if kind not in KINDS:
        raise OptimizeError(f"checkpointing must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "none":
        return lambda: None
    if kind == "full":
        enable = _transformers_enable(model)
        if enable is not None:
            return _transformers_full(model, enable)
    return _wrap_blocks(model, selective=kind == "selective")
