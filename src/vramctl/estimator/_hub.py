"""Models a user names by their Hugging Face configuration: a Hub id, a local folder with a
``config.json``, the file itself, or a ``PretrainedConfig`` in hand.

:func:`config_model` reads the configuration (only ``config.json`` is fetched from the Hub,
and only where it is not already in the local cache), picks the task head from the
config's ``architectures`` or the ``task`` given, and returns a :class:`ConfigModel`: how to
build the model with no weights (the estimator builds it on fake tensors) and how to make a
batch of the kind its forward takes (token ids, raw audio, the feature extractor's
features, or pixels) from a batch size and a length.

>>> from transformers import GPT2Config
>>> m = config_model(GPT2Config(n_layer=2))
>>> m.task, m.class_name, m.inputs
('causal-lm', 'GPT2LMHeadModel', 'tokens')
>>> sorted(m.make_batch(2, seq_len=16))
['attention_mask', 'input_ids', 'labels']
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramctl._errors import VramctlError
from vramctl._optional import require

__all__ = [
    "TASKS",
    "ConfigModel",
    "config_model",
    "eager_masks",
    "is_config_source",
]

#: The task heads, each with its auto class and the ``modeling_auto`` mapping listing its
#: model classes, in the order tried when the config names no architecture (an
#: encoder-decoder's generation head first, then CTC, masked LM, causal LM ...).
TASKS: dict[str, tuple[str, str]] = {
    "seq2seq-lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "speech-seq2seq": ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    "ctc": ("AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "image-classification": (
        "AutoModelForImageClassification",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    ),
    "audio-classification": (
        "AutoModelForAudioClassification",
        "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    ),
    "seq-classification": (
        "AutoModelForSequenceClassification",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    ),
    "token-classification": (
        "AutoModelForTokenClassification",
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    ),
    "base": ("AutoModel", "MODEL_MAPPING_NAMES"),
}
#: Tasks whose decoder makes the tokens (the batch carries decoder labels or ids).
_SEQ2SEQ = ("seq2seq-lm", "speech-seq2seq")
#: Decoder tokens of a speech-to-text batch when no ``seq_len`` is given (Whisper's limit).
DECODER_TOKENS = 448
DEFAULT_SEQ_LEN = 512
DEFAULT_SECONDS = 10.0
DEFAULT_IMAGE_SIZE = 224
SAMPLE_RATE = 16_000


def _transformers() -> Any:
    return require("transformers", extra="zoo", what="estimating a model from its config")


@dataclass(frozen=True)
class ConfigModel:
    """A transformers model described by its configuration: built with no weights, fed a
    batch of the kind its forward takes. It answers as a built-in model does
    (:class:`vramctl.estimator.zoo.ZooModel`)."""

    name: str
    config: Any
    task: str
    class_name: str
    #: ``tokens``, ``audio`` (raw waveforms), ``features`` (a feature extractor's output)
    #: or ``images``.
    inputs: str
    #: The keyword the main input goes in (``input_ids``, ``input_values`` ...).
    input_name: str
    model_class: Any = None
    trust_remote_code: bool = False
    image_size: int | tuple[int, int] | None = None
    default_seq_len: int | None = None
    default_seconds: float | None = None
    max_length: float | None = None
    vocab_size: int = 0
    #: What was set on the config so that a batch runs (a pad token for classification ...).
    notes: tuple[str, ...] = ()

    @property
    def seq2seq(self) -> bool:
        # A classification head on an encoder-decoder (BART's) makes its decoder's inputs
        # from the encoder's; the bare model needs them given.
        encdec = bool(getattr(self.config, "is_encoder_decoder", False))
        return self.task in _SEQ2SEQ or (encdec and self.task == "base")

    def build(self) -> nn.Module:
        """The model with fresh (random) weights, in fp32 whatever the config's dtype."""
        if self.model_class is None:
            tf = _transformers()
            auto = getattr(tf, TASKS[self.task][0])
            model: nn.Module = auto.from_config(
                self.config, trust_remote_code=self.trust_remote_code, dtype=torch.float32
            )
            return model
        built: nn.Module = self.model_class._from_config(self.config, dtype=torch.float32)
        return built

    @property
    def length_arg(self) -> str | None:
        if self.inputs == "tokens":
            return "seq_len"
        if self.inputs in ("audio", "features"):
            return "seconds"
        return None

    def lengths(
        self, seq_len: int | None = None, seconds: float | None = None
    ) -> tuple[int | None, float | None]:
        """The ``(seq_len, seconds)`` batches are made with, defaults filled in (None: the
        inputs take no such length; ``seq_len`` of a speech model is its decoder's)."""
        if self.inputs == "tokens":
            return seq_len or self.default_seq_len or DEFAULT_SEQ_LEN, None
        if self.inputs in ("audio", "features"):
            sec = seconds if seconds is not None else (self.default_seconds or DEFAULT_SECONDS)
            dec = (seq_len or self._decoder_default()) if self.seq2seq else None
            return dec, sec
        return (seq_len or self._decoder_default()) if self.seq2seq else None, None

    def _decoder_default(self) -> int:
        limit = _positions(self.config.get_text_config(decoder=True), decoder=True)
        return min(DECODER_TOKENS, limit) if limit else DECODER_TOKENS

    def make_batch(
        self,
        batch_size: int,
        *,
        seq_len: int | None = None,
        seconds: float | None = None,
        labels: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The keyword inputs of one batch; with ``labels`` what the task's loss needs.

        Float inputs are ``torch.empty`` (their values never matter to an estimate);
        token ids avoid the config's special tokens (an image token would ask for
        pixels).
        """
        if batch_size < 1:
            raise VramctlError(f"batch size must be at least 1, got {batch_size}")
        n, sec = self.lengths(seq_len, seconds)
        batch: dict[str, torch.Tensor] = {}
        if self.inputs == "tokens":
            assert n is not None
            if n < 1:
                raise VramctlError(f"sequence length must be at least 1, got {n}")
            ids = self._ids(batch_size, n)
            eos = getattr(self.config.get_text_config(), "eos_token_id", None)
            if self.task == "seq-classification" and isinstance(eos, int) and eos >= 0:
                ids[:, -1] = eos  # a sentence ends with one (BART-style heads pool on it)
            batch[self.input_name] = ids
            if "attention_mask" in self._forward_args():
                batch["attention_mask"] = torch.ones(batch_size, n, dtype=torch.long)
        elif self.inputs == "images":
            h, w = _pair(self.image_size or _config_image_size(self.config))
            batch[self.input_name] = torch.empty(batch_size, _channels(self.config), h, w)
        else:
            assert sec is not None
            batch.update(self._audio(batch_size, sec))
        if self.seq2seq:
            dec = n if n is not None else self._decoder_default()
            key = "labels" if labels else "decoder_input_ids"
            batch[key] = self._ids(batch_size, dec)
            return batch
        if labels:
            target = self._labels(batch_size, batch)
            if target is not None:
                batch["labels"] = target
        return batch

    # -- pieces of a batch -------------------------------------------------------------

    def _forward_args(self) -> set[str]:
        cls = self.model_class
        if cls is None:
            return set()
        try:
            return set(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError):
            return set()

    def _ids(self, batch_size: int, n: int) -> torch.Tensor:
        vocab = max(2, self.vocab_size)
        ids = torch.randint(0, vocab, (batch_size, n))
        special = sorted(s for s in _special_ids(self.config) if 0 <= s < vocab)
        if special and len(special) < vocab:
            free = next(i for i in range(vocab) if i not in set(special))
            ids[torch.isin(ids, torch.tensor(special))] = free
        return ids

    def _labels(self, batch_size: int, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        task = self.task
        num_labels = max(1, int(getattr(self.config, "num_labels", 2) or 2))
        if task in ("seq-classification", "image-classification", "audio-classification"):
            return torch.randint(0, num_labels, (batch_size,))
        if task == "token-classification":
            n = batch[self.input_name].shape[1]
            return torch.randint(0, num_labels, (batch_size, n))
        if task == "ctc":
            _, sec = self.lengths(None, None)
            seconds = sec or DEFAULT_SECONDS
            for t in batch.values():  # the audio's own length, whatever was asked
                if t.is_floating_point() and t.dim() >= 2:
                    seconds = _batch_seconds(self, t)
                    break
            # About 12 characters a second, as in read speech.
            return torch.randint(
                1, max(2, self.vocab_size), (batch_size, max(1, int(seconds * 12)))
            )
        if task in ("causal-lm", "masked-lm"):
            return batch[self.input_name].clone()
        return None

    def _audio(self, batch_size: int, seconds: float) -> dict[str, torch.Tensor]:
        rate = _sampling_rate(self.config)
        samples = int(seconds * rate)
        if samples < 400:
            raise VramctlError(f"{self.name} needs at least 0.025 s of audio, got {seconds} s")
        if self.inputs == "audio":
            return {self.input_name: torch.empty(batch_size, samples)}
        shapes = _feature_shapes(self.config, samples)
        wanted = self._forward_args()
        out: dict[str, torch.Tensor] = {}
        for key, (shape, floating) in shapes.items():
            if key != self.input_name and wanted and key not in wanted:
                continue
            name = self.input_name if key == "input_features" else key
            if floating:
                out[name] = torch.empty(batch_size, *shape)
            else:
                out[name] = torch.ones(batch_size, *shape, dtype=torch.long)
        return out


# -- tracing transformers' models as they run eagerly ----------------------------------------


@contextlib.contextmanager
def eager_masks() -> Iterator[None]:
    """transformers' attention masks made as for real tensors while the trace runs.

    transformers takes a fake tensor for a sign of graph tracing (``is_tracing``), and then
    always builds the full ``[batch, 1, query, key]`` causal mask, where an eager step
    with no padding passes none and lets SDPA apply causality (``is_causal=True``): a
    mask the real step does not hold, and another SDPA kernel. The mask decisions read the
    padding mask's values, which the trace knows (a batch's masks are real), so they are
    made as the eager step makes them. Other uses of ``is_tracing`` are left alone.
    """
    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "is_tracing", None) if module is not None else None
    if module is None or original is None:
        yield
        return

    def is_tracing(tensor: Any = None) -> bool:
        return bool(original(None))

    module.is_tracing = is_tracing  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.is_tracing = original  # type: ignore[attr-defined]


# -- reading the configuration -------------------------------------------------------------


def is_config_source(source: object) -> bool:
    """Whether ``source`` names a model by its configuration (not a zoo name or a factory):
    a ``PretrainedConfig``, an existing file or folder, or a string shaped like a Hub id."""
    if _is_config_object(source):
        return True
    if not isinstance(source, str) or ":" in source:
        return False
    return (
        source.startswith((".", "/", "~"))
        or source.endswith(".json")
        or os.path.exists(os.path.expanduser(source))
        or _looks_like_hub_id(source)
    )


def _is_config_object(source: object) -> bool:
    return any(c.__name__ in ("PreTrainedConfig", "PretrainedConfig") for c in type(source).__mro__)


def _looks_like_hub_id(s: str) -> bool:
    parts = s.split("/")
    ok = all(p and all(ch.isalnum() or ch in "-_." for ch in p) for p in parts)
    return ok and 1 <= len(parts) <= 2 and not s.startswith(".")


def config_model(
    source: Any,
    *,
    task: str | None = None,
    image_size: int | tuple[int, int] | None = None,
    trust_remote_code: bool = False,
) -> ConfigModel:
    """The :class:`ConfigModel` for a Hub id, a folder with ``config.json``, the JSON file
    itself or a ``PretrainedConfig``; the head is ``task`` or the config's own."""
    if task is not None and task not in TASKS:
        raise VramctlError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if image_size is not None and min(_pair(image_size)) < 1:
        raise VramctlError(f"image_size must be positive, got {image_size!r}")
    tf = _transformers()
    if _is_config_object(source):
        config = copy.deepcopy(source)
        name = getattr(source, "name_or_path", "") or type(source).__name__
    else:
        name = str(source)
        config = _load_config(tf, name, trust_remote_code)
    given = task
    task, cls = _pick_head(tf, config, task, name, trust_remote_code)
    notes = _ready_config(config, task)
    if given is None and not getattr(config, "architectures", None):
        notes.insert(0, f"the config names no architecture; the {task} head was taken (task=)")
    if image_size is not None:
        # The model is built for that size (a ViT's position table follows it).
        for c in _sub_configs(config):
            if isinstance(getattr(c, "image_size", None), int | list | tuple):
                c.image_size = image_size
    input_name = str(getattr(cls, "main_input_name", "input_ids") or "input_ids")
    inputs = _input_kind(task, input_name)
    text = config.get_text_config(decoder=True)
    positions = _positions(config.get_text_config(), decoder=False)
    return ConfigModel(
        name=name,
        config=config,
        task=task,
        class_name=cls.__name__,
        inputs=inputs,
        input_name=input_name,
        model_class=None if trust_remote_code and _remote(config) else cls,
        trust_remote_code=trust_remote_code,
        image_size=image_size,
        default_seq_len=min(DEFAULT_SEQ_LEN, positions) if positions else None,
        default_seconds=DEFAULT_SECONDS if inputs in ("audio", "features") else None,
        max_length=float(positions) if positions and inputs == "tokens" else None,
        vocab_size=int(getattr(text, "vocab_size", 0) or 0),
        notes=(f"{cls.__name__} ({task}) built from {name}'s config, with no weights", *notes),
    )


def _load_config(tf: Any, source: str, trust_remote_code: bool) -> Any:
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        return _config_from_file(tf, path, trust_remote_code)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise VramctlError(f"{source!r} is a folder without a config.json")
        return _from_pretrained(tf, path, source, trust_remote_code)
    if source.startswith((".", "/", "~")) or not _looks_like_hub_id(source):
        raise VramctlError(f"{source!r}: no such file or folder")
    return _from_pretrained(tf, source, source, trust_remote_code)


def _config_from_file(tf: Any, path: str, trust_remote_code: bool) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise VramctlError(f"{path}: not a readable JSON config ({exc})") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise VramctlError(f"{path}: a model config needs a 'model_type' (a config.json)")
    if os.path.basename(path) == "config.json":
        return _from_pretrained(tf, os.path.dirname(path) or ".", path, trust_remote_code)
    model_type = data.pop("model_type")
    try:
        return tf.AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise VramctlError(f"{path}: {_one_line(exc)}") from exc


def _from_pretrained(tf: Any, where: str, shown: str, trust_remote_code: bool) -> Any:
    try:
        return tf.AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        text = str(exc)
        if "trust_remote_code" in text:
            raise VramctlError(
                f"{shown} needs its own code from the Hub to build; if you trust it, pass "
                "--trust-remote-code (trust_remote_code=True)"
            ) from exc
        raise VramctlError(f"{shown}: {_one_line(exc)}") from exc
    except OSError as exc:
        text = str(exc)
        if "couldn't connect" in text or "offline" in text.lower():
            why = (
                "offline mode (HF_HUB_OFFLINE) reads only the local cache, which has"
                if _offline()
                else "no network to reach the Hugging Face Hub, and"
            )
            raise VramctlError(
                f"{shown}: {why} no copy of its config in the local cache; download it once "
                "where there is a network, or give a local folder or config.json"
            ) from exc
        if "not a valid model identifier" in text or "Repository Not Found" in text:
            raise VramctlError(
                f"{shown}: no such model on the Hugging Face Hub (and no such file or folder "
                "here); check the id, or log in for a private or gated model"
            ) from exc
        raise VramctlError(f"{shown}: {_one_line(exc)}") from exc


def _offline() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _remote(config: Any) -> bool:
    return bool(getattr(config, "auto_map", None))


def _pick_head(
    tf: Any, config: Any, task: str | None, name: str, trust_remote_code: bool
) -> tuple[str, Any]:
    """The task and the model class to build for ``config``."""
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", "")

    def listed(t: str) -> list[str]:
        found = getattr(modeling_auto, TASKS[t][1]).get(model_type)
        if found is None:
            return []
        return list(found) if isinstance(found, tuple | list) else [found]

    if trust_remote_code and _remote(config):
        return _remote_head(config, task, name)
    if task is not None:
        classes = listed(task)
        if not classes:
            have = [t for t in TASKS if listed(t)]
            raise VramctlError(
                f"{name}: transformers has no {task} head for model type {model_type!r}; "
                f"it has {', '.join(have) or 'none'}"
            )
        return task, _class(tf, classes[0], name)
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        for t in TASKS:
            if arch in listed(t):
                return t, _class(tf, arch, name)
    for arch in architectures:
        cls = getattr(tf, arch, None)
        if isinstance(cls, type):
            return _task_of_class(arch), cls
    if _remote(config):
        raise VramctlError(
            f"{name} needs its own code from the Hub to build; if you trust it, pass "
            "--trust-remote-code (trust_remote_code=True)"
        )
    for t in TASKS:
        classes = listed(t)
        if classes:
            return t, _class(tf, classes[0], name)
    raise VramctlError(
        f"{name}: transformers {tf.__version__} does not know model type {model_type!r}; "
        "upgrade transformers, or pass --trust-remote-code for a model with its own code"
    )


def _remote_head(config: Any, task: str | None, name: str) -> tuple[str, Any]:
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    auto_map: dict[str, Any] = dict(config.auto_map)
    order = [task] if task is not None else list(TASKS)
    for t in order:
        assert t is not None
        ref = auto_map.get(TASKS[t][0])
        if ref is None:
            continue
        if isinstance(ref, tuple | list):
            ref = ref[0]
        where = getattr(config, "name_or_path", "") or name
        return t, get_class_from_dynamic_module(ref, where)
    raise VramctlError(
        f"{name}'s own code has no {task or 'model'} class (its auto_map lists "
        f"{', '.join(auto_map) or 'nothing'})"
    )


def _class(tf: Any, class_name: str, name: str) -> Any:
    cls = getattr(tf, class_name, None)
    if cls is None:
        raise VramctlError(
            f"{name}: transformers {tf.__version__} has no {class_name}; upgrade transformers"
        )
    return cls


def _task_of_class(class_name: str) -> str:
    for suffix, task in (
        ("ForCausalLM", "causal-lm"),
        ("LMHeadModel", "causal-lm"),
        ("ForMaskedLM", "masked-lm"),
        ("ForCTC", "ctc"),
        ("ForSequenceClassification", "seq-classification"),
        ("ForTokenClassification", "token-classification"),
        ("ForImageClassification", "image-classification"),
        ("ForAudioClassification", "audio-classification"),
        ("ForConditionalGeneration", "seq2seq-lm"),
    ):
        if class_name.endswith(suffix):
            return task
    return "base"


def _ready_config(config: Any, task: str) -> list[str]:
    """Set what a batch needs that the config leaves out; say what was set."""
    notes = []
    text = config.get_text_config(decoder=True)
    if task == "seq-classification" and getattr(text, "pad_token_id", 0) is None:
        for c in {id(config): config, id(text): text}.values():
            c.pad_token_id = 0
        notes.append("the config has no pad token; token 0 was taken as one (no memory effect)")
    if task in _SEQ2SEQ or getattr(config, "is_encoder_decoder", False):
        if getattr(config, "decoder_start_token_id", None) is None:
            start = getattr(config, "pad_token_id", None)
            start = start if start is not None else getattr(config, "bos_token_id", None)
            config.decoder_start_token_id = start if start is not None else 0
            notes.append(
                f"the config has no decoder start token; {config.decoder_start_token_id} "
                "was taken (no memory effect)"
            )
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0
    return notes


def _input_kind(task: str, input_name: str) -> str:
    if input_name == "pixel_values" or task == "image-classification":
        return "images"
    if input_name == "input_values":
        return "audio"
    if input_name == "input_features":
        return "features"
    return "tokens"


def _sub_configs(config: Any) -> Iterator[Any]:
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield sub


def _first_attr(config: Any, names: tuple[str, ...]) -> Any:
    for c in _sub_configs(config):
        for n in names:
            v = getattr(c, n, None)
            if v is not None:
                return v
    return None


def _positions(config: Any, *, decoder: bool) -> int | None:
    names: tuple[str, ...] = ("max_target_positions",) if decoder else ()
    names += ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _special_ids(config: Any) -> set[int]:
    ids: set[int] = set()
    for c in _sub_configs(config):
        for key, value in vars(c).items():
            if key.endswith(("_token_id", "_token_index", "_token_ids")):
                vals = value if isinstance(value, list | tuple) else [value]
                ids.update(v for v in vals if isinstance(v, int) and not isinstance(v, bool))
    return ids


def _pair(size: Any) -> tuple[int, int]:
    if isinstance(size, int | float):
        return int(size), int(size)
    if isinstance(size, dict):
        return int(size.get("height", DEFAULT_IMAGE_SIZE)), int(
            size.get("width", DEFAULT_IMAGE_SIZE)
        )
    vals = list(size)
    return (int(vals[0]), int(vals[-1])) if vals else (DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)


def _config_image_size(config: Any) -> Any:
    return _first_attr(config, ("image_size", "input_size")) or DEFAULT_IMAGE_SIZE


def _channels(config: Any) -> int:
    v = _first_attr(config, ("num_channels", "in_channels", "input_channels"))
    return int(v) if isinstance(v, int) and v > 0 else 3


def _sampling_rate(config: Any) -> int:
    v = _first_attr(config, ("sampling_rate", "sample_rate"))
    return int(v) if isinstance(v, int) and v > 0 else SAMPLE_RATE


def _batch_seconds(model: ConfigModel, t: torch.Tensor) -> float:
    if model.inputs == "audio":
        return float(t.shape[-1]) / _sampling_rate(model.config)
    frames = t.shape[-1] if t.shape[-1] > t.shape[-2] else t.shape[-2]
    return float(frames) / 100.0  # 10 ms feature frames


def _feature_shapes(config: Any, samples: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The shapes (without the batch) of what the model type's feature extractor makes of
    ``samples`` of audio, and whether each is floating point."""
    import numpy as np
    from transformers.models.auto import feature_extraction_auto

    tf = _transformers()
    names: dict[str, str] = vars(feature_extraction_auto)["FEATURE_EXTRACTOR_MAPPING_NAMES"]
    fe_name = names.get(getattr(config, "model_type", ""))
    fe_cls = getattr(tf, fe_name, None) if fe_name else None
    if fe_cls is None:
        raise VramctlError(
            f"no feature extractor is known for model type {config.model_type!r}; pass a "
            "batch of its input features"
        )
    params = inspect.signature(fe_cls.__init__).parameters
    kwargs: dict[str, Any] = {}
    mels = _first_attr(config, ("num_mel_bins", "input_feat_per_channel", "n_mels"))
    if isinstance(mels, int):
        for key in ("feature_size", "num_mel_bins", "n_mels"):
            if key in params:
                kwargs[key] = mels
    rate = _sampling_rate(config)
    if "sampling_rate" in params:
        kwargs["sampling_rate"] = rate
    extractor = fe_cls(**kwargs)
    wave = np.zeros(samples, dtype=np.float32)
    call: dict[str, Any] = {"sampling_rate": rate, "return_tensors": "np"}
    try:
        out = extractor(wave, **call)
    except TypeError:
        out = extractor(wave, return_tensors="np")
    shapes: dict[str, tuple[tuple[int, ...], bool]] = {}
    for key, value in dict(out).items():
        arr = np.asarray(value)
        shapes[key] = (tuple(arr.shape[1:]), bool(np.issubdtype(arr.dtype, np.floating)))
    return shapes
