"""What a run keeps of a model's output, and how each batch of it is recorded.

A forward's result is read as a time-major tensor (``[batch, time, ...]``; a model
output's ``last_hidden_state`` or ``logits``), cut to each item's valid frames; the
frames of a long recording's chunks are stitched at the model's frame rate; each whole
recording goes through the postprocess (``"summary"``, ``"embedding"`` or a callable)
and every batch's values and failures are committed to the progress store at once.

>>> import torch
>>> from vramctl.batching import Item
>>> summarize(torch.ones(50, 4), Item("a", 1.0))
{'frames': 50, 'dim': 4, 'mean': 1.0, 'std': 0.0}
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from vramctl.batching._adaptive import BatchingError
from vramctl.batching._chunk import Stitcher
from vramctl.batching._manifest import Item
from vramctl.batching._progress import ProgressStore

__all__ = [
    "Collector",
    "Done",
    "Forward",
    "Postprocess",
    "Transcribe",
    "default_forward",
    "embed",
    "frames_of",
    "frames_per_second",
    "postprocess_of",
    "summarize",
    "time_major",
    "valid_frames",
]

log = logging.getLogger("vramctl.batching")

Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]
#: Length warnings a Collector keeps the text of (all are counted).
_KEPT_WARNINGS = 20
Postprocess = Callable[[torch.Tensor, Item], Any]


def default_forward(model: nn.Module, waveforms: torch.Tensor, lengths: torch.Tensor) -> Any:
    """``model(waveforms)``; of a Hugging Face output, ``last_hidden_state`` or ``logits``."""
    return model(waveforms)


def time_major(out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(time-major output [B, T', ...], frames per item or None) from a forward's result."""
    frames = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
        out, frames = out
    if not isinstance(out, torch.Tensor):
        for name in ("last_hidden_state", "logits"):
            value = out.get(name) if isinstance(out, Mapping) else getattr(out, name, None)
            if isinstance(value, torch.Tensor):
                out = value
                break
        else:
            if hasattr(out, "to_tuple"):  # a transformers ModelOutput
                out = out.to_tuple()
            elif isinstance(out, Mapping):
                out = tuple(out.values())
            if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
                out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        raise BatchingError(
            "the forward must return a tensor [batch, time, ...] (or a model output with"
            f" last_hidden_state, or (output, frames)); got {type(out).__name__}"
            + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else "")
        )
    return out, frames


def valid_frames(
    model: nn.Module, lengths: torch.Tensor, padded: int, out_len: int
) -> torch.Tensor:
    """Valid output frames per item: the model's own rule when it has one, else in proportion."""
    rule = getattr(model, "_get_feat_extract_output_lengths", None)
    if callable(rule):
        try:
            return torch.as_tensor(rule(lengths)).to(torch.int64).clamp(0, out_len)
        except Exception:
            log.debug("the model's _get_feat_extract_output_lengths failed", exc_info=True)
    return ((lengths * out_len + padded - 1) // max(padded, 1)).clamp(0, out_len)


def frames_per_second(
    model: nn.Module,
    padded: int,
    out_len: int,
    sample_rate: int,
    probe: Callable[[int], int] | None = None,
    fallback: float | None = None,
) -> float:
    """Output frames per second of audio.

    The slope of the model's own rule (``_get_feat_extract_output_lengths``); else
    the slope measured with ``probe`` (the output length for an input of that many
    samples) between 2 s and 10 s of input; else ``fallback`` or the batch's ratio. The ratio is a
    little off for a strided convolution, whose ``(padded - kernel) // stride + 1``
    frames fall short of ``padded / stride``: a long recording's later chunks would
    be placed further and further off. 8 s apart, the two probes differ by exactly
    ``8 s / hop`` frames for any hop that divides 8 s of samples.
    """
    rule = getattr(model, "_get_feat_extract_output_lengths", None)
    if callable(rule):
        try:
            a, b = (int(rule(torch.tensor([n * sample_rate]))[0]) for n in (10, 110))
            if b > a:
                return (b - a) / 100.0
        except Exception:
            log.debug("the model's _get_feat_extract_output_lengths failed", exc_info=True)
    if probe is not None:
        try:
            a, b = probe(2 * sample_rate), probe(10 * sample_rate)
            if b > a:
                return (b - a) / 8.0
        except Exception:
            log.debug("measuring the model's frame rate failed", exc_info=True)
    if fallback is not None:
        return fallback
    return out_len * sample_rate / max(padded, 1)


def summarize(output: torch.Tensor, item: Item) -> dict[str, Any]:
    """The default postprocess: the output's frames, feature size, mean and spread."""
    x = output.detach().float()
    return {
        "frames": int(x.shape[0]),
        "dim": int(x[0].numel()) if x.shape[0] else 0,
        "mean": round(float(x.mean()), 6) if x.numel() else 0.0,
        "std": round(float(x.std()), 6) if x.numel() > 1 else 0.0,
    }


def embed(output: torch.Tensor, item: Item) -> dict[str, Any]:
    """Postprocess ``"embedding"``: the output averaged over time, as a list."""
    x = output.detach().float().flatten(1)
    vec = x.mean(0) if x.shape[0] else torch.zeros(x.shape[1])
    return {"frames": int(x.shape[0]), "embedding": [round(v, 6) for v in vec.tolist()]}


def frames_of(output: torch.Tensor, item: Item) -> dict[str, Any]:
    """Postprocess ``"frames"``: every output frame, as lists (rounded to 6 digits)."""
    x = output.detach().float().flatten(1)
    return {"frames": int(x.shape[0]), "values": [[round(v, 6) for v in row] for row in x.tolist()]}


class Transcribe:
    """Postprocess ``"text"``: a CTC model's frames decoded to text by ``decoder``."""

    __name__ = "text"

    def __init__(self, decoder: Callable[[torch.Tensor], str]) -> None:
        self.decoder = decoder

    def __call__(self, output: torch.Tensor, item: Item) -> dict[str, Any]:
        return {"text": self.decoder(output), "frames": int(output.shape[0])}


_POSTPROCESS: dict[str, Postprocess] = {
    "summary": summarize,
    "embedding": embed,
    "frames": frames_of,
}


def postprocess_of(
    value: Postprocess | str, decoder: Callable[[torch.Tensor], str] | None = None
) -> Postprocess:
    """The postprocess named (``"text"``, ``"frames"``, ``"embedding"``, ``"summary"``) or
    given, checked. ``"text"`` needs the model's ``decoder`` (a CTC checkpoint's)."""
    if isinstance(value, str):
        if value == "text":
            if decoder is None:
                raise BatchingError(
                    "output kind 'text' needs a CTC checkpoint with a tokenizer (a folder saved"
                    " with save_pretrained, or a Hub id); this model gives frames: choose"
                    " frames, embedding or summary"
                )
            return Transcribe(decoder)
        if value not in _POSTPROCESS:
            raise BatchingError(
                "postprocess (the output kind) must be 'text', "
                f"{', '.join(map(repr, _POSTPROCESS))} or a callable, got {value!r}"
            )
        return _POSTPROCESS[value]
    if not callable(value):
        raise BatchingError(f"postprocess must be a callable, got {value!r}")
    return value


@dataclass
class Done:
    """One batch's outcome: per-item outputs (host tensors) and per-item failures."""

    outputs: list[tuple[Item, torch.Tensor]]
    failures: list[tuple[Item, str]]
    padded_seconds: float
    seconds: float
    frame_rate: float | None = None
    #: Items whose audio is not as long as the manifest says, with why (loaded as read).
    warnings: list[tuple[Item, str]] = field(default_factory=list)


class Collector:
    """Stitches chunk outputs, postprocesses whole recordings and commits each batch."""

    def __init__(
        self,
        store: ProgressStore,
        post: Postprocess,
        frame_rate: float | None,
        sample_rate: int,
        rejected: deque[tuple[int, str, str]] | None = None,
    ) -> None:
        self.store = store
        self.post = post
        #: Failures found before a batch (see Remaining): recorded with the next commit.
        self.rejected: deque[tuple[int, str, str]] = rejected if rejected is not None else deque()
        self.sample_rate = sample_rate
        self.stitcher: Stitcher | None = Stitcher(frame_rate) if frame_rate else None
        self._given_rate = bool(frame_rate)
        #: Chunked recordings that failed, as (id, manifest index): ids may repeat.
        self.failed_parents: set[tuple[str, int]] = set()
        self.done = 0
        self.failed = 0
        #: Recordings whose audio differs from the manifest's duration, and the first reasons.
        self.length_mismatches = 0
        self.length_warnings: list[str] = []
        self.seconds = 0.0
        self.batches = 0
        self._padded = 0.0
        self._real = 0.0

    @property
    def padding(self) -> float:
        return 1.0 - self._real / self._padded if self._padded > 0 else 0.0

    def pending(self) -> int:
        return self.stitcher.pending() if self.stitcher is not None else 0

    def _stitcher_for(self, item: Item, rate: float | None) -> Stitcher:
        if self.stitcher is None:
            self.stitcher = Stitcher(rate or 1.0)
        elif (
            item.parent is not None
            and rate
            and not self._given_rate
            and rate != self.stitcher.frame_rate
            and not self.stitcher.pending()
        ):
            # A batch with chunks carries the measured rate; one without, its own ratio.
            self.stitcher.frame_rate = rate
        return self.stitcher

    def _drain(self) -> list[tuple[int, str, str]]:
        out = []
        while self.rejected:
            out.append(self.rejected.popleft())
        return out

    def flush(self) -> None:
        """Record the failures found before any batch that no batch has carried yet."""
        failures = self._drain()
        if failures:
            self.store.commit([], failures)
            self.failed += len(failures)

    def take(self, batch: Done) -> None:
        results: list[tuple[int, str, Any, float]] = []
        failures: list[tuple[int, str, str]] = self._drain()
        for item, reason in batch.failures:
            name = item.parent or item.id
            if item.parent is not None:
                if (name, item.index) in self.failed_parents:
                    continue
                self.failed_parents.add((name, item.index))
                if self.stitcher is not None:
                    self.stitcher.discard(name, item.index)
            failures.append((item.index, name, reason))
        for item, output in batch.outputs:
            if item.parent is not None and (item.parent, item.index) in self.failed_parents:
                continue
            for rec_id, whole in self._stitcher_for(item, batch.frame_rate).add(item, output):
                rec = _recording(item, rec_id)
                try:
                    value = self.post(whole, rec)
                except Exception as exc:
                    failures.append((rec.index, rec.id, f"postprocess failed: {exc!r}"))
                    continue
                results.append((rec.index, rec.id, value, rec.duration))
        self.store.commit(results, failures)
        self.length_mismatches += len(batch.warnings)
        for _, note in batch.warnings[: max(_KEPT_WARNINGS - len(self.length_warnings), 0)]:
            self.length_warnings.append(note)
        self.done += len(results)
        self.failed += len(failures)
        self.seconds += sum(r[3] for r in results)
        self.batches += 1
        self._padded += batch.padded_seconds
        self._real += batch.seconds


def _recording(item: Item, rec_id: str) -> Item:
    """The whole recording a (possibly chunk) item belongs to."""
    if item.parent is None:
        return item
    extra = dict(item.extra or {})
    duration = float(extra.pop("parent_duration", item.duration))
    offset = float(extra.pop("parent_offset", 0.0))
    extra.pop("chunks", None)
    return replace(
        item, id=rec_id, duration=duration, offset=offset, parent=None, chunk=0, extra=extra or None
    )
