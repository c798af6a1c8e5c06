"""Waveforms for :class:`~vramctl.batching._manifest.Item` s, and padded batches of them.

:func:`load_audio` reads an item's audio (its in-memory ``data``, or a
``.wav``, ``.npy`` or, with ``soundfile`` installed, any other file at its
``path``), only the part a chunk covers. :func:`synthesize` makes a
deterministic stand-in waveform for demos and benchmarks without audio; a
chunk's synthetic waveform is the matching slice of its recording's, which it
finds from the ``extra["parent_duration"]`` and ``extra["parent_offset"]``
that :func:`~vramctl.batching._chunk.chunk_items` records in every chunk.
:class:`AudioBatches` turns a sequence of item batches into zero-padded
waveform batches for a ``DataLoader``, in order, with its workers; an item
that fails to load (a truncated file included) is reported in the batch's
``"errors"``, never dropped silently, and one whose audio is not as long as its
``duration`` says is loaded and reported in the batch's ``"warnings"``.

>>> import torch
>>> from vramctl.batching._manifest import Item
>>> item = Item("a", 0.5, data=torch.arange(16000.0))
>>> chunk = Item("a#1", 0.25, offset=0.25, data=item.data, parent="a", chunk=1)
>>> load_audio(chunk, 16000)[:3].tolist()
[4000.0, 4001.0, 4002.0]
>>> wave = synthesize(Item("x", 2.0), sample_rate=8000)
>>> wave.shape, wave.dtype, torch.equal(wave, synthesize(Item("x", 2.0), sample_rate=8000))
(torch.Size([16000]), torch.float32, True)
>>> batch = next(iter(AudioBatches([[item, Item("b", 1.0, path="missing.wav")]])))
>>> batch["waveforms"].shape, batch["lengths"].tolist(), [i.id for i, _ in batch["errors"]]
(torch.Size([1, 16000]), [16000], ['b'])
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
import wave
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from vramctl._errors import VramctlError
from vramctl._optional import available
from vramctl.batching._manifest import Item

__all__ = [
    "LENGTH_TOLERANCE",
    "LENGTH_TOLERANCE_S",
    "AudioBatches",
    "AudioError",
    "load_audio",
    "synthesize",
]

log = logging.getLogger("vramctl.batching")

#: An item's audio and its declared duration differ when they are more than this many
#: seconds and more than this fraction of the duration apart (a manifest's rounding, an
#: encoder's padding are less; a wrong duration, a file cut short or replaced are more).
LENGTH_TOLERANCE_S = 0.1
LENGTH_TOLERANCE = 0.01
#: Length differences an :class:`AudioBatches` logs one by one (all are in its batches).
_LOGGED_LENGTHS = 5

#: Noise of :func:`synthesize` is drawn in blocks of this many samples (random access).
_NOISE_BLOCK = 1 << 14
_WAV_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class AudioError(VramctlError, OSError):
    """An item's audio that cannot be read (missing file, unknown format, bad data)."""


def load_audio(item: Item, sample_rate: int = 16000) -> torch.Tensor:
    """The item's waveform: a 1-D float32 tensor at ``sample_rate``.

    From ``item.data`` when set (a 1-D tensor or array, taken to be at
    ``sample_rate``), else from the file at ``item.path``: ``.wav`` with the
    standard library (PCM, channels averaged, only the frames needed are
    read), ``.npy`` memory-mapped (1-D, at ``sample_rate``), anything else with
    ``soundfile`` when it is installed. A chunk (``parent`` set, or an
    ``offset`` above 0) gets samples ``[round(offset * sr), round((offset +
    duration) * sr))`` of its source; a whole item all of it. A file at another
    sample rate is resampled by linear interpolation, which is approximate (no
    anti-aliasing filter). Raises :class:`AudioError` naming the item and the
    path when the audio cannot be read, or when a file is truncated (it holds fewer
    frames than its header says).
    """
    return _read(item, sample_rate)[0]


def _read(item: Item, sample_rate: int) -> tuple[torch.Tensor, float | None]:
    """:func:`load_audio`'s waveform, and the seconds its whole source holds (None: unknown)."""
    _check_rate(sample_rate)
    if item.data is not None:
        return _from_data(item, sample_rate)
    if item.path is None:
        raise AudioError(f"item {item.id!r} has neither data nor a path")
    path = os.fspath(item.path)
    if not os.path.isfile(path):
        raise AudioError(f"item {item.id!r}: audio file {path!r} not found")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".npy":
            return _from_npy(item, path, sample_rate)
        if ext == ".wav":
            try:
                return _from_wav(item, path, sample_rate)
            except (wave.Error, EOFError, _UnsupportedWav) as exc:
                if not available("soundfile"):
                    raise AudioError(
                        f"item {item.id!r}: {path!r} is not a PCM wav the wave module reads "
                        f"({exc}); pip install soundfile to read it"
                    ) from exc
        if not available("soundfile"):
            raise AudioError(
                f"item {item.id!r}: cannot read {ext or 'extensionless'} file {path!r} "
                "without soundfile (pip install soundfile), or use .wav or .npy"
            )
        return _from_soundfile(item, path, sample_rate)
    except AudioError:
        raise
    except (OSError, ValueError, RuntimeError) as exc:
        raise AudioError(f"item {item.id!r}: cannot read {path!r}: {exc}") from exc


def synthesize(item: Item, sample_rate: int = 16000, seed: int = 0) -> torch.Tensor:
    """A deterministic synthetic waveform as long as the item (1-D float32 in [-1, 1]).

    Three sine tones and some noise, all drawn from ``(seed, recording id)``
    with a stable hash, so every process and run gets the same samples. A
    chunk of a recording (``parent`` set; needs ``extra["parent_duration"]``,
    and takes ``extra["parent_offset"]`` as 0 when absent) gets the slice of
    its recording's waveform it covers, up to float rounding, without making
    the rest of it. Same signature as :func:`load_audio` for ``AudioBatches``'
    ``loader``.

    >>> synthesize(Item("x", 0.001), sample_rate=8000).shape
    torch.Size([8])
    """
    _check_rate(sample_rate)
    if item.parent is None:
        root, total, start = item.id, float(item.duration), 0.0
    else:
        extra = item.extra or {}
        if "parent_duration" not in extra:
            raise AudioError(
                f"chunk {item.id!r} has no extra['parent_duration'] to synthesize its "
                f"recording {item.parent!r} from: make chunks with chunk_items"
            )
        root, total = item.parent, float(extra["parent_duration"])
        start = item.offset - float(extra.get("parent_offset", 0.0))
    if not (math.isfinite(total) and total >= 0):
        raise AudioError(f"item {item.id!r}: cannot synthesize a duration of {total!r} s")
    size = round(total * sample_rate)
    if item.parent is None:
        lo, hi = 0, size
    else:
        lo = min(max(round(start * sample_rate), 0), size)
        hi = min(max(round((start + item.duration) * sample_rate), lo), size)
    key = zlib.crc32(f"{seed}\x00{root}".encode())
    gen = torch.Generator().manual_seed(key)
    # Tones with whole-Hz frequencies: the phase at sample n is exact, ((n * f) mod sr) / sr.
    freqs = torch.randint(80, min(2000, max(81, sample_rate // 2)), (3,), generator=gen)
    amps = torch.rand(3, generator=gen, dtype=torch.float64) * 0.2 + 0.05
    phases = torch.rand(3, generator=gen, dtype=torch.float64) * 2 * math.pi
    n = torch.arange(lo, hi, dtype=torch.int64)
    out = torch.zeros(hi - lo, dtype=torch.float64)
    for f, a, p in zip(freqs.tolist(), amps.tolist(), phases.tolist(), strict=True):
        cycle = (n * f) % sample_rate
        out += a * torch.sin(cycle.to(torch.float64) * (2 * math.pi / sample_rate) + p)
    # Noise block b comes from its own generator: any slice draws only the blocks it covers.
    noise = torch.empty(hi - lo, dtype=torch.float64)
    for block in range(lo // _NOISE_BLOCK, (hi - 1) // _NOISE_BLOCK + 1 if hi > lo else 0):
        g = torch.Generator().manual_seed(key * 1_000_003 + block)
        values = torch.randn(_NOISE_BLOCK, generator=g, dtype=torch.float64)
        b0 = block * _NOISE_BLOCK
        s, e = max(lo, b0), min(hi, b0 + _NOISE_BLOCK)
        noise[s - lo : e - lo] = values[s - b0 : e - b0]
    out += 0.02 * noise
    return out.clamp_(-1.0, 1.0).to(torch.float32)


class AudioBatches(IterableDataset[dict[str, Any]]):
    """Zero-padded waveform batches, one per batch of items, for a ``DataLoader``.

    Each batch comes out as ``{"waveforms": FloatTensor [B, T_max], "lengths":
    LongTensor [B] (samples), "items": the B items loaded, "errors": [(item,
    message), ...], "warnings": [(item, message), ...]}``; an item whose
    ``loader(item, sample_rate)`` raises :class:`AudioError` (or returns no 1-D
    tensor) is left out of the tensors and listed in ``"errors"``. An item whose
    audio differs from its ``duration`` by more than :data:`LENGTH_TOLERANCE_S`
    and :data:`LENGTH_TOLERANCE` is loaded as read and listed in ``"warnings"``,
    once per recording (a chunked one by its first chunk); the first few are logged.
    With :func:`load_audio` the whole file is measured (a chunked recording's file
    too); with another loader, a whole item's waveform. Use with ``DataLoader(ds,
    batch_size=None, num_workers=N)``: worker ``w`` loads batches ``i`` with ``i % N == w``,
    and as the ``DataLoader`` takes from its workers in turn, batches come
    out in their order. Every worker walks ``batches`` from the start (the
    items only; it loads just its own batches), so ``batches`` must be
    iterable more than once and give the same batches each time: a list, or
    an object whose ``__iter__`` starts afresh.
    """

    def __init__(
        self,
        batches: Iterable[Sequence[Item]],
        *,
        sample_rate: int = 16000,
        loader: Callable[[Item, int], torch.Tensor] = load_audio,
    ) -> None:
        _check_rate(sample_rate)
        self.batches = batches
        self.sample_rate = sample_rate
        self.loader = loader
        #: Length differences logged so far (the first few are; every batch lists its own).
        self._logged = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        for i, batch in enumerate(self.batches):
            if i % workers == worker:
                yield self.collate(batch)

    def collate(self, batch: Sequence[Item]) -> dict[str, Any]:
        """Load one batch of items (the dict described in the class doc)."""
        loaded: list[tuple[Item, torch.Tensor]] = []
        errors: list[tuple[Item, str]] = []
        warnings: list[tuple[Item, str]] = []
        rate = self.sample_rate
        for item in batch:
            source: float | None = None
            try:
                if self.loader is load_audio:
                    wav, source = _read(item, rate)
                else:
                    wav = self.loader(item, rate)
            except AudioError as exc:
                errors.append((item, str(exc)))
                continue
            if not isinstance(wav, torch.Tensor) or wav.dim() != 1:
                shape = tuple(wav.shape) if isinstance(wav, torch.Tensor) else type(wav).__name__
                errors.append((item, f"item {item.id!r}: loader gave {shape}, not a 1-D tensor"))
                continue
            note = _length_note(item, source, wav.shape[0] / rate)
            if note is not None:
                warnings.append((item, note))
                self._log(note)
            loaded.append((item, wav))
        longest = max((w.shape[0] for _, w in loaded), default=0)
        waveforms = torch.zeros(len(loaded), longest, dtype=torch.float32)
        lengths = torch.zeros(len(loaded), dtype=torch.int64)
        for row, (_, wav) in enumerate(loaded):
            waveforms[row, : wav.shape[0]] = wav
            lengths[row] = wav.shape[0]
        return {
            "waveforms": waveforms,
            "lengths": lengths,
            "items": [item for item, _ in loaded],
            "errors": errors,
            "warnings": warnings,
        }

    def _log(self, note: str) -> None:
        self._logged += 1
        if self._logged <= _LOGGED_LENGTHS:
            log.warning("%s", note)
        if self._logged == _LOGGED_LENGTHS:
            log.warning(
                "further items whose audio differs from their duration are not logged one by"
                ' one: each batch lists them in its "warnings"'
            )


def _tolerance(declared: float) -> float:
    """How far an item's audio may be from its declared seconds (see LENGTH_TOLERANCE)."""
    return max(LENGTH_TOLERANCE_S, LENGTH_TOLERANCE * declared)


def _length_note(item: Item, source: float | None, got: float) -> str | None:
    """Why ``item``'s audio is not the length its manifest says, or None when it is.

    ``source``: the seconds its whole file (or data) holds, when known; ``got``: the seconds
    loaded. Checked once per recording: a whole item, or a chunked recording's first chunk
    (its file against the recording's declared length; needs ``source``). An item that
    starts past 0 s (a segment of a longer file) is only checked for a file that ends early.
    """
    extra = item.extra or {}
    if item.parent is None:
        rid, start, declared = item.id, item.offset, item.duration
        held = got if source is None else source - start
    elif item.chunk == 0 and source is not None and "parent_duration" in extra:
        rid, start = item.parent, float(extra.get("parent_offset", 0.0))
        declared, held = float(extra["parent_duration"]), source - start
    else:
        return None
    if abs(held - declared) <= _tolerance(declared) or (start > 0 and held > declared):
        return None
    if source is None:
        where = "the audio loaded is"
    else:
        name = repr(item.path) if item.path is not None else "its data"
        where = f"{name} holds" if start <= 0 else f"{name} holds, from {start:g} s on,"
    if item.parent is None and start <= 0:
        done = "the whole file is processed"
    elif held > declared:
        done = f"only its first {declared:.2f} s are processed"
    else:
        done = "it is read up to the file's end"
    return (
        f"item {rid!r}: the manifest says {declared:.2f} s, {where} {max(held, 0.0):.2f} s ({done})"
    )


class _UnsupportedWav(Exception):
    """A wav the standard library opens but this module does not decode (e.g. 24-bit)."""


def _check_rate(sample_rate: int) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
        raise AudioError(f"sample_rate must be a positive int, got {sample_rate!r}")


def _is_chunk(item: Item) -> bool:
    return item.parent is not None or item.offset > 0


def _span(item: Item, rate: int, size: int) -> tuple[int, int]:
    """The sample range ``[lo, hi)`` an item covers in a source of ``size`` samples."""
    if not _is_chunk(item):
        return 0, size
    lo = round(item.offset * rate)
    if lo >= size or lo < 0:
        raise AudioError(
            f"item {item.id!r}: offset {item.offset!r} s is outside its source "
            f"({size / rate:.3f} s at {rate} Hz)"
        )
    return lo, min(round((item.offset + item.duration) * rate), size)


def _from_data(item: Item, rate: int) -> tuple[torch.Tensor, float]:
    data = item.data
    if isinstance(data, torch.Tensor):
        if data.dim() != 1:
            raise AudioError(
                f"item {item.id!r}: data must be a 1-D waveform, got shape {tuple(data.shape)}"
            )
        lo, hi = _span(item, rate, data.shape[0])
        return _to_float(data[lo:hi].detach().cpu()), data.shape[0] / rate
    try:
        import numpy as np

        array = np.asarray(data)
        if array.ndim != 1:
            raise AudioError(
                f"item {item.id!r}: data must be a 1-D waveform, got shape {array.shape}"
            )
        lo, hi = _span(item, rate, int(array.shape[0]))
        return _to_float(torch.from_numpy(np.array(array[lo:hi]))), array.shape[0] / rate
    except AudioError:
        raise
    except Exception as exc:
        raise AudioError(
            f"item {item.id!r}: data of type {type(data).__name__} is not a waveform "
            f"(a 1-D tensor or array): {exc}"
        ) from exc


def _to_float(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.int16:
        return x.to(torch.float32) / 32768.0
    if x.dtype == torch.int32:
        return x.to(torch.float32) / 2147483648.0
    if x.dtype == torch.uint8:
        return (x.to(torch.float32) - 128.0) / 128.0
    return x.to(torch.float32)


def _from_npy(item: Item, path: str, rate: int) -> tuple[torch.Tensor, float]:
    import numpy as np

    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if array.ndim != 1:
        raise AudioError(
            f"item {item.id!r}: {path!r} must hold a 1-D waveform, got shape {array.shape}"
        )
    lo, hi = _span(item, rate, int(array.shape[0]))
    return _to_float(torch.from_numpy(np.array(array[lo:hi]))), array.shape[0] / rate


def _from_wav(item: Item, path: str, rate: int) -> tuple[torch.Tensor, float]:
    with wave.open(path, "rb") as f:
        width, channels, file_rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
        if width not in _WAV_DTYPES:
            raise _UnsupportedWav(f"{8 * width}-bit samples")
        frames, framesize = f.getnframes(), width * channels
        seconds = frames / file_rate
        if frames:
            # The header's last frame must be in the file (one seek and a read, at any size):
            # a file cut short is reported, not processed short.
            f.setpos(frames - 1)
            if len(f.readframes(1)) < framesize:
                raise _truncated(item, path, seconds)
        lo, hi = _span(item, file_rate, frames)
        f.setpos(lo)
        raw = f.readframes(hi - lo)
    raw = raw[: len(raw) - len(raw) % width]
    if not raw:
        return torch.zeros(0, dtype=torch.float32), seconds
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if width > 1 and sys.byteorder == "big":  # pragma: no cover - wav samples are little-endian
        data = data.reshape(-1, width).flip(1).reshape(-1)
    x = _to_float(data.view(_WAV_DTYPES[width]))
    if channels > 1:
        x = x[: x.shape[0] - x.shape[0] % channels].reshape(-1, channels).mean(dim=1)
    return _resample(x, file_rate, rate), seconds


def _from_soundfile(item: Item, path: str, rate: int) -> tuple[torch.Tensor, float]:
    soundfile = importlib.import_module("soundfile")  # optional, untyped: Any
    info = soundfile.info(path)
    file_rate, frames = int(info.samplerate), int(info.frames)
    extent = _wav_extent(path) if path.lower().endswith(".wav") else None
    if extent is not None and extent[1] < extent[0]:
        # libsndfile gives a truncated WAV's frames as those the file holds: the header says.
        raise _truncated(item, path, extent[0])
    lo, hi = _span(item, file_rate, frames)
    data = soundfile.read(path, start=lo, stop=hi, dtype="float32", always_2d=True)[0]
    short = hi - lo - data.shape[0]
    if short > 0 and short > _tolerance((hi - lo) / file_rate) * file_rate:
        # The header's frames are an estimate in some formats (mp3): a few may be missing.
        raise _truncated(item, path, frames / file_rate)
    x = torch.from_numpy(data).mean(dim=1)
    return _resample(x, file_rate, rate), frames / file_rate


def _truncated(item: Item, path: str, declared: float) -> AudioError:
    """The error for a file that ends before its header's length (a copy cut short)."""
    extent = _wav_extent(path) if path.lower().endswith(".wav") else None
    holds = f"the file holds {extent[1]:.3f} s" if extent is not None else "the file ends earlier"
    return AudioError(
        f"item {item.id!r}: {path!r} is truncated: its header says {declared:.3f} s of audio,"
        f" {holds}; copy or make the file again"
    )


def _wav_extent(path: str) -> tuple[float, float] | None:
    """(seconds a WAV's header says its data holds, seconds of data in the file), or None.

    None where the file is not a RIFF WAV with a ``fmt`` chunk before its ``data`` chunk
    (RF64, whose sizes are elsewhere, included).
    """
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or head[:4] != b"RIFF" or head[8:] != b"WAVE":
                return None
            byte_rate = 0
            while len(chunk := f.read(8)) == 8:
                size = int.from_bytes(chunk[4:], "little")
                if chunk[:4] == b"fmt ":
                    fmt = f.read(size + (size & 1))
                    byte_rate = int.from_bytes(fmt[8:12], "little") if len(fmt) >= 12 else 0
                elif chunk[:4] == b"data":
                    if not byte_rate or size == 0xFFFFFFFF:
                        return None
                    held = max(os.fstat(f.fileno()).st_size - f.tell(), 0)
                    return size / byte_rate, min(held, size) / byte_rate
                else:
                    f.seek(size + (size & 1), os.SEEK_CUR)
    except OSError:
        return None
    return None


def _resample(x: torch.Tensor, source: int, target: int) -> torch.Tensor:
    """Linear interpolation from ``source`` to ``target`` Hz (approximate: no low-pass)."""
    if source == target or x.shape[0] == 0:
        return x.contiguous()
    size = max(1, round(x.shape[0] * target / source))
    return torch.nn.functional.interpolate(
        x[None, None], size=size, mode="linear", align_corners=False
    )[0, 0]
