"""Tiny speech checkpoints saved as ``save_pretrained`` writes them, and real WAV files.

The models are random-weight wav2vec2 and Parakeet CTC models a few layers deep, with a
letter tokenizer and the architectures' own feature extractors, saved to a folder with
their processors: what a user's fine-tuned checkpoint holds, without the network.
"""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import torch

LETTERS = list("abcdefghijklmnopqrstuvwxyz'")


def save_wav2vec2(folder: Path, *, seed: int = 0) -> Path:
    from transformers import (
        Wav2Vec2Config,
        Wav2Vec2CTCTokenizer,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2ForCTC,
        Wav2Vec2Processor,
    )

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4}
    vocab.update({c: i + 5 for i, c in enumerate(LETTERS)})
    vocab_file = folder.parent / f"{folder.name}-vocab.json"
    vocab_file.write_text(json.dumps(vocab))
    tokenizer = Wav2Vec2CTCTokenizer(str(vocab_file), word_delimiter_token="|")
    extractor = Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=16000,
        padding_value=0.0,
        do_normalize=True,
        return_attention_mask=True,
    )
    Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(folder)
    config = Wav2Vec2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16,) * 7,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        pad_token_id=0,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
    )
    torch.manual_seed(seed)
    Wav2Vec2ForCTC(config).save_pretrained(folder)
    return folder


def save_parakeet(folder: Path, *, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import (
        ParakeetCTCConfig,
        ParakeetFeatureExtractor,
        ParakeetForCTC,
        ParakeetProcessor,
        ParakeetTokenizer,
    )

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(["<unk>", "▁", *LETTERS])}
    backend = Tokenizer(
        models.WordPiece(vocab=vocab, unk_token="<unk>", continuing_subword_prefix="")
    )
    tokenizer = ParakeetTokenizer(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")
    extractor = ParakeetFeatureExtractor(feature_size=16)
    ParakeetProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(folder)
    config = ParakeetCTCConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        encoder_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "num_mel_bins": 16,
            "subsampling_conv_channels": 8,
        },
    )
    torch.manual_seed(seed)
    ParakeetForCTC(config).save_pretrained(folder)
    return folder


def write_wavs(folder: Path, seconds: list[float], *, rate: int = 16000) -> list[Path]:
    """16-bit PCM WAV files of noise with a rising tone, one per length."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i, s in enumerate(seconds):
        n = int(s * rate)
        t = np.arange(n) / rate
        x = 0.3 * np.sin(2 * np.pi * (200 + 40 * i) * t) + 0.1 * rng.standard_normal(n)
        path = folder / f"clip{i:02d}.wav"
        with wave.open(str(path), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(rate)
            f.writeframes((np.clip(x, -1, 1) * 32000).astype(np.int16).tobytes())
        paths.append(path)
    return paths


def reference_text(folder: Path, wav: Path) -> str:
    """The checkpoint's transcript of one file, by transformers alone (no vramctl)."""
    from transformers import AutoModelForCTC, AutoProcessor

    with wave.open(str(wav), "rb") as f:
        audio = np.frombuffer(f.readframes(f.getnframes()), dtype=np.int16) / 32768.0
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForCTC.from_pretrained(folder).eval()
    inputs = processor.feature_extractor(
        [audio.astype(np.float32)], sampling_rate=16000, return_tensors="pt"
    )
    with torch.no_grad():
        if type(model).__name__.startswith("Parakeet"):
            ids = model.generate(**inputs)[0]  # its own greedy decoding, padding masked out
        else:
            ids = model(**inputs).logits.argmax(-1)[0]
    return str(processor.tokenizer.decode(ids.tolist(), skip_special_tokens=True)).strip()
