"""``ProgressStore``: a durable record of a run over a manifest, one SQLite file.

A processing run over a large manifest commits each batch's outputs (and the
items that failed, with the reason) to a :class:`ProgressStore`. A commit is
one transaction: after a kill, the store holds every batch committed before
it, entirely, and nothing of the batch that was in flight. Re-opening the
store resumes the run: :meth:`ProgressStore.completed` tells which manifest
indices to skip, and recording an index twice is refused, so nothing is lost
and nothing is repeated. :meth:`ProgressStore.export` writes the outputs as
JSON Lines in manifest order or by id, atomically.

The store remembers the manifest (its path, size and modification time) and
the run's config; re-opening it for another manifest or config is refused with
what differs, so the results of two runs never mix.

One process writes a store (the run's main process); other processes may open
it read-only (:meth:`ProgressStore.reader`) while it is written, to show
progress or export what is done so far.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> store = ProgressStore(os.path.join(d, "progress.db"), config={"model": "tiny"})
>>> store.commit([(0, "a", {"text": "hi"}, 2.5), (2, "c", {"text": "yo"}, 1.0)],
...              failures=[(1, "b", "unreadable audio")])
>>> done = store.completed()
>>> [i for i in range(4) if i not in done]
[3]
>>> store.stats()
ProgressStats(done=2, failed=1, seconds=3.5)
>>> exported = store.export(os.path.join(d, "out.jsonl"))
>>> store.close()
>>> print(open(exported.path).read(), end="")
{"id":"a","index":0,"output":{"text":"hi"}}
{"id":"c","index":2,"output":{"text":"yo"}}
>>> print(open(exported.failed_path).read(), end="")
{"id":"b","index":1,"reason":"unreadable audio"}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import operator
import os
import re
import secrets
import sqlite3
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar

from vramctl._version import __version__
from vramctl.batching._adaptive import BatchingError
from vramctl.batching._manifest import audio_files

__all__ = [
    "Completed",
    "Exported",
    "ProgressStats",
    "ProgressStore",
    "RunConflictError",
    "check_writable",
    "failures_path",
]

log = logging.getLogger("vramctl.batching")

#: Version of the tables' layout; a store of another version is refused.
SCHEMA_VERSION = 1
#: Seconds a connection waits for another's lock (a reader's snapshot, a checkpoint).
_BUSY_TIMEOUT = 30.0
#: Conflicting items named in an error message, at most.
_NAMED = 5
#: Indices per ``IN (...)`` query when looking up a batch (under SQLite's variable limit).
_CHUNK = 500

_TABLES = ("run", "done", "failed", "tally")
_SCHEMA = (
    "CREATE TABLE run (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    # idx is the rowid: inserts in manifest order append, lookups are one b-tree probe.
    "CREATE TABLE done (idx INTEGER PRIMARY KEY, id TEXT NOT NULL, output TEXT NOT NULL,"
    " seconds REAL)",
    "CREATE TABLE failed (idx INTEGER PRIMARY KEY, id TEXT NOT NULL, reason TEXT NOT NULL)",
    # Counts kept with each commit (same transaction), so stats() needs no table scan.
    "CREATE TABLE tally (one INTEGER PRIMARY KEY CHECK (one = 1), done INTEGER NOT NULL,"
    " failed INTEGER NOT NULL, seconds REAL NOT NULL)",
    "INSERT INTO tally VALUES (1, 0, 0, 0.0)",
    # An index is recorded once, as done or as failed, never both.
    "CREATE TRIGGER done_once BEFORE INSERT ON done"
    " WHEN EXISTS (SELECT 1 FROM failed WHERE idx = NEW.idx)"
    " BEGIN SELECT RAISE(ABORT, 'index already recorded as failed'); END",
    "CREATE TRIGGER failed_once BEFORE INSERT ON failed"
    " WHEN EXISTS (SELECT 1 FROM done WHERE idx = NEW.idx)"
    " BEGIN SELECT RAISE(ABORT, 'index already recorded as done'); END",
)

Result = tuple[int, str, Any] | tuple[int, str, Any, float]
"""One output: ``(index, id, output)`` or ``(index, id, output, seconds of audio)``."""
Failure = tuple[int, str, str]
"""One failed item: ``(index, id, reason)``."""


class _Indexed(Protocol):
    @property
    def index(self) -> int: ...


_T = TypeVar("_T", bound=_Indexed)


@dataclass(frozen=True)
class ProgressStats:
    """How far a run got: items done, items failed, seconds of audio done."""

    done: int
    failed: int
    seconds: float

    @property
    def recorded(self) -> int:
        """Items done or failed: the ones a resumed run skips."""
        return self.done + self.failed


@dataclass(frozen=True)
class Exported:
    """What :meth:`ProgressStore.export` wrote: two files and their line counts."""

    path: str
    failed_path: str
    done: int
    failed: int


class Completed:
    """The manifest indices a store has recorded (done or failed), as a bitmap.

    ``index in completed`` is one byte lookup; the bitmap takes one bit per
    index up to the largest recorded (1.25 MB for 10M). It is a snapshot,
    taken by :meth:`ProgressStore.completed`: later commits are not in it.
    """

    __slots__ = ("_bits", "done", "failed")

    def __init__(self, bits: bytearray, done: int, failed: int) -> None:
        self._bits = bits
        #: Indices recorded as done.
        self.done = done
        #: Indices recorded as failed.
        self.failed = failed

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int) or index < 0:
            return False
        byte = index >> 3
        return byte < len(self._bits) and bool(self._bits[byte] >> (index & 7) & 1)

    def __len__(self) -> int:
        return self.done + self.failed

    def __repr__(self) -> str:
        return f"Completed(done={self.done}, failed={self.failed})"

    @property
    def nbytes(self) -> int:
        """Size of the bitmap in bytes."""
        return len(self._bits)

    def remaining(self, items: Iterable[_T]) -> Iterator[_T]:
        """The items (anything with an ``index``, e.g. manifest Items) not recorded yet."""
        bits = self._bits
        size = len(bits)
        for item in items:
            i = item.index
            byte = i >> 3
            if i < 0 or byte >= size or not bits[byte] >> (i & 7) & 1:
                yield item


def check_writable(path: str | os.PathLike[str]) -> str:
    """The absolute ``path`` if a file can be written there, else a :class:`BatchingError`.

    Call it before any work, for every file a run will write: the folder must
    exist and take a new file (a probe file is created and removed), and the
    path must not be a folder.
    """
    p = os.path.abspath(os.fspath(path))
    if os.path.isdir(p):
        raise BatchingError(
            f"output {p} is a folder: give a file path, e.g. {os.path.join(p, 'outputs.jsonl')}"
        )
    if os.path.lexists(p) and not os.path.isfile(p):
        raise BatchingError(f"output {p} exists and is not a regular file")
    folder = os.path.dirname(p)
    if not os.path.isdir(folder):
        raise BatchingError(f"output {p}: folder {folder} does not exist; create it first")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".vramctl-probe-")
    except OSError as e:
        raise BatchingError(f"output {p}: cannot write in {folder}: {e.strerror or e}") from e
    os.close(fd)
    os.unlink(probe)
    return p


def failures_path(output_path: str | os.PathLike[str]) -> str:
    """Where :meth:`ProgressStore.export` writes the failures next to ``output_path``.

    >>> failures_path("run/out.jsonl"), failures_path("run/out.txt")
    ('run/out.failed.jsonl', 'run/out.txt.failed.jsonl')
    """
    p = os.fspath(output_path)
    return (p[: -len(".jsonl")] if p.endswith(".jsonl") else p) + ".failed.jsonl"


# Stdlib json rather than orjson: the same bytes and the same accepted values on every
# install (orjson writes NaN as null, refuses non-str keys); serializing a batch's outputs
# is small next to computing them. One encoder, made once (json.dumps with options makes
# one per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_dumps = _ENCODER.encode


def _encode_output(index: int, id_: str, value: Any) -> str:
    try:
        text = _dumps(value)
    except (TypeError, ValueError) as e:
        raise BatchingError(
            f"output of item {id_!r} (index {index}) is not JSON: {e}; convert it first"
            " (tensors and arrays with .tolist(), NaN to None) or record the item as a failure"
        ) from e
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: escape them, still valid JSON
            text = _ASCII_ENCODER.encode(value)
    return text


def _as_index(value: Any, id_: object) -> int:
    if isinstance(value, bool):
        raise BatchingError(f"index of item {id_!r} must be an int, got {value!r}")
    try:
        index = operator.index(value)  # ints, NumPy ints, 0-d integer tensors
    except TypeError:
        raise BatchingError(f"index of item {id_!r} must be an int, got {value!r}") from None
    if index < 0:
        raise BatchingError(f"index of item {id_!r} must be 0 or more, got {index}")
    return index


def _as_id(value: object, index: object) -> str:
    if not isinstance(value, str):
        raise BatchingError(f"id of the item at index {index} must be a str, got {value!r}")
    return value


def _manifest_identity(manifest: str | os.PathLike[str]) -> dict[str, str]:
    path = os.path.realpath(os.fspath(manifest))
    if os.path.isdir(path):
        # A folder of audio files: which files, their sizes and times (the folder's own
        # time changes when an output is written beside them).
        listing = hashlib.blake2b(digest_size=12)
        count = 0
        for rel, full in audio_files(path):
            st = os.stat(full)
            listing.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            count += 1
        return {
            "manifest": path,
            "manifest_size": f"{count} files",
            "manifest_mtime_ns": listing.hexdigest(),
        }
    try:
        st = os.stat(path)
    except OSError as e:
        raise BatchingError(f"manifest {path}: {e.strerror or e}") from e
    return {
        "manifest": path,
        "manifest_size": str(st.st_size),
        "manifest_mtime_ns": str(st.st_mtime_ns),
    }


def _config_json(config: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(config), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise BatchingError(f"config must be JSON-serializable: {e}") from e


def _when(mtime_ns: str | None) -> str:
    if mtime_ns is None:
        return "?"
    stamp = datetime.fromtimestamp(int(mtime_ns) / 1e9, tz=timezone.utc)
    return stamp.isoformat(timespec="microseconds")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _config_differences(stored: str | None, now: str) -> str:
    if stored is None:
        return "config differs: the store records none"
    old, new = _flat(json.loads(stored)), _flat(json.loads(now))
    parts = []
    for key in sorted(old.keys() | new.keys(), key=_first_named):
        if key not in new:
            parts.append(f"{key} dropped (was {_short(old[key])})")
        elif key not in old:
            parts.append(f"{key} added ({_short(new[key])})")
        elif old[key] != new[key]:
            parts.append(f"{key}: {_short(old[key])} in the store, {_short(new[key])} now")
    more = f", and {len(parts) - _NAMED} more" if len(parts) > _NAMED else ""
    return "settings differ: " + ", ".join(parts[:_NAMED]) + more


#: Keys a difference names first: what a user changes on purpose.
_FIRST = ("model.name", "model.source", "model.weights", "output_kind", "manifest")


def _first_named(key: str) -> tuple[int, str]:
    return (_FIRST.index(key) if key in _FIRST else len(_FIRST), key)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (``model.weights``), so a difference names its field."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class RunConflictError(BatchingError):
    """An existing progress store that the run may not continue.

    ``differences`` names what changed since the stored run began (the manifest, the
    model, a setting); empty when a fresh run was asked for and the store holds one.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str,
        done: int,
        failed: int,
        differences: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.done = done
        self.failed = failed
        self.differences = list(differences or [])


class ProgressStore:
    """The durable progress record of a run over a manifest (one SQLite file).

    Opening (``ProgressStore(path, ...)`` or, the same, :meth:`open`):

    - no file at ``path``: a new store is made, recording ``manifest`` (its
      path, size and modification time) and ``config`` (a JSON-serializable
      mapping);
    - ``resume=True`` (the default): an existing store is continued. If it
      holds results, the ``manifest`` and ``config`` given must be the ones it
      records, else :class:`BatchingError` says what differs (one left as
      None is not checked). A store with no results takes the new ones;
    - ``resume=False``: a fresh run is wanted. An existing store holding
      results is refused, unless ``overwrite=True``, which discards them.

    :meth:`reader` (or ``readonly=True``) opens a store read-only, for a
    progress viewer or an export from another process while the run writes.

    One process writes a store: the run's main process. A connection must not
    cross a fork; threads of the writer may share it (calls are serialized).
    Readers keep no lasting lock: a long read only delays the shrinking of
    the write-ahead log.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        manifest: str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | None = None,
        resume: bool = True,
        overwrite: bool = False,
        readonly: bool = False,
    ) -> None:
        if resume and overwrite:
            raise BatchingError(
                "resume=True and overwrite=True contradict: resume continues the stored run,"
                " overwrite discards it (pass resume=False, overwrite=True to start over)"
            )
        if readonly and overwrite:
            raise BatchingError("a read-only store cannot be overwritten")
        #: The store's file (absolute).
        self.path = os.path.abspath(os.fspath(path))
        #: True when opened read-only.
        self.readonly = readonly
        self._lock = threading.RLock()
        identity = _manifest_identity(manifest) if manifest is not None else None
        config_json = _config_json(config) if config is not None else None
        if os.path.isdir(self.path):
            raise BatchingError(f"progress store {self.path} is a folder: give a file path")
        self._conn = self._connect()
        try:
            meta = self._setup(identity, config_json, resume=resume, overwrite=overwrite)
        except BaseException:
            self._conn.close()
            raise
        self._meta = meta
        self._closed = False

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        manifest: str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | None = None,
        resume: bool = True,
        overwrite: bool = False,
    ) -> ProgressStore:
        """Open (or make) the store at ``path`` for writing; see the class for the rules."""
        return cls(path, manifest=manifest, config=config, resume=resume, overwrite=overwrite)

    @classmethod
    def reader(cls, path: str | os.PathLike[str]) -> ProgressStore:
        """Open an existing store read-only (works while another process writes it)."""
        return cls(path, readonly=True)

    # -- opening -------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        try:
            if self.readonly:
                if not os.path.isfile(self.path):
                    raise BatchingError(f"no progress store at {self.path}")
                uri = Path(self.path).as_uri() + "?mode=ro"
                conn = sqlite3.connect(
                    uri,
                    uri=True,
                    timeout=_BUSY_TIMEOUT,
                    isolation_level=None,
                    check_same_thread=False,
                )
                conn.execute("PRAGMA query_only = ON")
                return conn
            if not os.path.exists(self.path):
                check_writable(self.path)
            conn = sqlite3.connect(
                self.path, timeout=_BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
            )
            try:
                # WAL: a commit appends to the log, readers in other processes keep reading
                # a consistent snapshot meanwhile, and a transaction cut short by a kill is
                # simply not in the log's committed part when the file is next opened.
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    log.warning(
                        "progress store %s: the file system refused WAL (journal %s); commits"
                        " stay atomic, but readers will wait for the writer",
                        self.path,
                        mode,
                    )
                # synchronous=NORMAL: in WAL mode a commit's pages are written (write(2)) to
                # the log before commit() returns, so they survive the death of the process
                # (SIGKILL, OOM killer): the kernel holds them. Only an OS crash or power
                # loss can drop the last commits before a checkpoint's fsync, and even then
                # the file stays consistent: those batches are simply not recorded, and the
                # resumed run does them again. Outputs live only in this store, so nothing
                # is repeated either. FULL would fsync every batch for no gain in that
                # guarantee.
                conn.execute("PRAGMA synchronous = NORMAL")
            except BaseException:
                conn.close()
                raise
            return conn
        except sqlite3.DatabaseError as e:
            raise BatchingError(
                f"{self.path} cannot be opened as a vramctl progress store ({e}); pass another path"
            ) from e

    def _setup(
        self,
        identity: dict[str, str] | None,
        config_json: str | None,
        *,
        resume: bool,
        overwrite: bool,
    ) -> dict[str, str]:
        conn = self._conn
        try:
            conn.execute("BEGIN" if self.readonly else "BEGIN IMMEDIATE")
            try:
                meta = self._setup_in_transaction(
                    identity, config_json, resume=resume, overwrite=overwrite
                )
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            raise BatchingError(
                f"{self.path} cannot be opened as a vramctl progress store ({e}); pass another path"
            ) from e
        return meta

    def _setup_in_transaction(
        self,
        identity: dict[str, str] | None,
        config_json: str | None,
        *,
        resume: bool,
        overwrite: bool,
    ) -> dict[str, str]:
        conn = self._conn
        tables = {
            name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        if not tables:
            if self.readonly:
                raise BatchingError(f"{self.path} is an empty database, not a progress store")
            return self._create(identity, config_json)
        if not set(_TABLES) <= tables:
            raise BatchingError(
                f"{self.path} is not a vramctl progress store (it holds tables"
                f" {', '.join(sorted(tables))}); pass another path"
            )
        meta = dict(conn.execute("SELECT key, value FROM run").fetchall())
        schema = meta.get("schema")
        if schema != str(SCHEMA_VERSION):
            raise BatchingError(
                f"progress store {self.path} has layout version {schema}, this vramctl"
                f" ({__version__}) reads version {SCHEMA_VERSION}: finish the run with the"
                " vramctl that began it, or delete the file to start over"
            )
        done, failed = conn.execute("SELECT done, failed FROM tally").fetchone()
        if overwrite:
            log.info("progress store %s: discarding %d done, %d failed", self.path, done, failed)
            for table in _TABLES:
                conn.execute(f"DROP TABLE {table}")
            return self._create(identity, config_json)
        if done + failed == 0:
            if self.readonly:
                return meta
            # Nothing recorded yet: nothing to mix up, the store takes this run's identity.
            return self._write_meta(identity, config_json, keep=meta)
        if not resume:
            raise RunConflictError(
                f"progress store {self.path} already holds a run ({done} done, {failed} failed):"
                " continue it (resume=True), discard it (overwrite=True, or delete the file),"
                " or give a new output path",
                path=self.path,
                done=done,
                failed=failed,
            )
        differences = self._differences(meta, identity, config_json)
        if differences:
            raise RunConflictError(
                f"progress store {self.path} belongs to a different run ({done} done, {failed}"
                f" failed): {'; '.join(differences)}. To start over, discard it"
                " (resume=False, overwrite=True, or delete the file) or give a new output"
                " path; to continue it, use the manifest, model and settings it was made with",
                path=self.path,
                done=done,
                failed=failed,
                differences=differences,
            )
        return meta

    def _create(self, identity: dict[str, str] | None, config_json: str | None) -> dict[str, str]:
        for statement in _SCHEMA:
            self._conn.execute(statement)
        return self._write_meta(identity, config_json, keep={})

    def _write_meta(
        self, identity: dict[str, str] | None, config_json: str | None, *, keep: dict[str, str]
    ) -> dict[str, str]:
        meta = {
            "schema": str(SCHEMA_VERSION),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "vramctl": __version__,
        }
        # A store opened again with no manifest (or config) keeps the one it records.
        for key in ("manifest", "manifest_size", "manifest_mtime_ns"):
            value = identity[key] if identity is not None else keep.get(key)
            if value is not None:
                meta[key] = value
        config = config_json if config_json is not None else keep.get("config")
        if config is not None:
            meta["config"] = config
        self._conn.execute("DELETE FROM run")
        self._conn.executemany("INSERT INTO run VALUES (?, ?)", meta.items())
        return meta

    def _differences(
        self, meta: dict[str, str], identity: dict[str, str] | None, config_json: str | None
    ) -> list[str]:
        out: list[str] = []
        if identity is not None:
            stored = meta.get("manifest")
            if stored != identity["manifest"]:
                out.append(
                    f"manifest path differs: {stored or 'none'} in the store,"
                    f" {identity['manifest']} now"
                )
            else:
                changes = []
                old_size, new_size = meta.get("manifest_size"), identity["manifest_size"]
                if old_size != new_size:
                    changes.append(f"size {old_size} -> {new_size} bytes")
                old_mtime, new_mtime = meta.get("manifest_mtime_ns"), identity["manifest_mtime_ns"]
                if old_mtime != new_mtime:
                    changes.append(f"modified {_when(old_mtime)} -> {_when(new_mtime)}")
                if changes:
                    out.append(
                        f"manifest {stored} changed since the run began ({', '.join(changes)})"
                    )
        if config_json is not None and meta.get("config") != config_json:
            out.append(_config_differences(meta.get("config"), config_json))
        return out

    # -- state ---------------------------------------------------------------------------

    @property
    def manifest(self) -> str | None:
        """The manifest path the store records (None: none was given)."""
        return self._meta.get("manifest")

    @property
    def config(self) -> dict[str, Any] | None:
        """The config the store records (None: none was given)."""
        text = self._meta.get("config")
        return None if text is None else dict(json.loads(text))

    @property
    def created(self) -> str:
        """When the run began (ISO 8601, UTC)."""
        return self._meta["created"]

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("read-only" if self.readonly else "open")
        return f"ProgressStore({self.path!r}, {state})"

    def __enter__(self) -> ProgressStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the store (committed batches are already safe); closing twice is fine."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """The connection, in a read transaction: every query sees the same snapshot."""
        with self._lock:
            self._check_open()
            self._conn.execute("BEGIN")
            try:
                yield self._conn
            finally:
                self._conn.execute("COMMIT")

    def _check_open(self) -> None:
        if self._closed:
            raise BatchingError(f"progress store {self.path} is closed")

    def _check_writer(self) -> None:
        self._check_open()
        if self.readonly:
            raise BatchingError(f"progress store {self.path} is open read-only")

    # -- writing -------------------------------------------------------------------------

    def commit(self, results: Sequence[Result], failures: Sequence[Failure] = ()) -> None:
        """Record one batch: its outputs and its failures, all or nothing.

        ``results`` are ``(index, id, output)`` or ``(index, id, output,
        seconds)`` tuples (index: the item's position in the manifest; output:
        any JSON-serializable value; seconds: the item's audio length, summed
        by :meth:`stats`). ``failures`` are ``(index, id, reason)``. An index
        recorded before (done or failed), or twice in the batch, makes the
        whole batch fail with a :class:`BatchingError` naming it, and nothing
        of the batch is recorded.
        """
        self._check_writer()
        done_rows: list[tuple[int, str, str, float | None]] = []
        seconds_total = 0.0
        for entry in results:
            if len(entry) not in (3, 4):
                raise BatchingError(
                    "a result is (index, id, output) or (index, id, output, seconds),"
                    f" got {entry!r}"
                )
            index, id_ = _as_index(entry[0], entry[1]), _as_id(entry[1], entry[0])
            seconds: float | None = None
            if len(entry) == 4:
                try:
                    seconds = float(entry[3])
                except (TypeError, ValueError):
                    raise BatchingError(
                        f"seconds of item {id_!r} must be a number, got {entry[3]!r}"
                    ) from None
                seconds_total += seconds
            done_rows.append((index, id_, _encode_output(index, id_, entry[2]), seconds))
        failed_rows: list[tuple[int, str, str]] = []
        for failure in failures:
            if len(failure) != 3:
                raise BatchingError(f"a failure is (index, id, reason), got {failure!r}")
            index, id_ = _as_index(failure[0], failure[1]), _as_id(failure[1], failure[0])
            reason = str(failure[2])
            if not reason.isascii():  # e.g. a path decoded with surrogateescape
                reason = reason.encode("utf-8", "backslashreplace").decode("utf-8")
            failed_rows.append((index, id_, reason))
        if not done_rows and not failed_rows:
            return
        with self._lock:
            self._check_writer()
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    conn.executemany("INSERT INTO done VALUES (?, ?, ?, ?)", done_rows)
                    conn.executemany("INSERT INTO failed VALUES (?, ?, ?)", failed_rows)
                    conn.execute(
                        "UPDATE tally SET done = done + ?, failed = failed + ?,"
                        " seconds = seconds + ?",
                        (len(done_rows), len(failed_rows), seconds_total),
                    )
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.IntegrityError as e:
                raise BatchingError(
                    f"progress store {self.path}: nothing of this batch was recorded: "
                    f"{self._conflicts(done_rows, failed_rows) or e}. Skip the indices in"
                    " store.completed() before processing a batch"
                ) from e
            except (sqlite3.Error, UnicodeEncodeError) as e:
                raise BatchingError(
                    f"progress store {self.path}: commit failed, nothing of this batch was"
                    f" recorded: {e}"
                ) from e

    def _conflicts(
        self, done_rows: list[tuple[int, str, str, float | None]], failed_rows: list[Failure]
    ) -> str:
        """Why a batch was refused: indices twice in it, or recorded before."""
        ids: dict[int, str] = {}
        problems: list[str] = []
        pairs = [(row[0], row[1]) for row in done_rows] + [(row[0], row[1]) for row in failed_rows]
        for index, id_ in pairs:
            if index in ids:
                problems.append(f"item {id_!r} (index {index}) is in the batch twice")
            ids[index] = id_
        indices = sorted(ids)
        for start in range(0, len(indices), _CHUNK):
            chunk = indices[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            rows = self._conn.execute(
                f"SELECT idx, id, 'done' FROM done WHERE idx IN ({marks}) UNION ALL"
                f" SELECT idx, id, 'failed' FROM failed WHERE idx IN ({marks})",
                chunk + chunk,
            ).fetchall()
            for index, stored_id, table in rows:
                problems.append(
                    f"item {ids[index]!r} (index {index}) is already recorded as {table}"
                    + (f" (as {stored_id!r})" if stored_id != ids[index] else "")
                )
            if len(problems) > _NAMED:
                break
        more = ", and more" if len(problems) > _NAMED else ""
        return "; ".join(problems[:_NAMED]) + more

    def clear_failures(self) -> int:
        """Forget the failed items (so a resumed run tries them again); returns how many."""
        with self._lock:
            self._check_writer()
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                count = conn.execute("DELETE FROM failed").rowcount
                conn.execute("UPDATE tally SET failed = 0")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return int(count)

    # -- reading -------------------------------------------------------------------------

    def completed(self) -> Completed:
        """The indices recorded (done or failed), as a bitmap, with the counts.

        Streamed from the file: memory is the bitmap (one bit per index up to
        the largest), not a set of 10M ints.
        """
        with self._reading() as conn:
            top = conn.execute(
                "SELECT max(m) FROM (SELECT max(idx) AS m FROM done"
                " UNION ALL SELECT max(idx) FROM failed)"
            ).fetchone()[0]
            bits = bytearray(0 if top is None else (top >> 3) + 1)
            counts = []
            for table in ("done", "failed"):
                count = 0
                for (i,) in conn.execute(f"SELECT idx FROM {table}"):
                    bits[i >> 3] |= 1 << (i & 7)
                    count += 1
                counts.append(count)
        return Completed(bits, counts[0], counts[1])

    def stats(self) -> ProgressStats:
        """Items done, items failed, and the seconds of audio done (no table scan)."""
        with self._reading() as conn:
            done, failed, seconds = conn.execute(
                "SELECT done, failed, seconds FROM tally"
            ).fetchone()
        return ProgressStats(int(done), int(failed), float(seconds))

    def output(self, index: int) -> Any:
        """The recorded output of the item at manifest ``index`` (KeyError: not done)."""
        with self._reading() as conn:
            row = conn.execute("SELECT output FROM done WHERE idx = ?", (index,)).fetchone()
        if row is None:
            raise KeyError(index)
        return json.loads(row[0])

    def export(
        self,
        output_path: str | os.PathLike[str],
        *,
        order: Literal["manifest", "id"] = "manifest",
        format: Literal["jsonl"] = "jsonl",
    ) -> Exported:
        """Write the outputs done as JSON Lines, and the failures next to them.

        Each line of ``output_path`` is ``{"id": ..., "index": ..., "output":
        ...}``, in manifest order (``order="manifest"``) or by id (``"id"``,
        code-point order, ties by index); the failures go to
        :func:`failures_path` as ``{"id": ..., "index": ..., "reason": ...}``
        (an empty file when none failed). Rows are streamed from the store
        (constant memory) into temporary files in the same folders, which then
        replace the targets (failures first): a reader never sees half a file.
        Both files come from one snapshot, so a read-only store may export
        while the run writes.
        """
        if format != "jsonl":
            raise BatchingError(f"export format must be 'jsonl', got {format!r}")
        if order not in ("manifest", "id"):
            raise BatchingError(f"export order must be 'manifest' or 'id', got {order!r}")
        out = check_writable(output_path)
        failed_out = check_writable(failures_path(out))
        own = {os.path.realpath(self.path + suffix) for suffix in ("", "-wal", "-shm")}
        for target in (out, failed_out):
            if os.path.realpath(target) in own:
                raise BatchingError(f"export to {target} would overwrite the progress store")
        sort = "idx" if order == "manifest" else "id, idx"
        for target in (out, failed_out):
            _remove_stale_temps(target)
        temps: list[str] = []
        try:
            with self._reading() as conn:
                rows = conn.execute(f"SELECT id, idx, output FROM done ORDER BY {sort}")
                done_tmp, done = _write_temp(out, rows, _done_line)
                temps.append(done_tmp)
                rows = conn.execute(f"SELECT id, idx, reason FROM failed ORDER BY {sort}")
                failed_tmp, failed = _write_temp(failed_out, rows, _failed_line)
                temps.append(failed_tmp)
            os.replace(failed_tmp, failed_out)
            os.replace(done_tmp, out)
        except OSError as e:
            raise BatchingError(f"export to {out} failed: {e}") from e
        finally:
            for temp in temps:
                if os.path.exists(temp):
                    os.unlink(temp)
        return Exported(out, failed_out, done, failed)


def _done_line(id_: str, index: int, output: str) -> str:
    return f'{{"id":{_dumps(id_)},"index":{index},"output":{output}}}\n'


def _failed_line(id_: str, index: int, reason: str) -> str:
    return f'{{"id":{_dumps(id_)},"index":{index},"reason":{_dumps(reason)}}}\n'


def _remove_stale_temps(target: str) -> None:
    """Remove the temporary files of exports to ``target`` by processes no longer alive.

    An export killed before its rename leaves its temporary file (as big as the
    output) behind; the next export to the same target removes it. A file of a
    live process (another export running now) is left alone.
    """
    folder, name = os.path.split(target)
    pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, entry))
            log.info("removed %s, left by an export that was cut short", entry)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError):
        return True  # another user's process, or cannot tell: keep the file
    return True


def _write_temp(
    target: str, rows: Iterable[tuple[str, int, str]], line: Callable[[str, int, str], str]
) -> tuple[str, int]:
    """Write one line per row to a new temporary file next to ``target``: its path, the count."""
    folder, name = os.path.split(target)
    while True:
        temp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            # Mode 0o666 less the umask, as for any new file (mkstemp would make it 0o600).
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for id_, index, value in rows:
                f.write(line(id_, index, value))
                count += 1
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
    except BaseException:
        os.unlink(temp)
        raise
    return temp, count
