"""The model a run is given, by name or in hand, and what identifies its outputs.

:func:`load_model` turns what a user names into a :class:`ModelSource`:

- a folder saved with ``save_pretrained`` (weights, ``config.json``, and a processor or
  feature extractor, with a tokenizer where there is one) or a Hugging Face Hub id
  (``facebook/wav2vec2-base-960h``, ``nvidia/parakeet-ctc-0.6b``): the model is loaded
  with its trained weights, each batch goes through the checkpoint's own feature
  extractor, and a CTC model with a tokenizer decodes its frames to **text** (greedy:
  the most likely token per frame, repeats and blanks removed by the tokenizer's CTC
  decoding, as the transformers ASR pipeline does);
- ``'package.module:factory'`` (imported as ``python -m`` would: the current directory
  first);
- a built-in name of :mod:`vramctl.estimator.zoo` (an audio architecture with **random
  weights**: for trying the run, not for useful outputs).

:func:`model_identity` fingerprints a built model (its parameter shapes and a sample of
every tensor's values), for the run's identity: a resumed run must be made by the
same model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vramctl._optional import require
from vramctl.batching._adaptive import BatchingError
from vramctl.batching._outputs import valid_frames

__all__ = [
    "OUTPUT_KINDS",
    "ModelSource",
    "PretrainedForward",
    "callable_name",
    "load_model",
    "model_identity",
]

log = logging.getLogger("vramctl.batching")

#: What a run can keep per recording (``process(output_kind=...)``).
OUTPUT_KINDS = ("text", "frames", "embedding", "summary")
#: Values sampled from each tensor for the weights' fingerprint.
_SAMPLES = 1024


@dataclass
class ModelSource:
    """A model to run, with what it needs besides its module.

    ``model`` is a zero-argument factory or a module; ``forward`` (None: the module is
    called on the waveforms) and ``decoder`` (a CTC model's frames ``[T, vocab]`` to
    text; None: no text output) come with a pretrained checkpoint; ``sample_rate`` is
    the rate its feature extractor takes (None: not known). ``identity`` is what names
    the model in a run's identity, besides its weights.
    """

    name: str
    model: nn.Module | Callable[[], nn.Module]
    forward: Callable[[nn.Module, torch.Tensor, torch.Tensor], Any] | None = None
    decoder: Callable[[torch.Tensor], str] | None = None
    sample_rate: int | None = None
    #: "pretrained", "zoo", "factory" or "module".
    kind: str = "factory"
    random_weights: bool = False
    identity: dict[str, Any] = field(default_factory=dict)

    @property
    def default_output(self) -> str:
        """``"text"`` where the model decodes to text, else ``"summary"``."""
        return "text" if self.decoder is not None else "summary"


def load_model(spec: str | nn.Module | Callable[[], nn.Module] | ModelSource) -> ModelSource:
    """The :class:`ModelSource` for a folder, a Hub id, ``module:factory``, a built-in
    name, a module or a factory (a :class:`ModelSource` is taken as it is)."""
    if isinstance(spec, ModelSource):
        return spec
    if isinstance(spec, nn.Module):
        return ModelSource(type(spec).__name__, spec, kind="module")
    if not isinstance(spec, str):
        if callable(spec):
            return ModelSource(callable_name(spec), spec, kind="factory")
        raise BatchingError(
            f"model must be an nn.Module, a factory or a name, got {type(spec).__name__}"
        )
    if os.path.isdir(spec):
        return _pretrained(spec, local=True)
    if ":" in spec:
        from vramctl.estimator._shared import load_model_source

        name, built = load_model_source(spec)
        kind = "module" if isinstance(built, nn.Module) else "factory"
        return ModelSource(name, built, kind=kind)
    from vramctl.estimator import zoo

    if spec in zoo.names():
        entry = zoo.get(spec)
        if entry.inputs != "audio":
            raise BatchingError(
                f"{spec} takes {entry.inputs}, not audio: give a speech checkpoint (a folder"
                " saved with save_pretrained, or a Hub id), a built-in audio model"
                f" ({', '.join(_audio_names())}) or 'package.module:factory'"
            )
        return ModelSource(entry.name, entry.build, kind="zoo", random_weights=True)
    local = spec.startswith((".", "/", "~")) or os.path.exists(spec)
    if not local and spec.count("/") == 1 and all(spec.split("/")):
        return _pretrained(spec, local=False)  # "org/name": a Hub id
    what = "no such folder" if local else "not a folder, a Hub id or a built-in name"
    raise BatchingError(
        f"model {spec!r}: {what}; give a folder saved with save_pretrained, a Hub id like"
        " facebook/wav2vec2-base-960h, 'package.module:factory' or a built-in audio model"
        f" ({', '.join(_audio_names())})"
    )


def _audio_names() -> list[str]:
    from vramctl.estimator import zoo

    return [n for n in zoo.names() if zoo.get(n).inputs == "audio"]


def callable_name(fn: Any) -> str:
    """A callable's stable name: its module and qualified name (an instance: its own
    ``__name__``, else its class's), for messages and a run's identity."""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    qual = qual or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{qual}" if module and module != "__main__" else str(qual)


# -- pretrained checkpoints ------------------------------------------------------------


def _pretrained(spec: str, *, local: bool) -> ModelSource:
    require("transformers", extra="zoo", what=f"model {spec!r} (a pretrained checkpoint)")
    import transformers

    where = os.path.abspath(spec) if local else spec
    if local and not os.path.isfile(os.path.join(spec, "config.json")):
        raise BatchingError(
            f"model folder {where} has no config.json: give a folder written by"
            " save_pretrained (config.json, the weights and the processor)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise BatchingError(f"model {spec!r}: cannot read its config: {exc}") from None
    processor = _processor(spec, where)
    extractor = getattr(processor, "feature_extractor", processor)
    tokenizer = getattr(processor, "tokenizer", None)
    architectures = list(getattr(config, "architectures", None) or [])
    ctc = any(a.endswith("ForCTC") for a in architectures)
    loader = transformers.AutoModelForCTC if ctc else transformers.AutoModel

    def build() -> nn.Module:
        from transformers.utils import logging

        hf_logging: Any = logging  # untyped functions
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # the run shows its own progress
        try:
            model: nn.Module = loader.from_pretrained(spec)
        except (OSError, ValueError) as exc:
            raise BatchingError(f"model {spec!r}: cannot load its weights: {exc}") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        return model

    decoder = _CtcDecoder(tokenizer) if ctc and tokenizer is not None else None
    rate = getattr(extractor, "sampling_rate", None)
    identity = {
        "source": where,
        "architectures": architectures,
        "processor": _digest(_processor_state(extractor, tokenizer)),
    }
    return ModelSource(
        spec,
        build,
        forward=PretrainedForward(extractor, int(rate) if rate else None),
        decoder=decoder,
        sample_rate=int(rate) if rate else None,
        kind="pretrained",
        identity=identity,
    )


def _processor(spec: str, where: str) -> Any:
    """The checkpoint's processor, or its feature extractor alone."""
    import transformers

    problems = []
    loaders: list[Any] = [transformers.AutoProcessor, transformers.AutoFeatureExtractor]
    for cls in loaders:
        try:
            found = cls.from_pretrained(spec)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            continue
        extractor = getattr(found, "feature_extractor", found)
        if callable(extractor) and hasattr(extractor, "sampling_rate"):
            return found
        problems.append(f"{type(found).__name__} holds no audio feature extractor")
    raise BatchingError(
        f"model {where}: no audio feature extractor found ({'; '.join(problems[:2])}); save the"
        " processor (or feature extractor) with the model: processor.save_pretrained(folder)"
    )


def _processor_state(extractor: Any, tokenizer: Any) -> Any:
    state: dict[str, Any] = {"extractor": type(extractor).__name__}
    to_dict = getattr(extractor, "to_dict", None)
    if callable(to_dict):
        state["extractor_config"] = {
            k: v for k, v in to_dict().items() if isinstance(v, str | int | float | bool | None)
        }
    if tokenizer is not None:
        state["tokenizer"] = type(tokenizer).__name__
        state["vocab"] = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return state


class PretrainedForward:
    """A checkpoint's forward: its feature extractor on each item, then the model.

    The waveforms stay on the host (``host_inputs``): the feature extractor reads each
    item's valid samples, and its output goes to the model's device. Returns the model's
    time-major output (``logits`` or ``last_hidden_state``) and the valid frames per item.
    """

    host_inputs = True

    def __init__(self, extractor: Any, sample_rate: int | None) -> None:
        self.extractor = extractor
        self.sample_rate = sample_rate
        self.__name__ = f"{type(extractor).__name__}+model"

    def features(self, waveforms: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        items = [
            w[: int(n)].detach().cpu().float().numpy()
            for w, n in zip(waveforms, lengths, strict=True)
        ]
        kwargs: dict[str, Any] = {"return_tensors": "pt", "padding": True}
        if self.sample_rate:
            kwargs["sampling_rate"] = self.sample_rate
        out = self.extractor(items, **kwargs)
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    def __call__(self, model: nn.Module, waveforms: torch.Tensor, lengths: torch.Tensor) -> Any:
        feats = self.features(waveforms, lengths)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        out = model(**{k: v.to(device) for k, v in feats.items()})
        value = getattr(out, "logits", None)
        if not isinstance(value, torch.Tensor):
            value = getattr(out, "last_hidden_state", None)
        if not isinstance(value, torch.Tensor):
            value = out[0]
        return value, _frames(model, out, feats, lengths, int(value.shape[1]))

    def estimation(self, model: nn.Module, sample_rate: int) -> tuple[nn.Module, Any]:
        """(module, make_batch) for the memory estimator: the model on features of the
        shapes the extractor gives, as meta tensors (no memory), beside the waveforms."""
        shapes: dict[float, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        keys: list[str] = []

        def make(n: int, seconds: float) -> tuple[torch.Tensor, ...]:
            size = max(1, round(seconds * sample_rate))
            if seconds not in shapes:
                one = self.features(torch.zeros(1, size), torch.tensor([size]))
                keys[:] = list(one)
                shapes[seconds] = [(tuple(v.shape[1:]), v.dtype) for v in one.values()]
            feats = [
                torch.empty((n, *shape), dtype=dtype, device="meta")
                for shape, dtype in shapes[seconds]
            ]
            return (torch.empty(n, size, device="meta"), *feats)

        class _OnFeatures(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, waveforms: torch.Tensor, *feats: torch.Tensor) -> Any:
                return self.inner(**dict(zip(keys, feats, strict=True)))

        return _OnFeatures(model), make


def _frames(
    model: nn.Module, out: Any, feats: dict[str, torch.Tensor], lengths: torch.Tensor, limit: int
) -> torch.Tensor:
    """Valid output frames per item, by the model's own rules."""
    mask = getattr(out, "attention_mask", None)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == limit:
        return mask.sum(-1).to("cpu", torch.int64)
    # A model that subsamples its feature frames (Parakeet): its rule on the features' mask.
    subsample = getattr(model, "_get_subsampling_output_length", None)
    feat_mask = feats.get("attention_mask")
    if callable(subsample) and isinstance(feat_mask, torch.Tensor):
        return torch.as_tensor(subsample(feat_mask.sum(-1))).to("cpu", torch.int64).clamp(0, limit)
    # Else the waveform's rule (wav2vec2's), or in proportion: as for any forward.
    lengths = lengths.cpu()
    return valid_frames(model, lengths, int(lengths.max()) if len(lengths) else 1, limit)


class _CtcDecoder:
    """A CTC model's frames ``[T, vocab]`` to text: the best token per frame, decoded by
    the tokenizer's CTC rules (repeats merged, blanks dropped), special tokens skipped."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, frames: torch.Tensor) -> str:
        ids = frames.argmax(-1).tolist() if frames.numel() else []
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text.strip()


# -- identity ---------------------------------------------------------------------------


def model_identity(model: nn.Module) -> dict[str, Any]:
    """The model's class, parameter count, a digest of its tensors' names, shapes and dtypes,
    and a digest of a sample of their values (:data:`_SAMPLES` evenly spaced per tensor:
    any retraining or other checkpoint changes them, in milliseconds for any size)."""
    shapes = hashlib.blake2b(digest_size=8)
    values = hashlib.blake2b(digest_size=8)
    count = 0
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=False).items():
            shapes.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            count += t.numel()
            if t.is_meta or t.numel() == 0:
                continue
            flat = t.detach().reshape(-1)
            k = min(flat.numel(), _SAMPLES)
            idx = torch.linspace(0, flat.numel() - 1, k, device=flat.device).long()
            sample = flat[idx].cpu().contiguous()
            values.update(sample.view(torch.uint8).numpy().tobytes())
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": count,
        "shapes": shapes.hexdigest(),
        "weights": values.hexdigest(),
    }


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
