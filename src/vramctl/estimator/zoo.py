"""Built-in models and their inputs: real architectures with random weights, no download.

Each name builds a real PyTorch model from a Hugging Face ``transformers``
configuration (the ``zoo`` extra installs ``transformers``) or from
``torch.nn`` alone (``lstm``), and pairs it with an input builder:

- ``tokens``: token ids of a given sequence length (and labels for training);
- ``audio``: 16 kHz waveforms of a given number of seconds (and CTC labels);
- ``mel``: Whisper's 80-bin log-mel features of 30 s (and decoder labels);
- ``images``: 224x224 RGB images (and class labels).

Float inputs are made with ``torch.empty``: their values never matter to an
estimate and untouched pages cost no host memory. Token ids, labels and masks
are real values, so data-dependent code that reads them sees real data.

>>> from vramctl.estimator import zoo
>>> zoo.names()[:3]
['bert-base', 'convnext-tiny', 'gpt2']
>>> sorted(zoo.make_batch("gpt2", 2, seq_len=16))
['input_ids', 'labels']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramctl._errors import VramctlError
from vramctl._optional import require

__all__ = ["ZooModel", "build", "get", "make_batch", "names"]

SAMPLE_RATE = 16_000
#: Decoder tokens of a Whisper batch when no ``seq_len`` is given (its maximum).
WHISPER_DECODER_TOKENS = 448


@dataclass(frozen=True)
class ZooModel:
    """One built-in model: how to build it and what it eats."""

    name: str
    description: str
    #: ``tokens``, ``audio``, ``mel``, ``images`` or ``sequence``.
    inputs: str
    default_seq_len: int | None = None
    default_seconds: float | None = None
    vocab_size: int = 0
    #: Longest input the architecture accepts (position table), if it has a limit.
    max_length: float | None = None
    #: Side of the square images of an ``images`` model's batches (or ``(height, width)``).
    image_size: int | tuple[int, int] = 224

    def build(self) -> nn.Module:
        return _BUILDERS[self.name]()

    def make_batch(
        self,
        batch_size: int,
        *,
        seq_len: int | None = None,
        seconds: float | None = None,
        labels: bool = True,
    ) -> dict[str, torch.Tensor]:
        return _make_batch(self, batch_size, seq_len=seq_len, seconds=seconds, labels=labels)

    def lengths(
        self, seq_len: int | None = None, seconds: float | None = None
    ) -> tuple[int | None, float | None]:
        """The ``(seq_len, seconds)`` its batches are made with, defaults filled in.

        A length the model's inputs do not take is None: images have neither,
        Whisper's mel input is always 30 s (``seq_len`` is its decoder's tokens).

        >>> get("gpt2").lengths()
        (512, None)
        >>> get("wav2vec2-base").lengths(seq_len=64)
        (None, 10.0)
        """
        if self.inputs in ("tokens", "sequence"):
            return seq_len or self.default_seq_len or 512, None
        if self.inputs == "audio":
            return None, seconds if seconds is not None else (self.default_seconds or 10.0)
        if self.inputs == "mel":
            return seq_len or WHISPER_DECODER_TOKENS, None
        return None, None

    @property
    def max_positions(self) -> int | None:
        """The most tokens ``seq_len`` may ask for: the position table, or the length RoPE
        was trained for (Whisper's ``seq_len`` is its decoder's, at most 448).

        >>> get("gpt2").max_positions, get("whisper-base").max_positions
        (1024, 448)
        """
        if self.inputs == "mel":
            return WHISPER_DECODER_TOKENS
        if self.inputs in ("tokens", "sequence") and self.max_length:
            return int(self.max_length)
        return None

    @property
    def length_arg(self) -> str | None:
        """The keyword that sets this model's input length (``seq_len``, ``seconds`` or None)."""
        if self.inputs in ("tokens", "sequence"):
            return "seq_len"
        if self.inputs == "audio":
            return "seconds"
        return None


def _transformers() -> Any:
    return require("transformers", extra="zoo", what="built-in transformer models")


def _hf(model_cls: str, config_cls: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        tf = _transformers()
        cfg = getattr(tf, config_cls)(**config)
        model: nn.Module = getattr(tf, model_cls)(cfg)
        return model

    return build


class LstmLanguageModel(nn.Module):
    """A plain two-layer LSTM language model: embedding, ``nn.LSTM``, linear head."""

    def __init__(self, vocab_size: int = 10_000, hidden: int = 1024, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        hidden, _ = self.lstm(self.embed(input_ids))
        logits = self.head(hidden)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


_LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128_256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131_072,
}
_LLAMA_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11_008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32_000,
    "max_position_embeddings": 4096,
}
_WHISPER_BASE = {
    "d_model": 512,
    "encoder_layers": 6,
    "decoder_layers": 6,
    "encoder_attention_heads": 8,
    "decoder_attention_heads": 8,
    "encoder_ffn_dim": 2048,
    "decoder_ffn_dim": 2048,
}

_MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in [
        ZooModel(
            "gpt2",
            "GPT-2 small, 124M parameters",
            "tokens",
            512,
            vocab_size=50_257,
            max_length=1024,
        ),
        ZooModel(
            "bert-base",
            "BERT base, masked LM, 110M",
            "tokens",
            512,
            vocab_size=30_522,
            max_length=512,
        ),
        ZooModel("t5-small", "T5 small, encoder-decoder, 60M", "tokens", 512, vocab_size=32_128),
        ZooModel(
            "llama-1b",
            "Llama-style 1.2B (Llama 3.2 1B shape)",
            "tokens",
            2048,
            vocab_size=128_256,
            max_length=131_072,
        ),
        ZooModel(
            "llama-7b",
            "Llama-style 6.7B (Llama 2 7B shape)",
            "tokens",
            4096,
            vocab_size=32_000,
            max_length=4096,
        ),
        ZooModel("whisper-base", "Whisper base, 74M, 30 s log-mel input", "mel", vocab_size=51_865),
        ZooModel(
            "wav2vec2-base",
            "wav2vec 2.0 base with a CTC head, 95M",
            "audio",
            default_seconds=10.0,
            vocab_size=32,
        ),
        ZooModel(
            "hubert-base",
            "HuBERT base with a CTC head, 95M",
            "audio",
            default_seconds=10.0,
            vocab_size=32,
        ),
        ZooModel("vit-base", "ViT-B/16 image classifier, 86M", "images"),
        ZooModel("resnet-50", "ResNet-50 image classifier, 26M", "images"),
        ZooModel("convnext-tiny", "ConvNeXt-T image classifier, 29M", "images"),
        ZooModel(
            "lstm",
            "2-layer LSTM language model (torch.nn only), 30M",
            "sequence",
            256,
            vocab_size=10_000,
        ),
    ]
}

_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _hf("GPT2LMHeadModel", "GPT2Config"),
    "bert-base": _hf("BertForMaskedLM", "BertConfig"),
    "t5-small": _hf(
        "T5ForConditionalGeneration", "T5Config", decoder_start_token_id=0, pad_token_id=0
    ),
    "llama-1b": _hf("LlamaForCausalLM", "LlamaConfig", **_LLAMA_1B),
    "llama-7b": _hf("LlamaForCausalLM", "LlamaConfig", **_LLAMA_7B),
    "whisper-base": _hf("WhisperForConditionalGeneration", "WhisperConfig", **_WHISPER_BASE),
    "wav2vec2-base": _hf("Wav2Vec2ForCTC", "Wav2Vec2Config"),
    "hubert-base": _hf("HubertForCTC", "HubertConfig"),
    "vit-base": _hf("ViTForImageClassification", "ViTConfig", num_labels=1000),
    "resnet-50": _hf("ResNetForImageClassification", "ResNetConfig", num_labels=1000),
    "convnext-tiny": _hf("ConvNextForImageClassification", "ConvNextConfig", num_labels=1000),
    "lstm": LstmLanguageModel,
}


def names() -> list[str]:
    """The built-in model names, sorted."""
    return sorted(_MODELS)


def get(name: str) -> ZooModel:
    """The built-in model called ``name``; an unknown name lists the known ones."""
    try:
        return _MODELS[name.lower()]
    except KeyError:
        raise VramctlError(
            f"unknown model {name!r}; built-in models: {', '.join(names())}, "
            "or give 'package.module:factory'"
        ) from None


def build(name: str) -> nn.Module:
    """Build the built-in model ``name`` with random weights (no download)."""
    return get(name).build()


def make_batch(
    name: str,
    batch_size: int,
    *,
    seq_len: int | None = None,
    seconds: float | None = None,
    labels: bool = True,
) -> dict[str, torch.Tensor]:
    """The keyword inputs of one batch for the built-in model ``name``.

    ``seq_len`` sets the token count of text models (default: the model's
    usual context), ``seconds`` the audio length of speech models. With
    ``labels`` the batch carries what the model's loss needs.
    """
    return _make_batch(get(name), batch_size, seq_len=seq_len, seconds=seconds, labels=labels)


def _make_batch(
    m: ZooModel,
    batch_size: int,
    *,
    seq_len: int | None,
    seconds: float | None,
    labels: bool,
) -> dict[str, torch.Tensor]:
    name = m.name
    if batch_size < 1:
        raise VramctlError(f"batch size must be at least 1, got {batch_size}")
    n, s = m.lengths(seq_len, seconds)
    if m.inputs in ("tokens", "sequence"):
        assert n is not None
        if n < 1:
            raise VramctlError(f"sequence length must be at least 1, got {n}")
        ids = torch.randint(0, m.vocab_size, (batch_size, n))
        batch = {"input_ids": ids}
        if labels:
            batch["labels"] = torch.randint(0, m.vocab_size, (batch_size, n))
        elif name == "t5-small":
            batch["decoder_input_ids"] = torch.randint(0, m.vocab_size, (batch_size, n))
        return batch
    if m.inputs == "audio":
        assert s is not None
        samples = int(s * SAMPLE_RATE)
        if samples < 400:
            raise VramctlError(f"{name} needs at least 0.025 s of audio, got {s} s")
        batch = {"input_values": torch.empty(batch_size, samples)}
        if labels:
            # About 12 characters a second, as in read speech.
            n_labels = max(1, int(s * 12))
            batch["labels"] = torch.randint(1, m.vocab_size, (batch_size, n_labels))
        return batch
    if m.inputs == "mel":
        batch = {"input_features": torch.empty(batch_size, 80, 3000)}
        tokens = torch.randint(0, m.vocab_size, (batch_size, n or WHISPER_DECODER_TOKENS))
        batch["labels" if labels else "decoder_input_ids"] = tokens
        return batch
    size = m.image_size
    h, w = (size, size) if isinstance(size, int) else size
    batch = {"pixel_values": torch.empty(batch_size, 3, h, w)}
    if labels:
        batch["labels"] = torch.randint(0, 1000, (batch_size,))
    return batch
