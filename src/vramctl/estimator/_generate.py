"""Generation: the memory of a causal language model's ``generate``, prompt to last token.

A greedy ``generate`` as transformers runs it holds, at its two high points:

- **the prefill**: the prompt's forward into an empty cache (the model's own cache class:
  ``DynamicCache``, or ``StaticCache`` allocated on the first forward for every token but
  the last generated one),
  with the logits of the last position only (``logits_to_keep=1``), copied to fp32 for the
  token's choice;
- **the last decode step**: one token's forward against the cache at its longest. A
  ``DynamicCache`` grows by concatenation, so each layer holds its old and its new keys (and
  values) for a moment; the previous step's fp32 logits, the generated ids and the
  attention mask are live too.

Other steps hold less: the cache only grows. The estimate traces the prefill, then builds
the cache of the last step by the model's own forward over the tokens before it (not
recorded: on fake tensors a forward costs the same at any length), then traces the last
step. The peak is the larger of the two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from vramctl.estimator._spec import EstimateError

__all__ = ["CACHES", "cache_tensors", "run_generate"]

#: The cache classes ``cache=`` takes (transformers' ``cache_implementation``).
CACHES = ("dynamic", "static")


def _inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"], batch.get("attention_mask")
    raise EstimateError(
        "generate needs the prompt's token ids: a tensor of shape (batch, prompt length) or a "
        "mapping with 'input_ids'"
    )


def _new_cache(model: nn.Module, kind: str, length: int) -> Any:
    import transformers

    config: Any = getattr(model, "config", None)
    if kind == "static":
        # generate sizes it to hold every token but the last generated one
        return transformers.StaticCache(config=config, max_cache_len=length - 1)
    return transformers.DynamicCache(config=config)


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors a cache holds (each layer's keys and values, or its states)."""
    out: list[torch.Tensor] = []
    for layer in getattr(cache, "layers", ()):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


def check_generates(model: nn.Module) -> None:
    """Raise where ``model`` cannot ``generate`` (no causal-LM head)."""
    can = getattr(model, "can_generate", None)
    if not callable(can) or not can():
        raise EstimateError(
            f"{type(model).__name__} cannot generate: mode='generate' needs a causal language "
            "model (a ...ForCausalLM, with a language-model head)"
        )
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise EstimateError(
            f"{type(model).__name__} is an encoder-decoder: mode='generate' prices "
            "decoder-only models for now"
        )


def _forward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
    last: torch.Tensor = out.logits[:, -1]
    del out
    # transformers' ``.to(copy=True, dtype=torch.float32)``: a copy in fp32 either way
    return last.clone() if last.dtype == torch.float32 else last.to(torch.float32)


def run_generate(
    model: nn.Module,
    batch: Any,
    max_new_tokens: int,
    cache: str = "dynamic",
    *,
    phase: Callable[[str], None] = lambda _: None,
    unrecorded: Callable[[], Any] | None = None,
    register: Callable[[list[torch.Tensor]], None] | None = None,
) -> None:
    """A greedy ``generate`` of ``max_new_tokens`` after the prompt in ``batch``.

    Run for real (``unrecorded`` None), it is every step of the loop. Traced, ``unrecorded``
    is a context in which the trace records nothing and ``register`` counts tensors made
    there as live: the prefill and the last step are traced, and the cache between them is
    built by one unrecorded forward (see the module).
    """
    check_generates(model)
    if max_new_tokens < 1:
        raise EstimateError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if cache not in CACHES:
        raise EstimateError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")
    ids, mask = _inputs(batch)
    if mask is None:
        mask = torch.ones_like(ids)
    total = ids.shape[1] + max_new_tokens
    with torch.no_grad():
        phase("forward")
        kv = _new_cache(model, cache, total)
        logits = _forward(model, ids, mask, kv)
        if register is not None:
            register(cache_tensors(kv))
        ids = torch.cat([ids, logits.argmax(-1)[:, None]], -1)
        if max_new_tokens == 1:
            return
        if unrecorded is None:
            for _ in range(max_new_tokens - 1):
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], -1)
                logits = _forward(model, ids[:, -1:], mask, kv)
                ids = torch.cat([ids, logits.argmax(-1)[:, None]], -1)
            return
        # The last step: the cache holds every token but the last generated one.
        before = total - 1
        del ids, mask
        if cache == "dynamic":
            del kv
            with unrecorded():
                kv = _new_cache(model, cache, total)
                filled = torch.zeros((logits.shape[0], before - 1), dtype=torch.long)
                _forward(model, filled, torch.ones_like(filled), kv)
                del filled
                _as_after_a_step(kv)
        with unrecorded():
            ids = torch.zeros((logits.shape[0], before), dtype=torch.long)
            mask = torch.ones((logits.shape[0], before), dtype=torch.long)
        assert register is not None
        register([ids, mask, *(cache_tensors(kv) if cache == "dynamic" else [])])
        if cache == "static":
            with unrecorded():
                # its length so far: the positions written (a static cache keeps no count)
                _fill_static(kv, before - 1)
        logits = _forward(model, ids[:, -1:], mask, kv)
        register(cache_tensors(kv))  # the cache the step grew
        del logits


def _as_after_a_step(kv: Any) -> None:
    """A cache built by one long forward, made as a decode step leaves it: a sliding-window
    layer keeps a view of its last tokens, which after one long forward is a view of the
    whole forward's keys, and after a decode step a view of the window's (one token more
    than it keeps)."""
    for layer in getattr(kv, "layers", ()):
        for name, t in list(vars(layer).items()):
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-2] == 0:
                continue
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                grown = torch.cat([t[..., :1, :], t], dim=-2)
                setattr(layer, name, grown[..., 1:, :])


def _fill_static(kv: Any, length: int) -> None:
    """Mark a static cache as holding ``length`` tokens (its tensors are already whole)."""
    for layer in getattr(kv, "layers", ()):
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            layer.cumulative_length = torch.tensor(length)
