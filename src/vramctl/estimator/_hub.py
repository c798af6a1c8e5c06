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
import dataclasses
import difflib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramctl._errors import VramctlError
from vramctl._optional import require
from vramctl.estimator._patch import patched

__all__ = [
    "TASKS",
    "ConfigModel",
    "check_positions",
    "config_model",
    "eager_masks",
    "is_config_source",
    "unknown_config_keys",
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
    #: The most tokens ``seq_len`` may ask for (the position table, or the length RoPE and
    #: its scaling were trained for), and the config keys that say so.
    max_positions: int | None = None
    positions_from: str = ""

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

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def is_tracing(tensor: Any = None) -> bool:
            return bool(original(None))

        return is_tracing

    with patched(module, "is_tracing", make):
        yield


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
    unknown = _unknown_keys_note(config)
    if unknown:
        notes.insert(0, unknown)
    input_name = str(getattr(cls, "main_input_name", "input_ids") or "input_ids")
    inputs = _input_kind(task, input_name)
    if image_size is not None:
        # The model is built for that size (a ViT's position table follows it).
        sized = False
        for c in _sub_configs(config):
            if isinstance(getattr(c, "image_size", None), int | list | tuple):
                c.image_size = image_size
                sized = True
        if not sized and inputs != "images":
            notes.append(
                f"image_size={image_size} was given but not used: {name}'s inputs take no images"
            )
    text = config.get_text_config(decoder=True)
    positions = _positions(config.get_text_config(), decoder=False)
    encdec = bool(getattr(config, "is_encoder_decoder", False))
    limit = _seq_len_limit(
        config, tokens=inputs == "tokens", decoder=task in _SEQ2SEQ or (encdec and task == "base")
    )
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
        max_length=float(limit[0]) if limit and inputs == "tokens" else None,
        vocab_size=int(getattr(text, "vocab_size", 0) or 0),
        notes=(f"{cls.__name__} ({task}) built from {name}'s config, with no weights", *notes),
        max_positions=limit[0] if limit else None,
        positions_from=limit[1] if limit else "",
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
    _reach_hub(source)
    return _from_pretrained(tf, source, source, trust_remote_code)


#: Seconds to wait for the Hub's answer about a config.json (HF_HUB_ETAG_TIMEOUT, where set).
HUB_TIMEOUT = 5.0


def _reach_hub(repo_id: str) -> None:
    """Fail fast, in one line, where the Hub cannot be reached for a config that is not in
    the local cache.

    huggingface_hub retries a download that finds no network and no cached copy for about
    half a minute, a line each try; one request without retries asks first. Offline
    mode, a cached copy and any answer from the Hub (even "not found") go on to transformers.
    """
    try:
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
        from huggingface_hub import try_to_load_from_cache as cached
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:
        return
    if _offline() or isinstance(cached(repo_id, "config.json"), str):
        return
    timeout = float(constants.HF_HUB_ETAG_TIMEOUT)
    if timeout == constants.DEFAULT_ETAG_TIMEOUT:
        timeout = HUB_TIMEOUT
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=timeout)
    except HfHubHTTPError:
        return  # the Hub answered: transformers says what it said
    except ValueError:
        return  # not a valid repository id: transformers says so
    except Exception as exc:
        why = _one_line(exc)[:120] or type(exc).__name__
        raise VramctlError(
            f"{repo_id}: cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({why}), "
            "and there is no copy of its config in the local cache; check the network (or "
            "HF_ENDPOINT), download it once where there is one, or give a local folder or "
            "config.json (HF_HUB_OFFLINE=1 reads only the cache)"
        ) from exc


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
        unknown = _unknown_model_type(tf, exc, path, model_type)
        raise unknown or VramctlError(f"{path}: {_one_line(exc)}") from exc


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
        unknown = _unknown_model_type(tf, exc, shown)
        raise unknown or VramctlError(f"{shown}: {_one_line(exc)}") from exc
    except OSError as exc:
        text = str(exc)
        if "couldn't connect" in text or "offline" in text.lower():
            why = (
                "offline mode (HF_HUB_OFFLINE) reads only the local cache, which has no copy "
                "of its config"
                if _offline()
                else "no network to reach the Hugging Face Hub, and no copy of its config in "
                "the local cache"
            )
            raise VramctlError(
                f"{shown}: {why}; download it once where there is a network, or give a local "
                "folder or config.json"
            ) from exc
        if "not a valid model identifier" in text or "Repository Not Found" in text:
            raise VramctlError(
                f"{shown}: no such model on the Hugging Face Hub (and no such file or folder "
                "here); check the id, or log in for a private or gated model"
            ) from exc
        raise VramctlError(f"{shown}: {_one_line(exc)}") from exc


def _unknown_model_type(
    tf: Any, exc: BaseException, shown: str, model_type: str | None = None
) -> VramctlError | None:
    """One line for a config whose ``model_type`` this transformers does not know (its own
    message runs to a paragraph, or lists every model type), or None for another error."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = str(exc)
    if model_type is None:
        found = re.search(r"model type `([^`]+)`", text) or re.search(
            r"Unrecognized model identifier: ([^\s.]+)", text
        )
        model_type = found.group(1) if found else None
    if model_type is None or model_type in CONFIG_MAPPING:
        return None
    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return VramctlError(
        f"{shown}: transformers {tf.__version__} does not know model type {model_type!r}"
        f"{hint}; if the model is newer than this transformers, upgrade it (pip install "
        "--upgrade transformers); if it ships its own code (an auto_map in its "
        "config.json), pass --trust-remote-code (trust_remote_code=True)"
    )


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


def _seq_len_limit(config: Any, *, tokens: bool, decoder: bool) -> tuple[int, str] | None:
    """The most tokens ``seq_len`` may ask for and where that comes from: the text
    encoder's positions when the inputs are tokens, the decoder's when ``seq_len`` also
    sets the decoder's tokens (the smaller, where both)."""
    limits = []
    if tokens:
        limits.append(_position_limit(config.get_text_config(), decoder=False))
    if decoder:
        limits.append(_position_limit(config.get_text_config(decoder=True), decoder=True))
    found = [lim for lim in limits if lim is not None]
    return min(found) if found else None


def _position_limit(config: Any, *, decoder: bool) -> tuple[int, str] | None:
    """The positions a text config takes, with its RoPE scaling (transformers' rules:
    ``original_max_position_embeddings`` times ``factor`` for llama3, YaRN and the like,
    ``max_position_embeddings`` times ``factor`` for linear and dynamic scaling, and never
    less than ``max_position_embeddings``)."""
    names: tuple[str, ...] = ("max_target_positions",) if decoder else ()
    names += ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            n = (getattr(type(config), "attribute_map", None) or {}).get(n, n)  # GPT-2's
            scaled = _rope_limit(config, v)
            if scaled > v:
                return scaled, f"{n}={v} with its rope scaling"
            return v, n
    return None


def _rope_limit(config: Any, positions: int) -> int:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return positions
    # One dict, or one per layer type (Gemma 3: sliding and full attention).
    nested = [p for p in params.values() if isinstance(p, dict)]
    limit = positions
    for p in nested or [params]:
        kind = str(p.get("rope_type", p.get("type", "default")))
        factor = p.get("factor")
        if kind == "default" or not isinstance(factor, int | float) or factor <= 1:
            continue
        original = p.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        if isinstance(original, int) and original > 0:
            limit = max(limit, int(original * factor))
        elif kind in ("linear", "dynamic"):
            limit = max(limit, int(positions * factor))
    return limit


def check_positions(entry: Any, model: nn.Module | None, seq_len: int | None) -> str | None:
    """Hold a ``seq_len`` that was asked for to what the model (a built-in or config
    model, ``entry``) takes.

    Beyond a learned position table (GPT-2's 1,024, BERT's 512, Whisper's 448 decoder
    tokens) the step would fail to run: a :class:`VramctlError`. Beyond the length that
    computed positions (RoPE with its scaling, ALiBi, relative) were trained for the step
    runs: the note returned says so. None where ``seq_len`` is within the limit.
    """
    limit = getattr(entry, "max_positions", None)
    if seq_len is None or not limit or seq_len <= limit:
        return None
    name = getattr(entry, "name", "the model")
    key = getattr(entry, "positions_from", "")
    where = f", the config's {key}" if key else ""
    table = _learned_table(model, limit) if model is not None else None
    if table is not None:
        raise VramctlError(
            f"seq_len={seq_len} is more than the {limit} positions {name} takes (its learned "
            f"position table {table}{where}), so the step would fail to run; pass "
            f"seq_len={limit} or less (--seq-len)"
        )
    return (
        f"seq_len={seq_len} is beyond the {limit} positions {name} was trained for{where}: "
        "the step runs (its positions are computed, not looked up), but the model was not "
        "trained that long"
    )


def _learned_table(model: nn.Module, limit: int) -> str | None:
    """The name of the model's learned position table that bounds ``limit``, if it has
    one (an embedding of ``limit`` rows, or up to 2 more: OPT and BART offset theirs)."""
    try:
        words = model.get_input_embeddings()  # type: ignore[operator]
    except Exception:
        words = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Embedding) or mod is words:
            continue
        leaf = name.rsplit(".", 1)[-1].lower()
        if ("pos" in leaf or leaf == "wpe") and limit <= mod.num_embeddings <= limit + 2:
            return str(name)
    return None


# -- config keys the config class does not know ---------------------------------------------

#: Keys a config may hold that its class need not list: what transformers writes into every
#: config (and wrote in earlier versions: 4.x's generic and generation attributes), and keys
#: that well-known checkpoints still carry from earlier versions of their class.
_ANY_CONFIG_KEYS = frozenset(
    {
        "_name_or_path", "name_or_path", "architectures", "auto_map", "model_type",
        "transformers_version", "quantization_config", "per_layer_config", "torch_dtype",
        "dtype", "use_cache", "num_labels", "id2label", "label2id", "problem_type",
        "return_dict", "output_hidden_states", "output_attentions", "torchscript",
        "use_bfloat16", "tf_legacy_loss", "pruned_heads", "tie_word_embeddings",
        "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
        "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder",
        "finetuning_task", "tokenizer_class", "prefix", "bos_token_id", "pad_token_id",
        "eos_token_id", "sep_token_id", "decoder_start_token_id", "task_specific_params",
        "gradient_checkpointing", "max_length", "min_length", "do_sample", "early_stopping",
        "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
        "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "forced_bos_token_id",
        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
        "suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids",
        # left in famous checkpoints by earlier versions of their class (GPT-2, T5, BERT,
        # RoBERTa, BART, LLaVA)
        "n_ctx", "n_positions", "output_past", "position_embedding_type", "ignore_index",
        "vocab_size", "classif_dropout", "add_bias_logits", "add_final_layer_norm",
        "normalize_before", "normalize_embedding", "static_position_embeddings",
        "extra_pos_embeddings", "force_bos_token_to_be_generated",
    }
)  # fmt: skip


def unknown_config_keys(config: Any) -> list[tuple[str, str | None]]:
    """The keys of a ``PretrainedConfig`` that its class does not know, each with the known
    key it is most likely a typo of (None where there is none).

    A key is known when a default-constructed config of the class has it (or a field, or
    an ``attribute_map`` alias of one), or any config may hold it (``architectures``,
    ``torch_dtype`` ...). transformers keeps an unknown key on the config and no model
    reads it: ``vocab_sise`` leaves ``vocab_size`` at its default. A sub-config's keys
    (``text_config.vocab_size``) are held to its class and to what its parent's defaults
    set on it. A likely typo whose value equals its known key's is left out: it changes
    nothing.

    >>> from transformers import LlamaConfig
    >>> unknown_config_keys(LlamaConfig(hidden_size=64, vocab_sise=1000))
    [('vocab_sise', 'vocab_size')]
    """
    return _unknown_keys(config, None, "")


def _unknown_keys(config: Any, default: Any, prefix: str) -> list[tuple[str, str | None]]:
    cls = type(config)
    if default is None or type(default) is not cls:
        try:
            default = cls()
        except Exception:  # a class that needs arguments: nothing to hold its keys to
            return []
    known = set(_config_dict(default)) | set(getattr(cls, "attribute_map", None) or {})
    if dataclasses.is_dataclass(cls):
        known |= {f.name for f in dataclasses.fields(cls)}
    values = _config_dict(config)
    out: list[tuple[str, str | None]] = []
    for key, value in values.items():
        if key in known or key in _ANY_CONFIG_KEYS or key.startswith("_"):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        match = close[0] if close else None
        if match is not None and values.get(match, getattr(config, match, None)) == value:
            continue  # an old name for the same setting, with the same value
        out.append((prefix + key, match))
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and not isinstance(sub, dict) and hasattr(sub, "to_dict"):
            out += _unknown_keys(sub, getattr(default, key, None), f"{prefix}{key}.")
    return out


def _config_dict(config: Any) -> dict[str, Any]:
    try:
        return dict(config.to_dict())
    except Exception:
        return {}


def _unknown_keys_note(config: Any) -> str | None:
    unknown = unknown_config_keys(config)
    if not unknown:
        return None
    keys = ", ".join(k + (f" (did you mean {m}?)" if m else "") for k, m in unknown)
    return (
        f"{type(config).__name__} does not know the config key"
        f"{'s' if len(unknown) > 1 else ''} {keys}: transformers "
        f"{_transformers().__version__} ignores "
        f"{'them' if len(unknown) > 1 else 'it'} (the model is built as if "
        f"{'they were' if len(unknown) > 1 else 'it was'} not there); fix the spelling if "
        f"{'they were' if len(unknown) > 1 else 'it was'} meant"
    )


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
