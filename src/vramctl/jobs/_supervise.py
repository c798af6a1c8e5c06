"""A job's supervisor: the small process that runs one job and writes how it ended.

The scheduler starts ``python -m vramctl.jobs._supervise STORE JOB_ID`` in a session of its
own, so the supervisor, and the job it starts in a process group of the job's own, go on
when the scheduler dies. The supervisor

1. moves the job from ``admitted`` to ``running`` (a compare-and-set: a second
   supervisor for the same job finds it moved and exits);
2. starts the job's argv (never through a shell), with its environment, working
   directory and log file, and the variables that give it its device and share (on a
   CUDA device: the device's ``CUDA_VISIBLE_DEVICES`` entry and, where an MPS daemon
   runs, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``);
3. watches the job: on a CUDA device it reads through NVML the GPU memory of the job's
   processes and stops the job when that passes its reservation by more than the
   tolerance (``$VRAMCTL_OVERRUN_TOLERANCE``, 5% by default); it stops the job on a cancel
   request and at the run timeout too (SIGTERM to the whole process group, then SIGKILL);
4. writes the exit status, the peak and the final state in one commit: succeeded, failed
   (queued again while retries are left), cancelled or timed-out.

The peak is the device's: on a CUDA device the larger of NVML's peak for the job's
processes and the peak its Python processes' allocators report; on a simulated device the
simulated allocator's peak; on the CPU the peak resident memory of the job's process tree.
The job's Python processes report their allocator's peak when they exit, one file per
process (``$VRAMCTL_PEAK_FILE.<pid>``, written by :func:`vramctl.jobs._run.hold_process`,
in a folder of the job's own beside its log); the supervisor adds them up (an upper bound
when several processes peak at different times) and removes them.

It is started as a script (``python .../_supervise.py STORE JOB_ID``) and imports nothing
of vramctl, nor PyTorch: one runs beside every job for the job's whole life, so it costs a
few MiB and starts in milliseconds. It imports ``pynvml`` only for a job on a CUDA device.
It reads and writes the store with plain SQL, the same compare-and-set moves as
:class:`vramctl.jobs.JobStore`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

__all__ = [
    "ENV_ALLOWANCE",
    "ENV_DEVICE",
    "ENV_JOB_ID",
    "ENV_PEAK_FILE",
    "ENV_RESERVED",
    "ENV_TOLERANCE",
    "LEARN_SQL",
    "MPS_LIMIT",
    "OVERRUN_GROWTH",
    "TOLERANCE",
    "GpuWatch",
    "hold",
    "job_argv",
    "local_device",
    "main",
    "mps_in_use",
    "mps_limit",
    "overrun_need",
    "overrun_tolerance",
    "process_alive",
    "process_allowance",
    "read_out_of_memory",
    "read_peaks",
    "run_key",
    "supervise",
    "tree_rss",
    "visible_entry",
]

ENV_JOB_ID = "VRAMCTL_JOB_ID"
ENV_DEVICE = "VRAMCTL_DEVICE"
ENV_RESERVED = "VRAMCTL_RESERVED_BYTES"
#: Where a job's Python processes write their allocator's peak: ``<this>.<pid>``.
ENV_PEAK_FILE = "VRAMCTL_PEAK_FILE"
#: The spec's guard table as JSON (read by the bootstrap; see ``vramctl.jobs._run``).
ENV_GUARD = "VRAMCTL_GUARD"
#: How far past its reservation a job's GPU memory may go before it is stopped (a share).
ENV_TOLERANCE = "VRAMCTL_OVERRUN_TOLERANCE"
TOLERANCE = 0.05
#: What each process of a job may use beyond the job's reservation (and the tolerance)
#: before the watch stops the job: its runtime, which the reservation may not count (a
#: CUDA context on a GPU, the interpreter and its libraries on the host). Bytes.
ENV_ALLOWANCE = "VRAMCTL_PROCESS_ALLOWANCE"
GPU_ALLOWANCE = 2**30
HOST_ALLOWANCE = 512 * 2**20
#: A delegated cgroup v2 folder under which a job on the ``cpu`` device gets a cgroup of its
#: own with ``memory.max`` (else its processes get ``RLIMIT_DATA``).
ENV_CGROUP = "VRAMCTL_CGROUP"
#: Told to a job on the ``cpu`` device: the limit its memory is held to, and by what.
ENV_LIMIT = "VRAMCTL_MEMORY_LIMIT"
ENV_LIMIT_BY = "VRAMCTL_MEMORY_LIMIT_BY"
#: The most a job's processes may write as their allocator's peak (files, bytes each).
MAX_PEAK_FILES = 1024
#: MPS's limit on the device memory of one client process.
MPS_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
#: MPS's pipe directory when ``CUDA_MPS_PIPE_DIRECTORY`` is not set.
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"
#: How often the supervisor reads the job's memory and the store (seconds).
POLL_S = 0.1
#: Records a run's peak for its job name, the largest kept (the store uses it too).
LEARN_SQL = (
    "INSERT INTO learned (name, peak_bytes, runs, updated_at) VALUES (?, ?, 1, ?)"
    " ON CONFLICT(name) DO UPDATE SET peak_bytes = MAX(peak_bytes, excluded.peak_bytes),"
    " runs = runs + 1, updated_at = excluded.updated_at"
)
#: Seconds between SIGTERM and SIGKILL when a job is stopped.
GRACE_S = 5.0
#: A job stopped for its overrun was stopped on its way up: what it was measured to use is
#: a floor of its true peak. Its next attempt needs at least this many times its last
#: reservation (and at least what it was measured to use).
OVERRUN_GROWTH = 1.5


#: The spec fields that make two jobs the same run, for the peaks learned of it.
_RUN_FIELDS = (
    "name",
    "command",
    "entry_point",
    "args",
    "cwd",
    "env",
    "batch_size",
    "effective_batch",
    "memory",
    "guard",
)


def run_key(spec: Mapping[str, Any]) -> str:
    """The key under which the peaks of runs of this very job (its spec's name, command,
    arguments, environment, batch, memory need and guard: :meth:`JobSpec.to_dict`'s
    fields) are learned; another job of the same name does not share it.

    >>> run_key({"name": "a", "command": ["python", "t.py"]})[:4]
    'run:'
    """
    import hashlib

    same = json.dumps({k: spec.get(k) for k in _RUN_FIELDS}, sort_keys=True, default=str)
    return "run:" + hashlib.sha256(same.encode()).hexdigest()[:24]


def overrun_need(measured: int, reserved: int) -> int:
    """What a job that used more than its reservation of ``reserved`` bytes needs at
    least on its next attempt (before the scheduler's margin): ``measured`` (its peak, or
    what it asked for when it ran out of memory under its cap), or
    :data:`OVERRUN_GROWTH` times its reservation, the larger.

    >>> overrun_need(3 * 2**30, 2**30) / 2**30
    3.0
    >>> overrun_need(2**30, 2**30) / 2**30
    1.5
    """
    return max(int(measured), int(reserved * OVERRUN_GROWTH))


class _Row:
    """The fields of a job's row the supervisor reads (the spec as its JSON dict)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.spec: dict[str, Any] = json.loads(values["spec"])

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def local_device(device: str | None) -> str:
    """The device as the job's machine names it: a device of a Ray cluster is recorded
    as ``<device>@<node>`` (``cuda:1@3f9a0c2e``), a local one as itself.

    >>> local_device("cuda:1@3f9a0c2e"), local_device("sim:T4-16GB"), local_device(None)
    ('cuda:1', 'sim:T4-16GB', 'cpu')
    """
    return (device or "cpu").partition("@")[0]


def job_argv(spec: dict[str, Any]) -> list[str]:
    """The argv the job runs: its command, or the bootstrap that calls its entry point."""
    if spec.get("command"):
        return [str(a) for a in spec["command"]]
    return [sys.executable, "-m", "vramctl.jobs._run", spec["entry_point"], *spec.get("args", [])]


# -- the CUDA device ---------------------------------------------------------------------


def visible_entry(index: int, visible: str | None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` entry of device ``cuda:index`` as a process with
    ``CUDA_VISIBLE_DEVICES=visible`` numbers devices: the index-th entry (an index or a
    ``GPU-``/``MIG-`` UUID), or ``str(index)`` when ``visible`` is None. None when that
    process sees no such device (as in CUDA, an entry that names nothing ends the list).

    >>> visible_entry(1, "2,3"), visible_entry(1, None), visible_entry(2, "2,3")
    ('3', '1', None)
    """
    if visible is None:
        return str(index)
    entries: list[str] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries[index] if 0 <= index < len(entries) else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _nvml_devices(nvml: Any, visible: str | None) -> list[tuple[Any, str]]:
    """(handle, UUID) of the devices a CUDA process with ``visible`` sees, in CUDA's
    numbering: the rules of ``vramctl.device.nvml_gpus`` (which the scheduler numbered
    the devices with), kept here because the supervisor does not import vramctl. A GPU
    with MIG enabled counts as its instances; an unreadable GPU keeps its number with a
    None handle."""
    physical: list[tuple[Any, str, list[tuple[Any, str]]]] = []
    for i in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError:
            physical.append((None, "", []))
            continue
        migs: list[tuple[Any, str]] = []
        try:
            enabled = nvml.nvmlDeviceGetMigMode(handle)[0] == nvml.NVML_DEVICE_MIG_ENABLE
        except nvml.NVMLError:
            enabled = False
        if enabled:
            for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
                    migs.append((mig, _text(nvml.nvmlDeviceGetUUID(mig))))
                except nvml.NVMLError:
                    continue
        physical.append((handle, uuid, migs))

    def expand(entry: tuple[Any, str, list[tuple[Any, str]]]) -> list[tuple[Any, str]]:
        return entry[2] or [(entry[0], entry[1])]

    if visible is None:
        return [d for entry in physical for d in expand(entry)]
    chosen: list[tuple[Any, str]] = []
    for raw in visible.split(","):
        token = raw.strip()
        found: list[tuple[Any, str]] = []
        if token.isdigit() and int(token) < len(physical):
            found = expand(physical[int(token)])
        elif token.startswith("GPU-"):
            hits = [e for e in physical if e[0] is not None and e[1].startswith(token)]
            found = expand(hits[0]) if len(hits) == 1 else []
        elif token.startswith("MIG-"):
            migs = [m for e in physical for m in e[2] if m[1].startswith(token)]
            found = migs[:1] if len(migs) == 1 else []
        if not found:
            break
        seen = {uuid for handle, uuid in chosen if handle is not None}
        chosen.extend(d for d in found if d[0] is None or d[1] not in seen)
    return chosen


class GpuWatch:
    """NVML's reading of the GPU memory that a job's processes use on one CUDA device."""

    def __init__(self, nvml: Any, handle: Any, uuid: str) -> None:
        self.nvml = nvml
        self.handle = handle
        #: The device's UUID (a MIG instance's for a MIG instance).
        self.uuid = uuid
        #: NVML listed a process by an id that no process here has: this supervisor runs
        #: with process ids of its own (a container without the host's), NVML names the
        #: host's, and the job's processes cannot be found among them.
        self.foreign = False

    @classmethod
    def open(cls, index: int, visible: str | None) -> GpuWatch | None:
        """The watch of device ``cuda:index`` as numbered under ``visible``; None where
        NVML does not run or does not know the device (the job then runs unwatched)."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no NVML library or driver: nothing to watch with
            return None
        try:
            devices = _nvml_devices(pynvml, visible)
            handle, uuid = devices[index] if 0 <= index < len(devices) else (None, "")
        except Exception:
            handle, uuid = None, ""
        if handle is None:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return None
        return cls(pynvml, handle, uuid)

    def used(self, pids: set[int]) -> int | None:
        """The GPU memory the processes ``pids`` use on the device now: the sum of NVML's
        per-process figures. None when NVML gives none for them (an error, or a MIG
        instance or a driver that does not report per-process memory)."""
        reading = self.reading(pids)
        return None if reading is None else reading[0]

    def reading(self, pids: set[int]) -> tuple[int, int] | None:
        """:meth:`used`, with how many of ``pids`` NVML lists on the device."""
        nvml = self.nvml
        per_pid: dict[int, int | None] = {}
        read = False
        # Processes with a compute context, a graphics one, and MPS clients (which NVML
        # lists apart, under the MPS server's own entry).
        for name in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
            "nvmlDeviceGetMPSComputeRunningProcesses",
        ):
            try:
                procs = getattr(nvml, name)(self.handle)
            except Exception:
                continue
            read = True
            for p in procs:
                pid = int(p.pid)
                if pid not in pids:
                    if not self.foreign and not psutil.pid_exists(pid):
                        self.foreign = True
                    continue
                used = p.usedGpuMemory
                # A process in two lists is one process: its figure is counted once.
                if used is not None and used < 2**63:
                    per_pid[pid] = max(int(used), per_pid.get(pid) or 0)
                else:
                    per_pid.setdefault(pid, None)
        if not read:
            return None
        figures = [u for u in per_pid.values() if u is not None]
        if per_pid and not figures:
            return None  # the job's processes are there, their memory is not told
        return sum(figures), len(per_pid)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


def mps_in_use(env: Mapping[str, str], default_directory: str | None = None) -> bool:
    """Whether a job with environment ``env`` runs under an MPS control daemon: it names
    the daemon's pipe directory (``CUDA_MPS_PIPE_DIRECTORY``), or the default directory
    (:data:`MPS_PIPE_DIRECTORY`) holds the daemon's ``control`` pipe."""
    if env.get("CUDA_MPS_PIPE_DIRECTORY"):
        return True
    folder = MPS_PIPE_DIRECTORY if default_directory is None else default_directory
    return os.path.exists(os.path.join(folder, "control"))


def mps_limit(reserved: int) -> str | None:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for a job that sees one device (ordinal 0 after
    ``CUDA_VISIBLE_DEVICES``) and holds ``reserved`` bytes of it, in whole MiB.

    >>> mps_limit(20 * 2**30)
    '0=20480M'
    """
    mib = reserved // 2**20
    return f"0={mib}M" if mib > 0 else None


def overrun_tolerance(environ: Mapping[str, str] | None = None) -> float:
    """``$VRAMCTL_OVERRUN_TOLERANCE`` as a share (0.05: 5%); the default when it is unset.

    Raises ValueError for a value that is not a number, 0 or more.
    """
    text = (os.environ if environ is None else environ).get(ENV_TOLERANCE, "").strip()
    if not text:
        return TOLERANCE
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(text)
    return value


def process_allowance(device: str, environ: Mapping[str, str] | None = None) -> int:
    """``$VRAMCTL_PROCESS_ALLOWANCE`` in bytes (a whole number, or one with ``KiB``,
    ``MiB`` or ``GiB``); else 1 GiB on a CUDA device (a CUDA context), 512 MiB on the host.

    Raises ValueError for a value that is not a size.

    >>> process_allowance("cuda:0", {}), process_allowance("cpu", {ENV_ALLOWANCE: "64MiB"})
    (1073741824, 67108864)
    """
    text = (os.environ if environ is None else environ).get(ENV_ALLOWANCE, "").strip()
    if not text:
        return GPU_ALLOWANCE if device.startswith("cuda:") else HOST_ALLOWANCE
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("B", 1), ("", 1)):
        if text.endswith(unit):
            number = text[: len(text) - len(unit)].strip()
            if number.isdigit():
                return int(number) * scale
            break
    raise ValueError(text)


def _size(n: float) -> str:
    """Bytes the way vramctl writes them (``21.30 GiB``); the supervisor has no vramctl."""
    if n < 2**10:
        return f"{int(n)} bytes"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30)):
        if n < scale * 1024 or unit == "GiB":
            return f"{n / scale:.2f} {unit}"
    raise AssertionError("unreachable")


# -- the job's environment ---------------------------------------------------------------


def _environment(
    job: _Row, visible: str | None = None, peak_file: str | None = None
) -> dict[str, str]:
    spec = job.spec
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    if job.batch_size is not None and job.grad_accum is not None:
        env["VRAMCTL_BATCH_SIZE"] = str(job.batch_size)
        env["VRAMCTL_GRAD_ACCUM"] = str(job.grad_accum)
    env[ENV_JOB_ID] = job.id
    device = local_device(job.device)
    reserved = int(job.reserved_bytes or 0)
    env[ENV_DEVICE] = device
    env[ENV_RESERVED] = str(reserved)
    if peak_file is not None:
        env[ENV_PEAK_FILE] = peak_file
    if spec.get("guard"):
        env[ENV_GUARD] = json.dumps(spec["guard"])
    if (device != "cpu" or spec.get("guard")) and spec.get("command"):
        # Python commands are held to their share (and guarded) by the bootstrap here.
        site = str(Path(__file__).resolve().parent / "_site")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    if device.startswith("cuda:"):
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        # No allocator setting of vramctl's: the job runs under what its spec and the
        # scheduler's environment say, which is what admission priced (jobs.price).
        limit = mps_limit(reserved)
        if limit is not None and MPS_LIMIT not in spec.get("env", {}) and mps_in_use(env):
            env[MPS_LIMIT] = limit
    return env


class _Store:
    """The few reads and compare-and-set writes a supervisor makes, in plain SQL."""

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = NORMAL")

    def get(self, job_id: str) -> _Row:
        cur = self.conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,))
        row = cur.fetchone()
        if row is None:
            raise LookupError(f"no job {job_id!r}")
        return _Row(dict(zip([d[0] for d in cur.description], row, strict=True)))

    def move(self, job_id: str, frm: str, to: str, **values: Any) -> bool:
        sets = ", ".join(["state = ?", *(f"{k} = ?" for k in values)])
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            cur = self.conn.execute(
                f"UPDATE jobs SET {sets} WHERE id = ? AND state = ?",
                (to, *values.values(), job_id, frm),
            )
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")
        return cur.rowcount == 1

    def update(self, job_id: str, **values: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in values)
        self.conn.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*values.values(), job_id))

    def learn(self, name: str, peak: int) -> None:
        self.conn.execute(LEARN_SQL, (name, int(peak), time.time()))


# -- readings ------------------------------------------------------------------------------


def _tree(pid: int) -> list[psutil.Process]:
    """Process ``pid`` and its descendants (empty if it is gone)."""
    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def _rss(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def tree_rss(pid: int) -> int:
    """The resident memory of process ``pid`` and its descendants (0 if it is gone)."""
    return _rss(_tree(pid))


def read_peaks(prefix: str) -> int | None:
    """The sum of the allocator peaks that a job's Python processes wrote, one file each
    (``<prefix>.<pid>``); None when none wrote one. Removes the files. The job writes them,
    so they are read as the job's word: at most :data:`MAX_PEAK_FILES` files of a few bytes
    each (the caller bounds the sum)."""
    folder, base = os.path.split(prefix)
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return None
    total: int | None = None
    read = 0
    for name in names:
        if not name.startswith(f"{base}."):
            continue
        path = os.path.join(folder, name)
        if name[len(base) + 1 :].isdigit() and read < MAX_PEAK_FILES:
            read += 1
            with contextlib.suppress(OSError, ValueError), open(path, "rb") as f:
                total = (total or 0) + max(0, int(f.read(32).strip()))
        with contextlib.suppress(OSError):
            os.remove(path)  # a reading, or one left half-written (``.tmp``)
    return total


def _peak_prefix(job: _Row, log_path: str) -> str | None:
    """Where the job's processes write their allocator's peak: a folder of the job's own
    beside its log (``<logs>/<job id>.peak/peak.<pid>``), made empty; None if it cannot be
    made."""
    if log_path == os.devnull:
        import tempfile

        logs = tempfile.gettempdir()
    else:
        logs = os.path.dirname(log_path) or "."
    folder = os.path.join(logs, f"{job.id}.peak")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        return None
    prefix = os.path.join(folder, "peak")
    read_peaks(prefix)  # what an earlier attempt's processes left
    return prefix


def read_out_of_memory(prefix: str) -> int | None:
    """The bytes a job's Python process asked for when an out-of-memory error ended it
    (``<prefix>.<pid>.oom``, written by the job's bootstrap; the largest if several);
    None when no process of the job died of one."""
    folder, base = os.path.split(prefix)
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return None
    found: int | None = None
    for name in names[:MAX_PEAK_FILES]:
        pid, _, oom = name[len(base) + 1 :].partition(".")
        if name.startswith(f"{base}.") and pid.isdigit() and oom == "oom":
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(folder, name), "rb") as f,
            ):
                found = max(found or 0, max(0, int(f.read(32).strip())))
    return found


def _read_peaks_and_clear(prefix: str) -> int | None:
    """:func:`read_peaks`, then the job's peak folder removed (with what else is in it)."""
    total = read_peaks(prefix)
    folder = os.path.dirname(prefix)
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    return total


# -- the host's memory (the cpu device) ------------------------------------------------------


def _cgroup_limit(job_id: str, limit: int, base: str | None) -> str | None:
    """A cgroup v2 of the job's own under ``base`` (a delegated cgroup folder) with
    ``memory.max`` at ``limit`` and no swap; its folder, or None where it cannot be made
    (no such folder, not cgroup v2, no memory controller, no permission)."""
    if not base or not os.path.isfile(os.path.join(base, "cgroup.controllers")):
        return None
    folder = os.path.join(base, f"vramctl-{job_id}")
    try:
        with open(os.path.join(base, "cgroup.controllers")) as f:
            if "memory" not in f.read().split():
                return None
        # Already on, or the parent's to turn on.
        with (
            contextlib.suppress(OSError),
            open(os.path.join(base, "cgroup.subtree_control"), "w") as f,
        ):
            f.write("+memory")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "memory.max"), "w") as f:
            f.write(str(limit))
        with contextlib.suppress(OSError), open(os.path.join(folder, "memory.swap.max"), "w") as f:
            f.write("0")
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
        return None
    return folder


def _host_limit(cgroup: str | None, data_limit: int) -> Any:
    """What the job's process runs before the job's code (``preexec_fn``): joins
    ``cgroup``, or sets ``RLIMIT_DATA`` to ``data_limit`` (soft and hard: the job cannot
    raise it again)."""
    import resource

    def limit() -> None:
        if cgroup is not None:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            return
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        value = data_limit if hard == resource.RLIM_INFINITY else min(hard, data_limit)
        resource.setrlimit(resource.RLIMIT_DATA, (value, value))

    return limit


def _stop(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM the job's process group, then SIGKILL what is left after the grace."""
    pgid = child.pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        child.poll()  # reaped once it exits: unreaped, it would still count in its group
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# -- running the job -------------------------------------------------------------------------


def supervise(store: _Store, job_id: str) -> str | None:
    """Run ``job_id`` to its end; returns the state it ended in (None: not this one's)."""
    me = psutil.Process()
    job = store.get(job_id)
    if not store.move(
        job_id,
        "admitted",
        "running",
        supervisor_pid=me.pid,
        supervisor_started=me.create_time(),
        started_at=time.time(),
        attempts=job.attempts + 1,
    ):
        return None
    job = store.get(job_id)
    log_path = job.log_path or os.devnull
    os.makedirs(os.path.dirname(log_path) or ".", mode=0o700, exist_ok=True)
    device = local_device(job.device)
    watch: GpuWatch | None = None
    visible: str | None = None
    if device.startswith("cuda:"):
        index = int(device.split(":", 1)[1])
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = visible_entry(index, inherited)
        watch = GpuWatch.open(index, inherited)
        if watch is not None:
            visible = watch.uuid  # the very device the scheduler measured, in any order
        elif visible is None:
            failed = f"{device} is not visible here (CUDA_VISIBLE_DEVICES={inherited})"
            return _finish(store, job, "failed", None, 0, failed)
    try:
        return _run(store, job, log_path, visible, watch)
    finally:
        if watch is not None:
            watch.close()


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _run(
    store: _Store, job: _Row, log_path: str, visible: str | None, watch: GpuWatch | None
) -> str:
    device = local_device(job.device)
    reserved = int(job.reserved_bytes or 0)
    on_cpu = device == "cpu"
    on_host = on_cpu or device.startswith("sim:")  # a simulated GPU's memory is the host's
    peak_file = None if on_cpu else _peak_prefix(job, log_path)
    notes: list[str] = []
    tolerance = TOLERANCE
    try:
        tolerance = overrun_tolerance()
    except ValueError:
        notes.append(
            f"vramctl: {ENV_TOLERANCE}={os.environ.get(ENV_TOLERANCE)!r} is not a number,"
            f" 0 or more; using {TOLERANCE:g}"
        )
    try:
        allowance = process_allowance(device)
    except ValueError:
        allowance = process_allowance(device, {})
        notes.append(
            f"vramctl: {ENV_ALLOWANCE}={os.environ.get(ENV_ALLOWANCE)!r} is not a size;"
            f" using {_size(allowance)}"
        )
    limit = int(reserved * (1 + tolerance)) if reserved > 0 else None
    env = _environment(job, visible, peak_file)
    preexec = None
    cgroup: str | None = None
    if on_cpu and limit is not None:
        # A real limit on the host's memory: a cgroup's memory.max, else RLIMIT_DATA on
        # each process (its private writable memory, which its heap and tensors are).
        cgroup = _cgroup_limit(job.id, limit + allowance, os.environ.get(ENV_CGROUP))
        if cgroup is not None:
            env[ENV_LIMIT], env[ENV_LIMIT_BY] = str(limit + allowance), "cgroup memory.max"
        else:
            env[ENV_LIMIT], env[ENV_LIMIT_BY] = str(limit + 2 * allowance), "RLIMIT_DATA"
        preexec = _host_limit(cgroup, limit + 2 * allowance)
        notes.append(
            f"vramctl: this job's memory is limited to {_size(int(env[ENV_LIMIT]))} by"
            f" {env[ENV_LIMIT_BY]}" + (" (each process)" if cgroup is None else "")
        )
    cwd = job.spec.get("cwd")
    argv = job_argv(job.spec)
    try:
        # Owner-only: a job's output is the job's owner's alone.
        with open(log_path, "ab", opener=_private) as log:
            if notes:
                log.write("".join(f"{n}\n" for n in notes).encode())
                log.flush()
            child = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,
            )
    except (OSError, subprocess.SubprocessError) as exc:
        _remove_cgroup(cgroup)
        what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        failed = f"could not start {argv[0]!r}: {what}"
        return _finish(store, job, "failed", None, 0, failed)
    store.update(job.id, pid=child.pid, pid_started=_started(child.pid))
    rss_peak = 0
    gpu_peak: int | None = None
    reason: str | None = None
    state: str | None = None
    overran = False
    told = False  # of NVML's process ids being another namespace's
    run_timeout = job.spec.get("run_timeout")
    deadline = time.monotonic() + run_timeout if run_timeout is not None else None
    next_read = 0.0
    while child.poll() is None:
        procs = _tree(child.pid)
        pids = {p.pid for p in procs}
        over: str | None = None
        if on_host:
            rss = _rss(procs)
            rss_peak = max(rss_peak, rss)
            # Every process is watched, whatever it says of itself or its cap.
            if limit is not None and rss > limit + allowance * len(procs):
                over = _overrun("host", rss, reserved, tolerance, allowance, len(procs))
        reading = watch.reading(pids) if watch is not None else None
        if watch is not None and watch.foreign and not told:
            told = True
            _note(log_path, FOREIGN_PIDS)
        if reading is not None:
            used, listed = reading
            gpu_peak = max(gpu_peak or 0, used)
            if limit is not None and used > limit + allowance * listed:
                over = _overrun("GPU", used, reserved, tolerance, allowance, listed)
        if over is not None:
            state, reason, overran = "failed", over, True
            _stop(child)
            break
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            state, reason = "timed-out", f"ran past its run timeout of {run_timeout:g} s"
            _stop(child)
            break
        if now >= next_read:
            next_read = now + 0.5
            if store.get(job.id).cancel_requested:
                state, reason = "cancelled", "cancelled"
                _stop(child)
                break
        time.sleep(POLL_S)
    code = child.wait()
    _remove_cgroup(cgroup)
    if state is None:
        state = "succeeded" if code == 0 else "failed"
        if code != 0:
            reason = f"exited with status {code}" if code > 0 else f"killed by signal {-code}"
    asked: int | None = None  # what it asked for when out of memory ended it
    if on_cpu:
        peak = rss_peak  # the resident memory of the job's processes
    else:
        # On a GPU: NVML's peak for the job's processes and the peak their allocators
        # reported, the larger; on a simulated one, the simulated allocator's. What the job
        # reports counts up to what its share let one process reach unstopped.
        asked = read_out_of_memory(peak_file) if peak_file is not None else None
        reported = _read_peaks_and_clear(peak_file) if peak_file is not None else None
        if reported is not None and limit is not None:
            reported = min(reported, limit + allowance)
        peak = max((r for r in (gpu_peak, reported) if r is not None), default=0)
    if asked is not None and state == "failed" and not overran and reserved > 0:
        overran = True
        # What it asked for counts up to twice its share: the job's own word.
        wanted = min(peak + asked, 2 * (limit or reserved))
        reason = (
            f"ran out of memory under its share of {_size(reserved)} (asked for"
            f" {_size(asked)} more); {reason}"
        )
        peak = max(peak, wanted)
    need = overrun_need(peak, reserved) if overran else None
    return _finish(store, job, state, code, peak, reason, need)


#: Said in a job's log when NVML names processes by ids this supervisor does not have.
FOREIGN_PIDS = (
    "vramctl: NVML lists GPU processes by ids that no process here has: this supervisor runs"
    " with process ids of its own (a container without the host's), so the job's GPU memory"
    " is not watched here and its peak comes from its allocator alone; a Python job is still"
    " held to its share by the allocator's cap. Give the container the host's process ids"
    " (pid: host in compose.yaml, --pid=host) to watch it."
)


def _note(log_path: str, text: str) -> None:
    """Add a line of vramctl's to the job's log (appended: the job writes there too)."""
    with contextlib.suppress(OSError), open(log_path, "a") as log:
        log.write(text + "\n")


def _overrun(
    memory: str, used: int, reserved: int, tolerance: float, allowance: int, processes: int
) -> str:
    """Why a job was stopped for using more memory than its share lets it.

    >>> _overrun("GPU", 3 * 2**30, 2**30, 0.05, 2**30, 2).split(" (")[1]
    '+5%, and 1.00 GiB for each of its 2 processes)'
    """
    also = ""
    if allowance:
        each = "its 1 process" if processes == 1 else f"each of its {processes} processes"
        also = f", and {_size(allowance)} for {each}"
    return (
        f"used {_size(used)} of {memory} memory, past its reservation of {_size(reserved)}"
        f" (+{tolerance * 100:g}%{also})"
    )


def _remove_cgroup(folder: str | None) -> None:
    if folder is not None:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _finish(
    store: _Store,
    job: _Row,
    state: str,
    code: int | None,
    peak: int,
    reason: str | None,
    need: int | None = None,
) -> str:
    """End the job's attempt: queued again while its retries last, else in ``state``.
    ``need``: it overran its share and needs at least this much (see
    :func:`overrun_need`)."""
    now = time.time()
    if (state == "succeeded" or need is not None) and peak:
        # The peak of this very job (an overrun's: a floor of it); by its name too where
        # its need is learned by name (an overrun there only where it is learned so).
        store.learn(run_key(job.spec), peak)
        memory = job.spec.get("memory")
        if state == "succeeded" or (isinstance(memory, dict) and "learned" in memory):
            store.learn(job.name, peak)
    overruns = int(job.values.get("overruns") or 0)
    if need is not None and overruns < job.spec.get("overrun_retries", 1):
        again = f"{reason}; queued again needing {_size(need)} (overrun {overruns + 1})"
        if store.move(
            job.id,
            "running",
            "queued",
            exit_code=code,
            peak_bytes=peak or None,
            reason=again,
            need_bytes=need,
            overruns=overruns + 1,
        ):
            return "queued"
    retry = state == "failed" and job.attempts <= job.spec.get("retries", 0)  # attempts made
    if retry and store.move(
        job.id, "running", "queued", exit_code=code, peak_bytes=peak or None, reason=reason
    ):
        return "queued"
    store.move(
        job.id,
        "running",
        state,
        exit_code=code,
        peak_bytes=peak or None,
        reason=reason,
        finished_at=now,
    )
    return state


def _started(pid: int) -> float | None:
    """When process ``pid`` started (None when it cannot be read)."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def process_alive(pid: int, started: float | None) -> bool:
    """Whether ``pid`` runs, and is the process that started at ``started`` (not a reuse
    of its number); ``started`` None checks only that it runs."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 0.01
    except psutil.Error:
        return False


def hold(store: _Store, job_id: str, poll_s: float = 0.2) -> str | None:
    """Supervise an admitted job, or wait for the supervisor already running it (a Ray
    task run again after its worker died holds the reservation again this way); a job
    running without its supervisor is left to the scheduler's adoption."""
    job = store.get(job_id)
    pid, started = job.supervisor_pid, job.supervisor_started
    if pid is not None and process_alive(int(pid), started):
        while process_alive(int(pid), started):
            time.sleep(poll_s)
        return str(store.get(job_id).state)
    if job.state == "admitted":
        return supervise(store, job_id)
    return str(job.state)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    waits = bool(args) and args[0] == "--hold"
    if waits:
        args = args[1:]
    if len(args) != 2:
        print("usage: python _supervise.py [--hold] STORE JOB_ID", file=sys.stderr)
        return 2
    # The scheduler's own signals (Ctrl-C in its terminal) are not the job's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = _Store(args[0])
    try:
        (hold if waits else supervise)(store, args[1])
    finally:
        store.conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
