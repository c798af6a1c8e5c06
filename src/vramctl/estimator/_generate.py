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

The **offloaded** cache (``cache_implementation="offloaded"``: a ``DynamicCache`` with
``offloading=True``) keeps each layer's keys and values in host memory between its uses.
Entering a layer's update, transformers prefetches the next offloaded layer onto the
device (circling back to the first after the last); leaving it, the layer goes back to
the host. Traced on the host, where ``.to("cpu")`` moves nothing, it is made so: the
copy to the host is made unrecorded (the device's storage is freed once nothing else
holds it, as the attention still does), the prefetch is a recorded copy, and each move's
bytes are a host transfer in the step's time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from vramctl.estimator._spec import EstimateError

__all__ = ["CACHES", "cache_tensors", "check_kv_dtype", "run_generate"]

#: The cache classes ``cache=`` takes (transformers' ``cache_implementation``; ``quantized``
#: is its ``QuantizedCache`` with its defaults: optimum-quanto, 4 bits, groups of 64, the last
#: 128 tokens kept unquantized).
CACHES = ("dynamic", "static", "quantized", "offloaded")

#: The quantized cache's widths (``kv_dtype``): optimum-quanto's ``nbits``.
QUANTIZED_KV = {"int4": 4, "int2": 2}

#: What a traced offloaded cache needs of the trace: ``(unrecorded, register, transfer)``: a
#: context that records nothing, a function that counts tensors as live device memory, one
#: that counts bytes moved between host and device.
Hooks = tuple[
    Callable[[], contextlib.AbstractContextManager[Any]],
    Callable[[list[torch.Tensor]], None],
    Callable[[int], None],
]


def _inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"], batch.get("attention_mask")
    raise EstimateError(
        "generate needs the prompt's token ids: a tensor of shape (batch, prompt length) or a "
        "mapping with 'input_ids'"
    )


def check_kv_dtype(cache: str, kv_dtype: str | None) -> None:
    """Raise where ``kv_dtype`` is not a width of ``cache``."""
    if kv_dtype is None:
        return
    if kv_dtype not in QUANTIZED_KV:
        raise EstimateError(
            f"kv_dtype must be one of {', '.join(QUANTIZED_KV)} (the quantized cache's "
            f"widths), got {kv_dtype!r}"
        )
    if cache != "quantized":
        raise EstimateError(
            f"kv_dtype={kv_dtype!r} is the quantized cache's width: pass cache='quantized' "
            f"(transformers keeps a {cache} cache in the model's dtype)"
        )


def _new_cache(
    model: nn.Module,
    kind: str,
    length: int,
    source: int = 0,
    hooks: Hooks | None = None,
    kv_dtype: str | None = None,
) -> Any:
    """The cache ``generate`` makes: ``length`` tokens in all (a static cache holds every one
    but the last generated); an encoder-decoder's pairs it with a cross-attention cache of
    the ``source`` length. An offloaded cache is transformers' own run for real, or traced
    (``hooks`` given) the one :func:`_traced_offloaded` makes."""
    import transformers

    config: Any = getattr(model, "config", None)
    decoder: Any = config.get_text_config(decoder=True) if config is not None else None
    if kind == "offloaded":
        if is_encoder_decoder(model):
            raise EstimateError("transformers' offloaded cache is priced for decoder-only models")
        if hooks is None:
            return transformers.DynamicCache(config=config, offloading=True)
        return _traced_offloaded(config, hooks)
    if kind == "static":
        # generate sizes it to hold every token but the last generated one
        cache = transformers.StaticCache(config=decoder, max_cache_len=length - 1)
        if is_encoder_decoder(model):
            cross = transformers.StaticCache(config=decoder, max_cache_len=source)
            return transformers.EncoderDecoderCache(cache, cross)
        return cache
    if kind == "quantized":
        if is_encoder_decoder(model):
            raise EstimateError("transformers' quantized cache is for decoder-only models")
        from vramctl._optional import require

        require("optimum.quanto", extra="finetune", what="a quantized KV cache")
        nbits = QUANTIZED_KV[kv_dtype or "int4"]
        return transformers.QuantizedCache(backend="quanto", config=config, nbits=nbits)
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
    """The tensors a cache holds (each layer's keys and values, or its states; a quantized
    tensor's data and scales)."""
    out: list[torch.Tensor] = []
    for layer in _layers(cache):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                out.extend(_plain(value))
    return out


_PACKING = threading.Lock()
_PACKERS = [0]


@contextlib.contextmanager
def _quanto_packs_fakes() -> Iterator[None]:
    """optimum-quanto packs a quantized tensor's integers (two or four to a byte) only when
    they come as a plain ``torch.Tensor`` (``WeightQBitsTensor.__init__`` tests
    ``type(data) is torch.Tensor``): a fake tensor is kept unpacked, two to four times its
    real size. While a quantized cache is traced, fakes are packed as plain tensors are
    (their real path; plain tensors' is unchanged). Undone when the last trace using it
    ends, even on failure."""
    from optimum.quanto.tensor.packed import PackedTensor
    from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor
    from torch._subclasses.fake_tensor import FakeTensor

    with _PACKING:
        if _PACKERS[0] == 0:
            original = WeightQBitsTensor.__init__

            def init(self: Any, qtype: Any, *args: Any, **kwargs: Any) -> None:
                # (qtype, axis, group_size, size, stride, data, scale, shift): data is 5th
                if len(args) > 4 and isinstance(args[4], FakeTensor):
                    args = (*args[:4], PackedTensor.pack(args[4], qtype.bits), *args[5:])
                original(self, qtype, *args, **kwargs)

            init.__wrapped__ = original  # type: ignore[attr-defined]
            WeightQBitsTensor.__init__ = init
        _PACKERS[0] += 1
    try:
        yield
    finally:
        with _PACKING:
            _PACKERS[0] -= 1
            if _PACKERS[0] == 0:
                WeightQBitsTensor.__init__ = WeightQBitsTensor.__init__.__wrapped__


def _resident(cache: Any) -> list[torch.Tensor]:
    """The tensors of a cache in device memory (an offloaded cache's on the device now)."""
    on_device = getattr(cache, "device_tensors", None)
    return list(on_device()) if callable(on_device) else cache_tensors(cache)


def _check_on_cuda(model: nn.Module) -> None:
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        raise EstimateError(
            "the offloaded cache keeps keys and values in host memory while a CUDA GPU "
            "computes: run it with the model on a CUDA device"
        )


def _traced_offloaded(config: Any, hooks: Hooks) -> Any:
    """transformers' offloaded ``DynamicCache`` as the trace sees it (see the module): its
    update prefetches the next offloaded layer and offloads this one, by the same rule."""
    import transformers

    unrecorded, register, transfer = hooks

    class TracedOffloadedCache(transformers.DynamicCache):
        def __init__(self) -> None:
            super().__init__(config=config)
            #: layers that move: neither placeholders nor linear attention (their states
            #: stay on the device); generate's offloaded cache moves sliding layers too
            self.movable = [
                not (dummy or linear)
                for linear, dummy in zip(
                    _flags(self, "is_linear"), _flags(self, "is_dummy"), strict=True
                )
            ]
            self.away: set[int] = set()

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
            *args: Any, **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
            self.fetch(layer_idx + 1)
            layer: Any = self.layers[layer_idx]
            keys, values = layer.update(key_states, value_states, *args, **kwargs)
            register([keys, values])  # the cache, until the attention lets go of it
            self.offload_layer(layer_idx)
            return keys, values

        def fetch(self, start: int) -> None:
            order = [*range(start, len(self.layers)), *range(min(start, len(self.layers)))]
            nxt = next((i for i in order if self.movable[i]), None)
            if nxt is None or nxt not in self.away:
                return
            self.away.discard(nxt)
            layer: Any = self.layers[nxt]
            layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            register([layer.keys, layer.values])
            transfer(layer.keys.nbytes + layer.values.nbytes)

        def offload_layer(self, index: int) -> None:
            layer: Any = self.layers[index]
            if not self.movable[index] or not getattr(layer, "is_initialized", False):
                return
            transfer(layer.keys.nbytes + layer.values.nbytes)
            with unrecorded():  # the host's copies
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            self.away.add(index)

        def device_tensors(self) -> list[torch.Tensor]:
            out: list[torch.Tensor] = []
            for i, layer in enumerate(self.layers):
                if i not in self.away:
                    out.extend(t for t in vars(layer).values() if isinstance(t, torch.Tensor))
            return out

    return TracedOffloadedCache()


def _flags(cache: Any, name: str) -> list[bool]:
    return list(getattr(cache, name, None) or [False] * len(cache.layers))


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    flatten = getattr(t, "__tensor_flatten__", None)
    if not callable(flatten) or type(t) is torch.Tensor:
        return [t]
    names, _ = flatten()
    return [inner for name in names for inner in _plain(getattr(t, name))]


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


def _last_logits(out: Any) -> torch.Tensor:
    last: torch.Tensor = out.logits[:, -1]
    # transformers' ``.to(copy=True, dtype=torch.float32)``: a copy in fp32 either way
    return last.clone() if last.dtype == torch.float32 else last.to(torch.float32)


#: One forward of the loop: ``(ids, mask, cache) -> the last position's fp32 logits``.
Step = Callable[[torch.Tensor, "torch.Tensor | None", Any], torch.Tensor]


def run_generate(
    model: nn.Module,
    batch: Any,
    max_new_tokens: int,
    cache: str = "dynamic",
    *,
    phase: Callable[[str], None] = lambda _: None,
    unrecorded: Callable[[], Any] | None = None,
    register: Callable[[list[torch.Tensor]], None] | None = None,
    transfer: Callable[[int], None] = lambda _: None,
    kv_dtype: str | None = None,
) -> None:
    """A greedy ``generate`` of ``max_new_tokens`` after the prompt in ``batch``.

    Run for real (``unrecorded`` None), it is every step of the loop. Traced, ``unrecorded``
    is a context in which the trace records nothing and ``register`` counts tensors made
    there as live: the prefill and the last step are traced, and the cache between them is
    built by one unrecorded forward (see the module). ``transfer`` counts the bytes an
    offloaded cache moves between host and device. ``kv_dtype`` is the quantized cache's
    width (:data:`QUANTIZED_KV`).
    """
    check_generates(model)
    if max_new_tokens < 1:
        raise EstimateError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if cache not in CACHES:
        raise EstimateError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")
    check_kv_dtype(cache, kv_dtype)
    hooks: Hooks | None = None
    if cache == "offloaded":
        if unrecorded is None:
            _check_on_cuda(model)
        else:
            assert register is not None
            hooks = (unrecorded, register, transfer)
    traced_quanto = cache == "quantized" and unrecorded is not None
    with torch.no_grad(), _quanto_packs_fakes() if traced_quanto else contextlib.nullcontext():
        phase("forward")
        if is_encoder_decoder(model):
            step, ids, mask, source = _encoder_decoder(model, batch)
        else:
            ids, mask = _inputs(batch)
            if mask is None:
                mask = torch.ones_like(ids)
            step, source = _decoder_only(model), 0
        total = ids.shape[1] + max_new_tokens

        def new_cache() -> Any:
            return _new_cache(model, cache, total, source, hooks, kv_dtype)

        first = [ids, mask]  # handed over: the loop frees them when generate would
        del ids, mask
        _loop(step, new_cache, first, total, max_new_tokens, cache, unrecorded, register)


def _decoder_only(model: nn.Module) -> Step:
    def step(ids: torch.Tensor, mask: torch.Tensor | None, kv: Any) -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=mask, cache=kv, use_cache=True, logits_to_keep=1)
        return _last_logits(out)

    return step


def _encoder_decoder(model: nn.Module, batch: Any) -> tuple[Step, torch.Tensor, None, int]:
    """An encoder-decoder's ``generate``: the encoder once (its output kept to the end), the
    decoder from its start token, with a self-attention cache that grows and a
    cross-attention cache of the encoder's keys and values made by the first step."""
    inputs = _encoder_inputs(batch)
    features = inputs.get("input_features")
    if callable(getattr(model, "_get_input_segment", None)) and isinstance(features, torch.Tensor):
        # Whisper's generate feeds the encoder a segment it cuts out of the features: a copy
        # of each sample's, concatenated (WhisperGenerationMixin._get_input_segment)
        inputs["input_features"] = torch.cat([features[i : i + 1] for i in range(len(features))])
    enc_mask = inputs.get("attention_mask")
    if enc_mask is None and isinstance(inputs.get("input_ids"), torch.Tensor):
        # generate makes one for token inputs
        enc_mask = inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    config: Any = getattr(model, "config", None)
    start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "decoder_start_token_id", None) or 0
    encoder_outputs = model.get_encoder()(**inputs, return_dict=True)  # type: ignore[operator]

    def step(ids: torch.Tensor, mask: torch.Tensor | None, kv: Any) -> torch.Tensor:
        out = model(
            encoder_outputs=encoder_outputs, attention_mask=enc_mask, decoder_input_ids=ids,
            cache=kv, use_cache=True,
        )  # fmt: skip
        return _last_logits(out)

    size, source = encoder_outputs[0].shape[:2]
    ids = torch.full((size, 1), int(start), dtype=torch.long)
    return step, ids, None, int(source)


def _loop(
    step: Step,
    new_cache: Callable[[], Any],
    first: list[Any],
    total: int,
    max_new_tokens: int,
    cache: str,
    unrecorded: Callable[[], Any] | None,
    register: Callable[[list[torch.Tensor]], None] | None,
) -> None:
    """The decode loop from the first forward of ``first`` (the ids and the mask, taken out of
    the list): every step run for real, or, traced, the last step against a cache built
    unrecorded (``total`` tokens in all)."""
    ids, mask = first
    first.clear()
    kv = new_cache()
    logits = step(ids, mask, kv)
    if register is not None:
        register(_resident(kv))
    ids = torch.cat([ids, logits.argmax(-1)[:, None]], -1)
    if max_new_tokens == 1:
        return
    if unrecorded is None:
        for _ in range(max_new_tokens - 1):
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], -1)
            logits = step(ids[:, -1:], mask, kv)
            ids = torch.cat([ids, logits.argmax(-1)[:, None]], -1)
        return
    # The last step: the cache holds every token but the last generated one.
    masked = mask is not None
    size = logits.shape[0]
    before = total - 1
    del ids, mask
    if cache in ("dynamic", "offloaded"):
        del kv
        with unrecorded():
            kv = new_cache()
            filled = torch.zeros((size, before - 1), dtype=torch.long)
            step(filled, torch.ones_like(filled) if masked else None, kv)
            del filled
            _as_after_a_step(kv)
    elif cache == "quantized":
        del kv
        with unrecorded():
            layers = getattr(new_cache(), "layers", None) or [None]
        limit = int(getattr(layers[0], "residual_length", 128) or 128)
        (q, r), spike = _quantized_counts(total - max_new_tokens, max_new_tokens, limit)
        if spike is not None:
            # the last step before this one that quantized the whole cache again
            with unrecorded():
                kv = new_cache()
                _fill_quantized(kv, step, size, *spike, masked)
                one = torch.zeros((size, 1), dtype=torch.long)
                grown = torch.ones((size, sum(spike) + 1), dtype=torch.long) if masked else None
            assert register is not None
            register(cache_tensors(kv))
            step(one, grown, kv)
            del kv, one, grown
        with unrecorded():
            kv = new_cache()
            _fill_quantized(kv, step, size, q, r, masked)
    with unrecorded():
        ids = torch.zeros((size, before), dtype=torch.long)
        mask = torch.ones((size, before), dtype=torch.long) if masked else None
    assert register is not None
    kept = [ids, *([mask] if mask is not None else [])]
    register([*kept, *(_resident(kv) if cache != "static" else [])])
    if cache == "static":
        with unrecorded():
            # its length so far: the positions written (a static cache keeps no count)
            _fill_static(kv, before - 1)
    logits = step(ids[:, -1:], mask, kv)
    register(_resident(kv))  # the cache the step grew
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


def _quantized_counts(
    prompt: int, new: int, limit: int
) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """``((quantized, unquantized), spike)``: a quantized cache's tokens before the last step,
    and before the last earlier step that quantized them all again (None: none did). The
    prefill quantizes the prompt; each decode step keeps its token unquantized until
    ``limit`` are, then quantizes everything (``QuantizedLayer.update``)."""
    quantized, residual, spike = prompt, 0, None
    for _ in range(new - 2):  # the decode steps before the last
        if residual + 1 >= limit:
            spike = (quantized, residual)
            quantized, residual = quantized + residual + 1, 0
        else:
            residual += 1
    return (quantized, residual), spike


def _fill_quantized(
    kv: Any, step: Step, size: int, quantized: int, residual: int, masked: bool
) -> None:
    """A quantized cache holding ``quantized`` tokens quantized and ``residual`` not: two
    forwards, the first quantized as a prefill, the second kept as the residual."""
    filled = torch.zeros((size, quantized), dtype=torch.long)
    step(filled, torch.ones_like(filled) if masked else None, kv)
    if residual:
        more = torch.zeros((size, residual), dtype=torch.long)
        mask = torch.ones((size, quantized + residual), dtype=torch.long) if masked else None
        step(more, mask, kv)


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
