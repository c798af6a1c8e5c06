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


def _new_cache(model: nn.Module, kind: str, length: int, source: int = 0) -> Any:
    """The cache ``generate`` makes: ``length`` tokens in all (a static cache holds every one
    but the last generated); an encoder-decoder's pairs it with a cross-attention cache of
    the ``source`` length."""
    import transformers

    config: Any = getattr(model, "config", None)
    decoder: Any = config.get_text_config(decoder=True) if config is not None else None
    if kind == "static":
        # generate sizes it to hold every token but the last generated one
        cache = transformers.StaticCache(config=decoder, max_cache_len=length - 1)
        if is_encoder_decoder(model):
            cross = transformers.StaticCache(config=decoder, max_cache_len=source)
            return transformers.EncoderDecoderCache(cache, cross)
        return cache
    if is_encoder_decoder(model):
        return transformers.EncoderDecoderCache(
            transformers.DynamicCache(config=decoder), transformers.DynamicCache(config=decoder)
        )
    return transformers.DynamicCache(config=config)


def _layers(cache: Any) -> list[Any]:
    layers = list(getattr(cache, "layers", ()))
    for part in ("self_attention_cache", "cross_attention_cache"):
        layers.extend(getattr(getattr(cache, part, None), "layers", ()))
    return layers


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors a cache holds (each layer's keys and values, or its states)."""
    out: list[torch.Tensor] = []
    for layer in _layers(cache):
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
    if is_encoder_decoder(model) and not callable(getattr(model, "get_encoder", None)):
        raise EstimateError(
            f"{type(model).__name__} is an encoder-decoder without get_encoder(): "
            "mode='generate' cannot run its encoder apart"
        )


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


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
    if is_encoder_decoder(model):
        _run_encoder_decoder(model, batch, max_new_tokens, cache, phase, unrecorded, register)
        return
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


def _encoder_inputs(batch: Any) -> dict[str, torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}
    if isinstance(batch, Mapping):
        return {
            k: v
            for k, v in batch.items()
            if isinstance(v, torch.Tensor) and not k.startswith("decoder_") and k != "labels"
        }
    raise EstimateError(
        "generate needs the encoder's inputs: a tensor of token ids or a mapping of the "
        "encoder's keyword inputs (input_ids, input_features ...)"
    )


def _decoder_step(
    model: nn.Module, encoder_outputs: Any, mask: torch.Tensor | None, ids: torch.Tensor, kv: Any
) -> torch.Tensor:
    out = model(
        encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=ids, cache=kv,
        use_cache=True,
    )  # fmt: skip
    last: torch.Tensor = out.logits[:, -1]
    del out
    return last.clone() if last.dtype == torch.float32 else last.to(torch.float32)


def _run_encoder_decoder(
    model: nn.Module,
    batch: Any,
    max_new_tokens: int,
    cache: str,
    phase: Callable[[str], None],
    unrecorded: Callable[[], Any] | None,
    register: Callable[[list[torch.Tensor]], None] | None,
) -> None:
    """An encoder-decoder's ``generate``: the encoder once (its output kept to the end), the
    decoder from its start token, with a self-attention cache that grows and a
    cross-attention cache of the encoder's keys and values made by the first step."""
    inputs = _encoder_inputs(batch)
    mask = inputs.get("attention_mask")
    if mask is None and isinstance(inputs.get("input_ids"), torch.Tensor):
        # generate makes one for token inputs
        mask = inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    config: Any = getattr(model, "config", None)
    start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "decoder_start_token_id", None) or 0
    with torch.no_grad():
        phase("forward")
        encoder_outputs = model.get_encoder()(**inputs, return_dict=True)  # type: ignore[operator]
        size = encoder_outputs[0].shape[0]
        source = encoder_outputs[0].shape[1]
        total = 1 + max_new_tokens
        kv = _new_cache(model, cache, total, source)
        ids = torch.full((size, 1), int(start), dtype=torch.long)
        logits = _decoder_step(model, encoder_outputs, mask, ids, kv)
        if register is not None:
            register(cache_tensors(kv))
        ids = torch.cat([ids, logits.argmax(-1)[:, None]], -1)
        if max_new_tokens == 1:
            return
        if unrecorded is None:
            for _ in range(max_new_tokens - 1):
                logits = _decoder_step(model, encoder_outputs, mask, ids[:, -1:], kv)
                ids = torch.cat([ids, logits.argmax(-1)[:, None]], -1)
            return
        before = total - 1
        del ids
        if cache == "dynamic":
            del kv
            with unrecorded():
                kv = _new_cache(model, cache, total, source)
                filled = torch.zeros((size, before - 1), dtype=torch.long)
                _decoder_step(model, encoder_outputs, mask, filled, kv)
                del filled
                _as_after_a_step(kv)
        with unrecorded():
            ids = torch.zeros((size, before), dtype=torch.long)
        assert register is not None
        register([ids, *(cache_tensors(kv) if cache == "dynamic" else [])])
        if cache == "static":
            with unrecorded():
                _fill_static(kv, before - 1)
        logits = _decoder_step(model, encoder_outputs, mask, ids[:, -1:], kv)
        register(cache_tensors(kv))
        del logits


def _as_after_a_step(kv: Any) -> None:
    """A cache built by one long forward, made as a decode step leaves it: a sliding-window
    layer keeps a view of its last tokens, which after one long forward is a view of the
    whole forward's keys, and after a decode step a view of the window's (one token more
    than it keeps)."""
    for layer in _layers(kv):
        for name, t in list(vars(layer).items()):
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-2] == 0:
                continue
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                grown = torch.cat([t[..., :1, :], t], dim=-2)
                setattr(layer, name, grown[..., 1:, :])


def _fill_static(kv: Any, length: int) -> None:
    """Mark a static cache as holding ``length`` tokens (its tensors are already whole)."""
    for layer in _layers(getattr(kv, "self_attention_cache", kv)):
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            layer.cumulative_length = torch.tensor(length)
