"""Manifests: JSON Lines, CSV or a Lhotse CutSet, streamed one record at a time.

A record names one item: an ``id``, where its audio is (a ``path``, or an
in-memory source) and how long it is (``duration`` in seconds, or
``num_samples`` at a ``sample_rate``). Field names of the common toolkits are
accepted: NeMo's ``audio_filepath``, Lhotse's cut ``id`` and ``duration``,
LibriSpeech length lists' ``utterance_id``.

Reading never holds the file: records are parsed as they are drawn, so a
10M-line manifest costs the memory of one line. A bad line (not JSON, a
missing field, a duration of zero or less) is reported with the file, line and
field, kept in :attr:`Manifest.problems` (the first thousand) and counted, and
reading goes on with the next line. A record whose id an earlier record has is skipped
(the first is kept) and counted in :attr:`Manifest.duplicates`; the end of a pass logs one
warning naming the first few. Finding them keeps a fingerprint of each id seen (about 10
bytes a record, :class:`~vramctl.batching._ids.SeenIds`).

>>> import json, tempfile, os
>>> d = tempfile.mkdtemp()
>>> p = os.path.join(d, "m.jsonl")
>>> with open(p, "w") as f:
...     _ = f.write(json.dumps({"id": "a", "path": "a.wav", "duration": 2.5}) + "\\n")
...     _ = f.write("not json\\n")
...     _ = f.write(json.dumps({"id": "b", "num_samples": 32000}) + "\\n")
>>> m = Manifest(p)
>>> [(i.id, i.duration, i.index) for i in m]
[('a', 2.5, 0), ('b', 2.0, 2)]
>>> m.problems[0].line, m.problems[0].field
(2, None)
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from vramctl._errors import VramctlError
from vramctl._optional import available, require
from vramctl.batching._ids import SeenIds

__all__ = [
    "AUDIO_EXTENSIONS",
    "DEFAULT_SAMPLE_RATE",
    "Item",
    "Manifest",
    "ManifestError",
    "ManifestProblem",
    "audio_files",
    "check_has_records",
    "items_from",
]

log = logging.getLogger("vramctl.batching")

#: Sample rate assumed for ``num_samples`` when a record gives none.
DEFAULT_SAMPLE_RATE = 16_000
#: At most this many problems are kept in :attr:`Manifest.problems` (all are counted).
MAX_PROBLEMS = 1000
#: Duplicate ids kept in :attr:`Manifest.duplicate_ids` (all are counted); the warning names 5.
MAX_DUPLICATES = 20
_NAMED_DUPLICATES = 5

_ID_FIELDS = ("id", "utterance_id", "utt_id", "cut_id", "key")
_PATH_FIELDS = ("path", "audio_filepath", "audio_path", "source", "file")
_DURATION_FIELDS = ("duration", "seconds", "length")
_SAMPLES_FIELDS = ("num_samples", "samples")

#: On POSIX a path is absolute exactly when it starts with "/".
_POSIX = os.name == "posix"
#: The files a folder given as a manifest is read for.
AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".mp3", ".opus")
#: The UTF-8 byte order mark some editors put at the start of a file.
_BOM = b"\xef\xbb\xbf"


def _json_loads() -> Callable[[str | bytes], Any]:
    """orjson's ``loads`` (a line in a fraction of json's time) where it is installed."""
    if available("orjson"):
        import orjson

        return orjson.loads
    return json.loads


_loads = _json_loads()


class ManifestError(VramctlError, ValueError):
    """A manifest that cannot be read at all (missing file, unknown format)."""


@dataclass(slots=True)
class Item:
    """One item of a manifest: an id, its audio and its length in seconds.

    Treat it as immutable. (It is not a frozen dataclass because a frozen one
    takes eight times as long to build, and a 10M-line manifest builds 10M.)
    """

    id: str
    #: Seconds (or, for non-audio data, a length in the manifest's own units).
    duration: float
    #: Where the audio is: a file path (None: in memory, see ``data``).
    path: str | None = None
    #: 0-based position of the record in the manifest (its line among the records).
    index: int = -1
    #: Seconds into the source where the item starts (chunks of a long recording).
    offset: float = 0.0
    #: An in-memory source (for example a waveform tensor), or None.
    data: Any = field(default=None, compare=False, repr=False)
    #: The id of the recording this item is a chunk of (None: a whole recording).
    parent: str | None = None
    #: The chunk's position in its recording (0 for a whole recording).
    chunk: int = 0
    #: Other fields of the record (text, speaker ...), or None.
    extra: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ManifestProblem:
    """A manifest record that was skipped, and why."""

    file: str
    #: 1-based line number in the file (for CSV, counting the header line).
    line: int
    #: The field at fault, or None when the whole line is (not JSON, wrong column count).
    field: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        if self.field:
            return f"{where}: {self.field}: {self.message}"
        return f"{where}: {self.message}"


class Manifest:
    """A manifest file, read lazily: iterate it for :class:`Item` s, once or many times.

    ``format`` is ``"jsonl"``, ``"csv"`` or ``"lhotse"`` (a CutSet manifest,
    ``.jsonl.gz`` included; needs ``lhotse``), else taken from the file name. A folder
    is read as a manifest of its audio files (:data:`AUDIO_EXTENSIONS`, in its subfolders
    too, sorted by path): each file's id is its path in the folder without the extension,
    and its length is read from its header.
    ``sample_rate`` converts ``num_samples`` fields to seconds. Relative paths
    are taken relative to the manifest's folder.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        format: str | None = None,
        sample_rate: int = DEFAULT_SAMPLE_RATE,
    ) -> None:
        self.path = os.fspath(path)
        folder = os.path.isdir(self.path)
        if not folder and not os.path.isfile(self.path):
            raise ManifestError(f"manifest {self.path}: no such file or folder")
        if sample_rate <= 0:
            raise ManifestError(f"sample_rate must be positive, got {sample_rate}")
        self.format = "folder" if folder else (format or _guess_format(self.path))
        if self.format not in ("jsonl", "csv", "lhotse", "folder"):
            raise ManifestError(
                f"manifest {self.path}: unknown format {self.format!r} (jsonl, csv or lhotse)"
            )
        if self.format == "lhotse":
            require(
                "lhotse",
                extra="audio",
                what=f"manifest {self.path} (a Lhotse CutSet)",
                error=ManifestError,
            )
        self.sample_rate = sample_rate
        self.root = (
            os.path.abspath(self.path) if folder else os.path.dirname(os.path.abspath(self.path))
        )
        self._prefix = self.root + os.sep
        #: (id field, path field, duration field, divisor, field count) of the first record.
        self._schema: tuple[str, str | None, str, float, int] | None = None
        #: The first problems of the latest pass (see :data:`MAX_PROBLEMS`).
        self.problems: list[ManifestProblem] = []
        #: How many records the latest pass skipped.
        self.skipped = 0
        #: Records the latest pass skipped because an earlier record has their id (the first
        #: is kept), and the first of them as (id, where: "line 12", a file, "cut 3").
        self.duplicates = 0
        self.duplicate_ids: list[tuple[str, str]] = []
        #: Set while a pass only looks (check_has_records): problems are kept, not logged.
        self._quiet = False

    def __repr__(self) -> str:
        return f"Manifest({self.path!r}, format={self.format!r})"

    def __iter__(self) -> Iterator[Item]:
        self.problems = []
        self.skipped = 0
        self.duplicates = 0
        self.duplicate_ids = []
        self._schema = None
        if self.format == "lhotse":
            return self._ended(self._lhotse())
        if self.format == "folder":
            return self._ended(self._folder())
        if self.format == "csv":
            return self._ended(self._csv())
        return self._ended(self._jsonl())

    def duplicates_message(self) -> str | None:
        """The latest pass's duplicate ids as one line (None: there were none)."""
        return _duplicates_message(self.path, self.duplicates, self.duplicate_ids)

    def _ended(self, items: Iterator[Item]) -> Iterator[Item]:
        """``items``, then the pass's one warning about duplicate ids (when it ran to the end)."""
        yield from items
        message = self.duplicates_message()
        if message is not None and not self._quiet:
            log.warning("%s", message)

    # -- readers ------------------------------------------------------------------

    def _problem(self, line: int, fld: str | None, message: str) -> None:
        self._report(ManifestProblem(self.path, line, fld, message))

    def _duplicate(self, rid: str, where: str) -> None:
        self.duplicates += 1
        if len(self.duplicate_ids) < MAX_DUPLICATES:
            self.duplicate_ids.append((rid, where))

    def _report(self, p: ManifestProblem) -> None:
        self.skipped += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(p)
            if not self._quiet:
                log.warning("skipped %s", p)

    def _jsonl(self) -> Iterator[Item]:
        loads, item_of = _loads, self._item
        seen = SeenIds()
        index = -1
        # Bytes, not text: the JSON parser decodes UTF-8 itself (and reports bad bytes as a
        # bad line), which saves decoding every line twice.
        with _open_bytes(self.path) as f:
            for lineno, line in enumerate(f, 1):
                if lineno == 1 and line.startswith(_BOM):
                    line = line[len(_BOM) :]  # a UTF-8 byte order mark (Windows editors)
                try:
                    record = loads(line)
                except ValueError as exc:
                    if not line.strip():
                        continue  # a blank line is no record
                    index += 1
                    self._problem(lineno, None, f"not valid JSON ({exc})")
                    continue
                index += 1
                if type(record) is not dict:
                    self._problem(lineno, None, "not a JSON object")
                    continue
                item = item_of(record, lineno, index)
                if item is not None:
                    if not seen.add(item.id):
                        self._duplicate(item.id, f"line {lineno}")
                        continue
                    yield item

    def _csv(self) -> Iterator[Item]:
        seen = SeenIds()
        index = -1
        with _open_text(self.path) as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                return
            names = [h.strip() for h in header]
            width = len(names)
            end = reader.line_num
            for row in reader:
                # The line the record starts on, from the reader's count (a quoted field may
                # span lines).
                lineno, end = end + 1, reader.line_num
                if not row:
                    continue
                index += 1
                try:
                    "".join(row).encode("utf-8")
                except UnicodeEncodeError:  # bytes that are not UTF-8, kept as surrogates
                    self._problem(lineno, None, "not valid UTF-8")
                    continue
                if len(row) != width:
                    self._problem(lineno, None, f"{len(row)} columns, the header has {width}")
                    continue
                item = self._item(dict(zip(names, row, strict=True)), lineno, index)
                if item is not None:
                    if not seen.add(item.id):
                        self._duplicate(item.id, f"line {lineno}")
                        continue
                    yield item

    def _folder(self) -> Iterator[Item]:
        seen = SeenIds()
        for index, (rel, path) in enumerate(audio_files(self.path)):
            rid = os.path.splitext(rel)[0]
            if not seen.add(rid):  # the same name with another extension: a.flac and a.wav
                self._duplicate(rid, rel)
                continue
            try:
                seconds = _audio_seconds(path)
            except Exception as exc:  # any unreadable header: the file is reported, not run
                self._report(ManifestProblem(path, index + 1, None, f"cannot read it: {exc}"))
                continue
            if not seconds > 0:
                self._report(ManifestProblem(path, index + 1, None, "holds no audio (0 s)"))
                continue
            yield Item(rid, seconds, path, index)

    def _lhotse(self) -> Iterator[Item]:
        from lhotse import CutSet

        seen = SeenIds()
        for index, cut in enumerate(CutSet.from_file(self.path)):
            if not seen.add(cut.id):
                self._duplicate(cut.id, f"cut {index + 1}")
                continue
            source = None
            if getattr(cut, "recording", None) is not None:
                sources = cut.recording.sources
                if sources and sources[0].type == "file":
                    source = str(sources[0].source)
            yield Item(
                id=cut.id,
                duration=float(cut.duration),
                path=source,
                index=index,
                offset=float(cut.start),
                extra={"cut": cut},
            )

    def _item(self, record: dict[str, Any], lineno: int, index: int) -> Item | None:
        fast = self._schema
        if fast is not None and len(record) == fast[4]:
            # The common case: the same fields as the first record (no lookups by alias). As
            # many fields, each of the first record's present, are the same fields: any other
            # (an offset, another alias, a sample_rate, extras) takes the slow path.
            idk, pathk, durk, scale, _ = fast
            try:
                rid, path, d = record[idk], record[pathk] if pathk else None, record[durk]
                duration = float(d) / scale
            except (KeyError, TypeError, ValueError):
                pass
            else:
                if rid != "" and rid is not None and duration > 0 and duration != math.inf:
                    if path:
                        path = str(path)
                        if path[0] != "/" and (_POSIX or not os.path.isabs(path)):
                            path = self._prefix + path
                    return Item(str(rid), duration, path or None, index)
        return self._item_slow(record, lineno, index)

    def _learn(self, record: dict[str, Any]) -> None:
        """Remember the first good record's field names, for the fast path."""
        idk = next((k for k in _ID_FIELDS if record.get(k) is not None), None)
        pathk = next((k for k in _PATH_FIELDS if record.get(k) is not None), None)
        durk = next((k for k in _DURATION_FIELDS if k in record), None)
        scale = 1.0
        if durk is None:
            durk = next((k for k in _SAMPLES_FIELDS if k in record), None)
            if durk is None or "sample_rate" in record:
                return
            scale = float(self.sample_rate)
        known = {idk, pathk, durk}
        if idk is None or any(k not in known for k in record):
            return  # other fields go to extra: the general path keeps them
        self._schema = (idk, pathk, durk, scale, len(record))

    def _item_slow(self, record: dict[str, Any], lineno: int, index: int) -> Item | None:
        rid = _first(record, _ID_FIELDS)
        if rid is None or rid == "":
            self._problem(lineno, "id", f"missing (one of {', '.join(_ID_FIELDS)})")
            return None
        duration, fld, err = self._duration(record)
        if err is not None:
            self._problem(lineno, fld, err)
            return None
        path = _first(record, _PATH_FIELDS)
        if path is not None:
            path = str(path)
            if path and not os.path.isabs(path):
                path = os.path.join(self.root, path)
        known = {*_ID_FIELDS, *_PATH_FIELDS, *_DURATION_FIELDS, *_SAMPLES_FIELDS, "sample_rate"}
        extra = {k: v for k, v in record.items() if k not in known} or None
        offset = record.get("offset", 0.0)
        try:
            offset = float(offset or 0.0)
        except (TypeError, ValueError):
            self._problem(lineno, "offset", f"not a number: {offset!r}")
            return None
        if self._schema is None and extra is None and not offset:
            self._learn(record)
        return Item(str(rid), duration, path or None, index, offset, None, None, 0, extra)

    def _duration(self, record: dict[str, Any]) -> tuple[float, str | None, str | None]:
        for name in _DURATION_FIELDS:
            if name in record:
                return _positive(record[name], name)
        for name in _SAMPLES_FIELDS:
            if name in record:
                samples, fld, err = _positive(record[name], name)
                if err is not None:
                    return 0.0, fld, err
                given = record.get("sample_rate", self.sample_rate)
                rate, rfld, rerr = _positive(given, "sample_rate")
                if rerr is not None:
                    return 0.0, rfld, rerr
                return samples / rate, None, None
        return 0.0, "duration", "missing (duration, or num_samples with sample_rate)"


def items_from(
    records: Iterable[Mapping[str, Any] | Item], *, sample_rate: int = 16_000
) -> Iterator[Item]:
    """:class:`Item` s from in-memory records (dicts with the manifest's fields, or Items).

    A dict's ``data`` field is kept as the in-memory source. Bad records raise
    :class:`ManifestError` naming the record and field. A record whose id an earlier one
    has is skipped (the first is kept), with one warning at the end naming the first few.

    >>> [i.duration for i in items_from([{"id": "x", "num_samples": 8000}])]
    [0.5]
    """
    reader = Manifest.__new__(Manifest)
    reader.path, reader.sample_rate, reader.root = "<records>", sample_rate, os.getcwd()
    reader.problems, reader.skipped, reader._schema = [], 0, None
    reader._prefix = reader.root + os.sep
    seen = SeenIds()
    duplicates: list[tuple[str, str]] = []
    count = 0
    for index, record in enumerate(records):
        if isinstance(record, Item):
            if not seen.add(record.id):
                count += 1
                if len(duplicates) < MAX_DUPLICATES:
                    duplicates.append((record.id, f"record {index}"))
                continue
            yield record
            continue
        item = reader._item_slow(dict(record), index + 1, index)
        if item is None:
            raise ManifestError(
                f"record {index}: {reader.problems[-1].field}: {reader.problems[-1].message}"
            )
        if not seen.add(item.id):
            count += 1
            if len(duplicates) < MAX_DUPLICATES:
                duplicates.append((item.id, f"record {index}"))
            continue
        data = record.get("data")
        if data is not None:
            item = Item(
                item.id,
                item.duration,
                item.path,
                item.index,
                item.offset,
                data,
                None,
                0,
                item.extra,
            )
        yield item
    message = _duplicates_message("<records>", count, duplicates)
    if message is not None:
        log.warning("%s", message)


def _duplicates_message(source: str, count: int, first: list[tuple[str, str]]) -> str | None:
    """``m.jsonl: 2 duplicate ids skipped (u7 at line 12, ...); the first of each is kept``."""
    if not count:
        return None
    named = ", ".join(f"{rid} at {where}" for rid, where in first[:_NAMED_DUPLICATES])
    more = ", ..." if count > _NAMED_DUPLICATES else ""
    ids = "id" if count == 1 else "ids"
    return f"{source}: {count} duplicate {ids} skipped ({named}{more}); the first of each is kept"


def _first(record: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        value = record.get(name)
        if value is not None:
            return value
    return None


def _positive(value: Any, name: str) -> tuple[float, str | None, str | None]:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return 0.0, name, f"not a number: {value!r}"
    if not math.isfinite(x) or x <= 0:
        return 0.0, name, f"must be positive, got {value!r}"
    return x, None, None


def audio_files(folder: str) -> Iterator[tuple[str, str]]:
    """(path in the folder with / separators, full path) of each audio file, sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.lower().endswith(AUDIO_EXTENSIONS) and not name.startswith("."):
                full = os.path.join(root, name)
                found.append((os.path.relpath(full, folder).replace(os.sep, "/"), full))
    yield from sorted(found)


def _audio_seconds(path: str) -> float:
    """A file's length in seconds from its header: ``wave`` for PCM WAV, else soundfile."""
    if path.lower().endswith(".wav"):
        import wave

        try:
            with wave.open(path, "rb") as f:
                return f.getnframes() / float(f.getframerate())
        except (wave.Error, EOFError):
            pass  # a WAV the standard library does not read (float, extensible): soundfile
    require("soundfile", extra="audio", what=f"reading the length of {path}", error=ManifestError)
    import soundfile

    info = soundfile.info(path)
    return float(info.frames) / float(info.samplerate)


def check_has_records(manifest: Manifest) -> None:
    """Raise :class:`ManifestError` unless ``manifest`` holds a valid record.

    Reads up to the first valid record (all of a manifest with none), reporting nothing:
    the run that follows reports each bad record once.
    """
    manifest._quiet = True
    it = iter(manifest)
    try:
        found = next(it, None)
    finally:
        close = getattr(it, "close", None)
        if callable(close):
            close()
        manifest._quiet = False
    if found is not None:
        return
    what = "audio files" if manifest.format == "folder" else "records"
    if not manifest.skipped:
        raise ManifestError(f"manifest {manifest.path} holds no {what}: nothing to process")
    shown = "; ".join(str(p) for p in manifest.problems[:3])
    more = f"; and {manifest.skipped - 3} more" if manifest.skipped > 3 else ""
    raise ManifestError(
        f"manifest {manifest.path} has no valid record: all {manifest.skipped} of its {what}"
        f" are bad ({shown}{more})"
    )


def _guess_format(path: str) -> str:
    low = path.lower().removesuffix(".gz")
    if low.endswith(".csv"):
        return "csv"
    if low.endswith((".jsonl", ".json", ".ndjson")):
        base = os.path.basename(low)
        if base.startswith("cuts") and available("lhotse"):
            return "lhotse"
        return "jsonl"
    return "jsonl"


def _open_bytes(path: str) -> BinaryIO | io.BufferedIOBase:
    if path.endswith(".gz"):
        import gzip

        return gzip.GzipFile(path, "rb")
    return open(path, "rb", buffering=1 << 20)


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rt", encoding="utf-8-sig", errors="surrogateescape", newline="")
    # Bytes that are not UTF-8 become surrogates, which the reader reports line by line.
    # utf-8-sig drops a leading byte order mark, which would else join the first column's name.
    return open(path, encoding="utf-8-sig", errors="surrogateescape", newline="", buffering=1 << 20)
