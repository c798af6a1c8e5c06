"""The run's item stream: what the progress store does not hold, chunked, loaded ahead.

:class:`Remaining` yields the manifest's items that an earlier run did not finish, long
recordings cut into chunks; :class:`Loaded` collates the sampler's batches of them in a
thread pool, a few ahead, and hands them out in order to whichever worker asks.
"""

from __future__ import annotations

import os
import re
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vramctl.batching._audio import AudioBatches
from vramctl.batching._chunk import chunk_items
from vramctl.batching._manifest import Item, Manifest, audio_files
from vramctl.batching._sampler import BucketingSampler

__all__ = ["Loaded", "Remaining", "count_records"]

#: A recording that would make more chunks than this is recorded as failed, not run: its
#: duration is not believable (about 34 days at 30 s chunks; its outputs would not fit in
#: memory for stitching anyway).
_MAX_CHUNKS = 100_000


class Remaining:
    """The manifest's items that the store does not hold, long ones chunked; re-iterable.

    A recording that would make more than :data:`_MAX_CHUNKS` chunks is not run: its
    duration is not believable (and its chunk list alone would exhaust memory). It goes to
    ``rejected`` as a failure ``(index, id, reason)``, which the collector records.
    """

    def __init__(
        self,
        source: Manifest | Iterable[Item],
        completed: Any,
        chunk: float,
        overlap: float,
    ) -> None:
        self.source = source
        self.completed = completed
        self.chunk = chunk
        self.overlap = overlap
        self.skipped = 0
        self.fresh = 0
        #: Recordings refused before chunking, for the collector to record as failed.
        #: (A deque: the sampler may run in a worker thread, the collector in the main one.)
        self.rejected: deque[tuple[int, str, str]] = deque()
        #: The longest recording that makes at most _MAX_CHUNKS chunks.
        self.longest = overlap + _MAX_CHUNKS * (chunk - overlap)

    def __iter__(self) -> Iterator[Item]:
        self.skipped = 0
        self.fresh = 0
        return chunk_items(self._fresh(), max_duration=self.chunk, overlap=self.overlap)

    def _fresh(self) -> Iterator[Item]:
        completed, longest = self.completed, self.longest
        for item in self.source:
            if item.index in completed:
                self.skipped += 1
                continue
            self.fresh += 1
            if item.duration > longest:
                self.rejected.append(
                    (
                        item.index,
                        item.id,
                        f"duration {item.duration!r} s would make more than {_MAX_CHUNKS} chunks"
                        f" of {self.chunk:g} s (longer than {longest:g} s): check the manifest's"
                        " duration, or raise chunk_duration",
                    )
                )
                continue
            yield item


def count_records(path: str) -> int | None:
    """Non-blank lines of a JSON Lines or CSV manifest (less a CSV header), read fast.

    A line of only white space (``\\r`` of CRLF endings included) is blank, as the
    manifest reader takes it. A folder: its audio files.
    """
    if os.path.isdir(path):
        return sum(1 for _ in audio_files(path))
    if not os.path.isfile(path) or path.endswith(".gz"):
        return None
    lines = 0
    blank = 0
    tail = b""  # the last line when it has no newline
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            if block[-1:] != b"\n":
                block += f.readline()  # whole lines only: a blank line is not cut in two
            lines += block.count(b"\n")
            if _FIRST_BLANK.match(block):  # a block starts a line: the regex below needs a \n
                blank += 1
            blank += len(_BLANK_LINE.findall(block))
            tail = block[block.rfind(b"\n") + 1 :]
    lines += bool(tail.strip())
    if path.lower().endswith(".csv"):
        lines -= 1
    return max(lines - blank, 0)


#: A line of only white space after a newline (it is not consumed: runs of blanks count).
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*(?=\n)")
#: A block's first line of only white space.
_FIRST_BLANK = re.compile(rb"[ \t\r\f\v]*\n")


class Loaded:
    """Batches loaded ahead by a thread pool, handed out in the sampler's order."""

    def __init__(self, sampler: BucketingSampler, audio: AudioBatches, threads: int) -> None:
        self._batches = iter(sampler)
        self._audio = audio
        self._pool = ThreadPoolExecutor(threads, "vramctl-load") if threads > 0 else None
        self._ahead: deque[Future[dict[str, Any]]] = deque()
        self._depth = 2 * threads + 2
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        with self._lock:
            if self._pool is None:
                batch = next(self._batches)
                return self._audio.collate(batch.items)
            while len(self._ahead) < self._depth:
                nxt = next(self._batches, None)
                if nxt is None:
                    break
                self._ahead.append(self._pool.submit(self._audio.collate, nxt.items))
            if not self._ahead:
                raise StopIteration
            future = self._ahead.popleft()
        return future.result()

    def close(self) -> None:
        for f in self._ahead:
            f.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
