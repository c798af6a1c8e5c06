"""The job store: every job, its state and its history, in one SQLite file.

The embedded default is ``$VRAMCTL_HOME/jobs.db`` (``$VRAMCTL_HOME`` defaults to
``$XDG_DATA_HOME/vramctl``, else ``~/.local/share/vramctl``). The file is in WAL mode, so
the scheduler, each job's supervisor and the CLI read and write it from their own
processes at once; a commit is in the log before it returns, so a process killed with
``kill -9`` loses nothing it committed.

A job moves ``queued → admitted → running → succeeded | failed | cancelled | timed-out``
(and ``admitted`` or ``running`` back to ``queued`` when it is retried). Every move is a
compare-and-set on the state it leaves (:meth:`JobStore.move`): two processes that race
for the same move cannot both win, so no job is admitted or run twice. A job holds its
reservation while it is ``admitted`` or ``running``, and only then: the ledger is read
from the store, so a reservation is released by whatever ends the job.
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vramctl._errors import VramctlError
from vramctl.jobs._spec import JobSpec
from vramctl.jobs._supervise import LEARN_SQL

__all__ = [
    "ACTIVE",
    "FINISHED",
    "STATES",
    "Job",
    "JobStore",
    "JobStoreError",
    "vramctl_home",
    "wait_finished",
]

#: Environment variable naming vramctl's data directory (the store, the jobs' logs).
ENV_HOME = "VRAMCTL_HOME"
STATES = ("queued", "admitted", "running", "succeeded", "failed", "cancelled", "timed-out")
#: States that hold a reservation.
ACTIVE = ("admitted", "running")
FINISHED = ("succeeded", "failed", "cancelled", "timed-out")
_BUSY_TIMEOUT = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    priority INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    admitted_at REAL,
    started_at REAL,
    finished_at REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    device TEXT,
    reserved_bytes INTEGER,
    batch_size INTEGER,
    grad_accum INTEGER,
    exit_code INTEGER,
    reason TEXT,
    peak_bytes INTEGER,
    log_path TEXT,
    supervisor_pid INTEGER,
    supervisor_started REAL,
    pid INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    pid_started REAL,
    need_bytes INTEGER,
    overruns INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, priority, seq);
-- A page of one state in submission order (GET /jobs?state=...&limit=): read in order.
CREATE INDEX IF NOT EXISTS jobs_state_seq ON jobs (state, seq);
CREATE TABLE IF NOT EXISTS learned (
    name TEXT PRIMARY KEY,
    peak_bytes INTEGER NOT NULL,
    runs INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
"""


class JobStoreError(VramctlError):
    """A store that cannot be opened, or a job that is not in it (or an id prefix that
    names several: their ids are in ``matches``)."""

    #: The ids an ambiguous prefix matched (empty for every other error).
    matches: tuple[str, ...] = ()


#: The shortest id prefix that names a job (as git's short hashes).
MIN_PREFIX = 4


def vramctl_home() -> Path:
    """vramctl's data directory: ``$VRAMCTL_HOME``, else ``$XDG_DATA_HOME/vramctl``, else
    ``~/.local/share/vramctl``."""
    if os.environ.get(ENV_HOME):
        return Path(os.environ[ENV_HOME]).expanduser()
    if os.environ.get("XDG_DATA_HOME"):
        return Path(os.environ["XDG_DATA_HOME"]) / "vramctl"
    return Path.home() / ".local" / "share" / "vramctl"


def _owner_only(path: Path, mode: int, *, create: bool = False) -> None:
    """Give ``path`` (a store file, 0600, or folder, 0700) ``mode``, making it where
    ``create`` and it is missing. Another user's file is refused: a store is one user's."""
    if create and not path.exists():
        if mode == 0o700:
            path.mkdir(mode=0o700)
        else:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if st.st_uid != os.getuid():
        raise OSError(
            f"{path} belongs to another user (uid {st.st_uid}); a job store must be its owner's"
            " alone"
        )
    if st.st_mode & 0o777 != mode:
        path.chmod(mode)


def _logs_owner_only(logs: Path) -> None:
    """Logs an older store made readable by others are made owner-only."""
    with os.scandir(logs) as entries:
        for e in entries:
            if e.is_file(follow_symlinks=False) and e.stat().st_mode & 0o077:
                os.chmod(e.path, 0o600)


@dataclass(frozen=True)
class Job:
    """One row of the store: the spec and everything that happened to it."""

    seq: int
    id: str
    name: str
    spec: JobSpec
    state: str
    priority: int
    submitted_at: float
    admitted_at: float | None
    started_at: float | None
    finished_at: float | None
    attempts: int
    device: str | None
    reserved_bytes: int | None
    batch_size: int | None
    grad_accum: int | None
    exit_code: int | None
    reason: str | None
    peak_bytes: int | None
    log_path: str | None
    supervisor_pid: int | None
    supervisor_started: float | None
    pid: int | None
    cancel_requested: bool
    #: When the job's process (``pid``, its group's leader) started (``psutil``'s
    #: ``create_time``): a pid reused by another process is told apart by it.
    pid_started: float | None = None
    #: What the job needs at least on its next attempt, learned from the last one's
    #: overrun (see :func:`vramctl.jobs.overrun_need`); None: its spec's need.
    need_bytes: int | None = None
    #: Times it used more memory than its share and was queued again.
    overruns: int = 0

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (the spec as its own dict)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["spec"] = self.spec.to_dict()
        return out


_COLUMNS = tuple(f.name for f in fields(Job))
#: Columns added to the jobs table since its first version, and their definitions.
_ADDED_COLUMNS = {
    "pid_started": "REAL",
    "need_bytes": "INTEGER",
    "overruns": "INTEGER NOT NULL DEFAULT 0",
}
_SETTABLE = frozenset(_COLUMNS) - {"seq", "id", "name", "spec", "submitted_at"}


class JobStore:
    """The jobs of one store file. Open one per process (connections are not shared).

    >>> import tempfile, os
    >>> from vramctl.jobs import JobSpec, MemoryNeed
    >>> store = JobStore(os.path.join(tempfile.mkdtemp(), "jobs.db"))
    >>> spec = JobSpec(name="demo", command=("true",), memory=MemoryNeed.of_size("1GiB"))
    >>> job = store.submit(spec)
    >>> store.get(job.id).state
    'queued'
    >>> store.move(job.id, "queued", "admitted", device="cpu")
    True
    >>> store.move(job.id, "queued", "admitted", device="cpu")  # already moved: refused
    False
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else vramctl_home() / "jobs.db"
        # Absolute: a job's log path is read by processes started elsewhere (a relative
        # --store once stored relative log paths).
        self.logs_dir = self.path.absolute().parent / "logs"
        try:
            if not self.path.parent.exists():
                self.path.parent.mkdir(parents=True, mode=0o700)
            # Owner-only before SQLite opens it: its -wal and -shm take the database's mode.
            # A job's secret environment is in the database and its output in its log, and
            # anyone who can open the lock or shared-memory file can stop the queue.
            _owner_only(self.path, 0o600, create=True)
            _owner_only(self.logs_dir, 0o700, create=True)
            self._conn = sqlite3.connect(
                self.path, timeout=_BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
            )
            self._conn.execute("PRAGMA journal_mode = WAL")
            # In WAL mode a commit is written to the log before it returns: a process
            # killed (SIGKILL) after it loses nothing; only an OS crash can drop the last.
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._conn.executescript(_SCHEMA)
            self._add_columns()
            for side in ("-wal", "-shm", ".lock"):
                _owner_only(Path(f"{self.path}{side}"), 0o600)
            _logs_owner_only(self.logs_dir)
        except (OSError, sqlite3.DatabaseError) as e:
            raise JobStoreError(
                f"cannot open the job store {self.path}: {e}; set $VRAMCTL_HOME or pass another"
                " path"
            ) from e

    def _add_columns(self) -> None:
        """Give a store made by an earlier version the columns added since."""
        if _ADDED_COLUMNS.keys() <= self._columns():
            return
        with self._write() as c:  # one process adds them; the others find them added
            for name in _ADDED_COLUMNS.keys() - self._columns():
                c.execute(f"ALTER TABLE jobs ADD COLUMN {name} {_ADDED_COLUMNS[name]}")

    def _columns(self) -> set[str]:
        return {row[1] for row in self._conn.execute("PRAGMA table_info(jobs)")}

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def admission_lock(self) -> Iterator[None]:
        """Held by a scheduler while it reads the ledger and admits: one at a time per
        store, across processes (an advisory lock on ``<store>.lock``)."""
        import fcntl

        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # -- jobs ------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> Job:
        """Queue ``spec``; returns the new job (state ``queued``)."""
        job_id = secrets.token_hex(6)
        with self._write() as c:
            c.execute(
                "INSERT INTO jobs (id, name, spec, state, priority, submitted_at, log_path)"
                " VALUES (?, ?, ?, 'queued', ?, ?, ?)",
                (
                    job_id,
                    spec.name,
                    spec.to_json(indent=None),
                    spec.priority,
                    time.time(),
                    str(self.logs_dir / f"{job_id}.log"),
                ),
            )
        return self.get(job_id)

    def get(self, job_id: str) -> Job:
        """The job ``job_id``, or the one job whose id starts with it (at least
        :data:`MIN_PREFIX` characters, as git takes a short hash); :class:`JobStoreError`
        if there is none, or if the prefix starts several ids (it lists them)."""
        select = f"SELECT {', '.join(_COLUMNS)} FROM jobs"
        row = self._conn.execute(f"{select} WHERE id = ?", (job_id,)).fetchone()
        if row is not None:
            return _job(row)
        prefix = job_id.strip().lower()
        if len(prefix) >= MIN_PREFIX:
            rows = self._conn.execute(
                f"{select} WHERE substr(id, 1, ?) = ? ORDER BY seq LIMIT 11",
                (len(prefix), prefix),
            ).fetchall()
            if len(rows) == 1:
                return _job(rows[0])
            if rows:
                found = [_job(r) for r in rows]
                shown = ", ".join(f"{j.id} ({j.name})" for j in found[:10])
                more = " and more" if len(found) > 10 else ""
                error = JobStoreError(
                    f"job id {job_id!r} is ambiguous: it matches {shown}{more}; give more of it"
                )
                error.matches = tuple(j.id for j in found)
                raise error
        elif prefix:
            raise JobStoreError(
                f"no job {job_id!r} in {self.path}: give at least {MIN_PREFIX} characters of its id"
            )
        raise JobStoreError(f"no job {job_id!r} in {self.path}")

    def list(
        self,
        states: Sequence[str] | None = None,
        *,
        label: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[Job]:
        """Jobs in submission order, optionally only those in ``states`` and with ``label``
        (``key`` or ``key=value``); ``offset`` and ``limit`` page them in SQL, so that a
        page is read (and its specs parsed) without the rest of the store."""
        where, args = _filter(states, label)
        sql = f"SELECT {', '.join(_COLUMNS)} FROM jobs{where} ORDER BY seq"
        if limit is not None or offset:
            sql += " LIMIT ? OFFSET ?"
            args += [-1 if limit is None else _sql_int(limit), _sql_int(offset)]
        return [_job(r) for r in self._conn.execute(sql, args)]

    def count(self, states: Sequence[str] | None = None, *, label: str | None = None) -> int:
        """How many jobs :meth:`list` would give without a limit (read in SQL alone)."""
        where, args = _filter(states, label)
        (n,) = self._conn.execute(f"SELECT COUNT(*) FROM jobs{where}", args).fetchone()
        return int(n)

    def latest(self, states: Sequence[str], limit: int) -> builtins.list[Job]:
        """The last ``limit`` jobs in ``states`` to finish, the latest first (by
        ``finished_at``, then submission): what ended recently, read without the rest."""
        bad = [s for s in states if s not in STATES]
        if bad:
            raise JobStoreError(f"unknown job state {bad[0]!r}; states: {', '.join(STATES)}")
        if not states or limit <= 0:
            return []
        sql = (
            f"SELECT {', '.join(_COLUMNS)} FROM jobs"
            f" WHERE state IN ({', '.join('?' * len(states))})"
            " ORDER BY finished_at IS NULL, finished_at DESC, seq DESC LIMIT ?"
        )
        return [_job(r) for r in self._conn.execute(sql, [*states, int(limit)])]

    def keys(self, states: Sequence[str]) -> builtins.list[tuple[str, int, int, float, int]]:
        """``(id, attempts, priority, submitted_at, seq)`` of the jobs in ``states``, in
        submission order: a cheap look at a queue whose jobs the caller already holds
        (attempts change when a job is queued again)."""
        sql = (
            "SELECT id, attempts, priority, submitted_at, seq FROM jobs"
            f" WHERE state IN ({', '.join('?' * len(states))}) ORDER BY seq"
        )
        return [
            (str(i), int(n), int(p), float(t), int(q))
            for i, n, p, t, q in self._conn.execute(sql, list(states))
        ]

    def get_many(self, ids: Sequence[str]) -> builtins.list[Job]:
        """The jobs ``ids`` that exist, in submission order."""
        out: builtins.list[Job] = []
        for k in range(0, len(ids), 500):  # SQLite's limit on a statement's parameters
            chunk = list(ids[k : k + 500])
            out += [
                _job(r)
                for r in self._conn.execute(
                    f"SELECT {', '.join(_COLUMNS)} FROM jobs"
                    f" WHERE id IN ({', '.join('?' * len(chunk))}) ORDER BY seq",
                    chunk,
                )
            ]
        return sorted(out, key=lambda j: j.seq)

    def move(self, job_id: str, from_states: str | Sequence[str], to: str, **values: Any) -> bool:
        """Move ``job_id`` to state ``to`` if it is in ``from_states`` now, setting
        ``values`` in the same commit; False (nothing changed) if it was not."""
        if to not in STATES:
            raise JobStoreError(f"unknown job state {to!r}")
        froms = (from_states,) if isinstance(from_states, str) else tuple(from_states)
        bad = set(values) - _SETTABLE
        if bad:
            raise JobStoreError(f"not a job field: {sorted(bad)[0]}")
        sets = ", ".join(["state = ?", *(f"{k} = ?" for k in values)])
        with self._write() as c:
            cur = c.execute(
                f"UPDATE jobs SET {sets} WHERE id = ? AND state IN ({', '.join('?' * len(froms))})",
                (to, *values.values(), job_id, *froms),
            )
            return cur.rowcount == 1

    def update(self, job_id: str, **values: Any) -> None:
        """Set ``values`` on ``job_id`` whatever its state (readings: peak, pids)."""
        bad = set(values) - _SETTABLE - {"state"}
        if bad or not values:
            raise JobStoreError(f"not a job field: {sorted(bad)[0] if bad else '(none)'}")
        with self._write() as c:
            c.execute(
                f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ?",
                (*values.values(), job_id),
            )

    def cancel(self, job_id: str) -> Job:
        """Cancel ``job_id``: a queued job is cancelled at once; an admitted or running one
        is marked, and its supervisor stops it. A finished job is left as it is."""
        job = self.get(job_id)
        job_id = job.id  # the whole id, where a prefix was given
        if self.move(job_id, "queued", "cancelled", finished_at=time.time(), reason="cancelled"):
            return self.get(job_id)
        if job.state in ACTIVE:
            self.update(job_id, cancel_requested=1)
        return self.get(job_id)

    def queue_delays(self) -> builtins.list[float]:
        """Seconds from submission to the (last) admission, for every job admitted."""
        rows = self._conn.execute(
            "SELECT admitted_at - submitted_at FROM jobs WHERE admitted_at IS NOT NULL"
        )
        return [max(0.0, float(d)) for (d,) in rows]

    def counts(self) -> dict[str, int]:
        """The number of jobs in each state."""
        out = dict.fromkeys(STATES, 0)
        for state, n in self._conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
            out[state] = n
        return out

    # -- learned peaks ---------------------------------------------------------------

    def learn(self, name: str, peak_bytes: int) -> None:
        """Record a finished run's measured peak for the job name (the largest is kept)."""
        with self._write() as c:
            c.execute(LEARN_SQL, (name, int(peak_bytes), time.time()))

    def learned_peak(self, name: str) -> int | None:
        """The largest peak recorded for runs of the job name, or None before the first."""
        row = self._conn.execute("SELECT peak_bytes FROM learned WHERE name = ?", (name,))
        found = row.fetchone()
        return None if found is None else int(found[0])


def wait_finished(
    get: Callable[[str], Job], job_id: str, timeout: float | None, poll: float
) -> Job:
    """``get(job_id)`` once the job has ended; :class:`TimeoutError` after ``timeout`` s
    (what :meth:`Queue.wait` and :meth:`JobClient.wait` share)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        job = get(job_id)
        if job.finished:
            return job
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} is still {job.state} after {timeout:g} s")
        time.sleep(poll)


def _filter(states: Sequence[str] | None, label: str | None) -> tuple[str, list[Any]]:
    """The ``WHERE`` clause (empty, or starting with a space) and its arguments for jobs in
    ``states`` with ``label`` (``key`` or ``key=value``, matched in the stored spec)."""
    clauses: list[str] = []
    args: list[Any] = []
    if states is not None:
        bad = [s for s in states if s not in STATES]
        if bad:
            raise JobStoreError(f"unknown job state {bad[0]!r}; states: {', '.join(STATES)}")
        clauses.append(f"state IN ({', '.join('?' * len(states))})")
        args += list(states)
    if label is not None:
        try:
            label.encode()
        except UnicodeEncodeError:  # a lone surrogate: no stored label is one
            return " WHERE 0", []
        key, has_value, value = label.partition("=")
        clauses.append(
            "EXISTS (SELECT 1 FROM json_each(jobs.spec, '$.labels') AS l WHERE l.key = ?"
            + (" AND l.value = ?)" if has_value and value else ")")
        )
        args += [key, value] if has_value and value else [key]
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), args


def _sql_int(n: int) -> int:
    """``n`` held to 0 .. SQLite's largest integer (an offset past it finds nothing)."""
    return min(max(0, int(n)), 2**63 - 1)


@functools.lru_cache(maxsize=8192)
def _spec(text: str) -> JobSpec:
    """A stored spec, parsed once: a job's spec never changes, and a scheduler reads every
    queued job each round."""
    return JobSpec.from_dict(json.loads(text))


def _job(row: Sequence[Any]) -> Job:
    values: Mapping[str, Any] = dict(zip(_COLUMNS, row, strict=True))
    spec = _spec(values["spec"])
    return Job(**{**values, "spec": spec, "cancel_requested": bool(values["cancel_requested"])})
