"""Long recordings in chunks: :func:`chunk_items` splits, :class:`Stitcher` joins.

:func:`chunk_items` streams :class:`~vramctl.batching._manifest.Item` s and cuts
each one longer than ``max_duration`` seconds into overlapping windows, so that
no batch has to hold a whole hour-long recording. A chunk is an ordinary Item
(``id`` ``"<recording>#<k>"``, ``parent`` the recording's id, ``chunk`` its
position ``k``, ``offset`` where it starts in the source) whose ``extra`` also
carries ``"chunks"`` (how many chunks the recording has), ``"parent_duration"``
and ``"parent_offset"`` (the recording's own duration and offset).

Consecutive windows overlap by ``overlap`` seconds and the last one ends at
the end of the recording. A last window shorter than
``max(2 * overlap, 0.1 * max_duration)`` would carry little but its overlap,
so it starts earlier instead (overlapping its neighbour more). With ``align``
(seconds, e.g. the model's frame period) that earlier start falls on the
``align`` grid too, so the frames of a frame-wise model line up exactly.

:class:`Stitcher` takes each chunk's frame-level output (time on dim 0,
``frame_rate`` frames per second of audio) in any order and returns a
recording's output once all of its chunks are in: each overlap is cut at its
middle, the first window's frames before it and the next window's from it.

>>> import torch
>>> from vramctl.batching._manifest import Item
>>> items = [Item("a", 25.0), Item("b", 4.0)]
>>> chunks = list(chunk_items(items, max_duration=10.0, overlap=1.0))
>>> [(c.id, c.offset, c.duration, c.parent) for c in chunks]
[('a#0', 0.0, 10.0, 'a'), ('a#1', 9.0, 10.0, 'a'), ('a#2', 18.0, 7.0, 'a'), ('b', 0.0, 4.0, None)]
>>> chunk_count(25.0, 10.0, 1.0)
3
>>> def frames(c):  # a frame-wise "model" at 2 frames/s: each frame's time index
...     return torch.arange(round(c.offset * 2), round((c.offset + c.duration) * 2))
>>> stitcher = Stitcher(frame_rate=2.0)
>>> done = [out for c in reversed(chunks) for out in stitcher.add(c, frames(c))]
>>> [(rid, len(t), torch.equal(t, torch.arange(len(t)))) for rid, t in done]
[('b', 8, True), ('a', 50, True)]
>>> stitcher.pending()
0
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from vramctl.batching._adaptive import BatchingError
from vramctl.batching._manifest import Item

__all__ = ["Stitcher", "chunk_count", "chunk_items"]

#: Slack for float rounding when counting windows and snapping to the ``align`` grid.
_EPS = 1e-9


def chunk_items(
    items: Iterable[Item],
    *,
    max_duration: float,
    overlap: float = 1.0,
    align: float | None = None,
) -> Iterator[Item]:
    """Items no longer than ``max_duration`` seconds: long ones become overlapping chunks.

    Streams: one item is held at a time. An item of ``duration <= max_duration``
    is yielded unchanged; a longer one as windows of at most ``max_duration``
    seconds, consecutive ones overlapping by ``overlap`` seconds (more for the
    last one when the rest would be short, see the module doc), together
    covering the whole item. ``align`` (seconds, optional; ``max_duration``
    and ``overlap`` must be multiples of it) keeps every window start on that
    grid. Chunks keep the item's ``path``, ``data``, ``index`` and ``extra``
    entries; ``extra`` gains ``"chunks"``, ``"parent_duration"`` and
    ``"parent_offset"`` (replacing entries of those names).
    """
    _check(max_duration, overlap, align)
    max_duration, overlap = float(max_duration), float(overlap)
    for item in items:
        if item.duration <= max_duration:
            yield item
            continue
        if not math.isfinite(item.duration):
            raise BatchingError(f"item {item.id!r}: duration must be finite, got {item.duration!r}")
        windows = _windows(item.duration, max_duration, overlap, align)
        extra = dict(item.extra or {})
        extra.update(chunks=len(windows), parent_duration=item.duration, parent_offset=item.offset)
        for k, (start, length) in enumerate(windows):
            yield replace(
                item,
                id=f"{item.id}#{k}",
                duration=length,
                offset=item.offset + start,
                parent=item.id,
                chunk=k,
                extra=extra,
            )


def chunk_count(
    duration: float, max_duration: float, overlap: float = 1.0, align: float | None = None
) -> int:
    """How many chunks :func:`chunk_items` makes of an item ``duration`` seconds long.

    >>> chunk_count(10.0, 10.0, 1.0), chunk_count(28.0, 10.0, 1.0), chunk_count(28.5, 10.0, 1.0)
    (1, 3, 4)
    """
    _check(max_duration, overlap, align)
    if duration <= max_duration:
        return 1
    if not math.isfinite(duration):
        raise BatchingError(f"duration must be finite, got {duration!r}")
    return _count(float(duration), float(max_duration), float(overlap))


def _check(max_duration: float, overlap: float, align: float | None) -> None:
    if isinstance(max_duration, bool) or not isinstance(max_duration, (int, float)):
        raise BatchingError(f"max_duration must be a number of seconds, got {max_duration!r}")
    if not (math.isfinite(max_duration) and max_duration > 0):
        raise BatchingError(f"max_duration must be positive and finite, got {max_duration!r}")
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)):
        raise BatchingError(f"overlap must be a number of seconds, got {overlap!r}")
    if not 0 <= overlap < max_duration / 2:
        raise BatchingError(
            f"overlap must be at least 0 and less than half of max_duration ({max_duration!r}), "
            f"got {overlap!r}"
        )
    if align is None:
        return
    if isinstance(align, bool) or not isinstance(align, (int, float)):
        raise BatchingError(f"align must be a number of seconds or None, got {align!r}")
    if not (math.isfinite(align) and 0 < align <= max_duration):
        raise BatchingError(f"align must be positive and at most max_duration, got {align!r}")
    for name, value in (("max_duration", max_duration), ("overlap", overlap)):
        steps = value / align
        if abs(steps - round(steps)) > 1e-6:
            raise BatchingError(f"{name} ({value!r}) must be a multiple of align ({align!r})")


def _count(duration: float, max_duration: float, overlap: float) -> int:
    step = max_duration - overlap
    # Window k starts at k * step; the last must reach the end and be longer than the overlap.
    return max(2, math.ceil((duration - overlap) / step - _EPS))


def _windows(
    duration: float, max_duration: float, overlap: float, align: float | None
) -> list[tuple[float, float]]:
    """``(start, length)`` of each window of a recording longer than ``max_duration``."""
    n = _count(duration, max_duration, overlap)
    step = max_duration - overlap
    shortest = max(2 * overlap, 0.1 * max_duration)
    # The last window ends at the end: no longer than max_duration, no shorter than `shortest`.
    # It starts after window n-2 does (duration - max_duration > (n - 2) * step by _count).
    last = min(max((n - 1) * step, duration - max_duration), duration - shortest)
    if align is not None:
        snapped = math.floor(last / align + _EPS) * align
        if snapped < duration - max_duration - _EPS:
            snapped = math.ceil((duration - max_duration) / align - _EPS) * align
        last = snapped
    windows = [(k * step, max_duration) for k in range(n - 1)]
    windows.append((last, duration - last))
    return windows


class Stitcher:
    """Joins the chunk outputs of :func:`chunk_items` chunks into whole-recording outputs.

    ``frame_rate``: output frames per second of audio (50 for wav2vec2). Each
    output has time on dim 0; frame ``j`` of a chunk starting ``s`` seconds into
    its recording is frame ``round(s * frame_rate) + j`` of the recording.
    Chunks may arrive in any order; their outputs are held until the last one
    of their recording is in. A stitched output has ``round(duration *
    frame_rate)`` frames give or take the model's own rounding, and for a model
    without long-range context it matches the model's output on the whole
    recording (exactly for a frame-wise model whose chunks start on its frame
    grid: see ``align`` in :func:`chunk_items`).
    """

    def __init__(self, frame_rate: float) -> None:
        if isinstance(frame_rate, bool) or not isinstance(frame_rate, (int, float)):
            raise BatchingError(f"frame_rate must be a number, got {frame_rate!r}")
        if not (math.isfinite(frame_rate) and frame_rate > 0):
            raise BatchingError(f"frame_rate must be positive and finite, got {frame_rate!r}")
        self.frame_rate = float(frame_rate)
        # (recording id, manifest index) -> (number of chunks, {chunk position: (item, output)}).
        # The index keeps apart two recordings of a manifest that share an id.
        self._pending: dict[tuple[str, int], tuple[int, dict[int, tuple[Item, torch.Tensor]]]] = {}

    def __repr__(self) -> str:
        return f"Stitcher(frame_rate={self.frame_rate!r}, pending={self.pending()})"

    def pending(self) -> int:
        """How many recordings have some of their chunks in but not all."""
        return len(self._pending)

    def discard(self, recording: str, index: int | None = None) -> bool:
        """Drop the chunks held for ``recording`` (it failed); True if any were held.

        ``index`` (the recording's manifest index) names one of several recordings
        sharing the id; without it, the chunks of all of them are dropped.
        """
        keys = [k for k in self._pending if k[0] == recording and index in (None, k[1])]
        for key in keys:
            del self._pending[key]
        return bool(keys)

    def add(self, item: Item, output: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Take one item's output; return the recordings it completes as ``(id, output)``.

        A whole (unchunked) item comes straight back as ``[(item.id, output)]``;
        a chunk completes its recording (``[(item.parent, stitched)]``) when it
        is the last of them to arrive, else ``[]``.
        """
        if not isinstance(output, torch.Tensor) or output.dim() < 1:
            raise BatchingError(
                f"item {item.id!r}: the output must be a tensor with time on dim 0, "
                f"got {type(output).__name__}"
                + (f" of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else "")
            )
        if item.parent is None:
            return [(item.id, output)]
        count = (item.extra or {}).get("chunks")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise BatchingError(
                f"chunk {item.id!r} has no extra['chunks'] (its recording's chunk count): "
                "make chunks with chunk_items"
            )
        key = (item.parent, item.index)
        entry = self._pending.setdefault(key, (count, {}))
        total, parts = entry
        if count != total or not 0 <= item.chunk < total:
            raise BatchingError(
                f"chunk {item.id!r} is chunk {item.chunk} of {count}, but recording "
                f"{item.parent!r} has {total} chunks (0 to {total - 1})"
            )
        if item.chunk in parts:
            raise BatchingError(
                f"chunk {item.chunk} of recording {item.parent!r} ({item.id!r}) was added twice"
            )
        parts[item.chunk] = (item, output)
        if len(parts) < total:
            return []
        del self._pending[key]
        return [(item.parent, self._stitch([parts[k] for k in range(total)]))]

    def _stitch(self, parts: list[tuple[Item, torch.Tensor]]) -> torch.Tensor:
        rate = self.frame_rate
        first = parts[0][0]
        origin = float((first.extra or {}).get("parent_offset", first.offset))
        pieces: list[torch.Tensor] = []
        done = 0  # frames of the recording taken so far
        for k, (item, output) in enumerate(parts):
            start = item.offset - origin
            base = round(start * rate)  # the recording's frame index of this chunk's frame 0
            if k + 1 < len(parts):
                follower = parts[k + 1][0].offset - origin
                cut = round((follower + start + item.duration) / 2 * rate)  # overlap's middle
                stop = min(cut - base, output.shape[0])
            else:
                stop = output.shape[0]
            begin = max(done - base, 0)
            if stop > begin:
                pieces.append(output[begin:stop])
                done = base + stop
        return torch.cat(pieces, dim=0) if pieces else parts[0][1][:0]
