"""The scheduler: admits queued jobs by memory, places them, starts their supervisors.

Each round (:meth:`Scheduler.run_once`):

1. **Adopt.** Every ``admitted`` or ``running`` job whose supervisor is gone (its pid no
   longer runs with the start time recorded) is taken over: one whose processes run on
   is held to its cancel request and run timeout; one whose processes are gone ends
   (failed, its exit status unknown, and never run again); one that never started is
   queued again. A restarted scheduler so takes over the jobs its predecessor started:
   their supervisors went on without it.
2. **Ledger.** A :class:`~vramctl.jobs.Ledger` of the reservations of the jobs that hold
   each device (``admitted`` and ``running``), and what the device reports free now
   (NVML or the host's memory; not on a simulated GPU), so memory taken outside vramctl
   counts: a device can promise the least of ``capacity - reserved`` and ``free now``
   less what its jobs may still allocate. The policy chooses among the devices where a
   job's need plus the safety margin fits (the placement module's rules).
3. **Admit.** Queued jobs in order of priority plus age (a job gains one priority point
   for every ``aging_s`` it waits, so nothing starves), then submission. A job that fits
   nowhere is passed over and smaller ones behind it go first (backfill). A job with an
   ``effective_batch`` that does not fit at its batch size is priced at smaller batches
   (divisors of the effective batch) and admitted at the largest that fits, with the
   gradient accumulation that keeps the effective batch. A job that waits says why in its
   ``reason`` (``waiting: needs ... with the margin, most free is ... on ...``, or that no
   device of this scheduler is large enough), written when that changes and cleared at
   its admission. A job that waits past its ``wait_timeout`` fails, saying how much it
   needed and the most any device had free.
   The queue is kept between rounds: a job is read once, and one that fit nowhere is
   passed over at the cost of a comparison until some device has the room it needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil

from vramctl._na import NA
from vramctl._units import format_bytes
from vramctl.device import Device, gpus, resolve
from vramctl.jobs._ledger import Ledger, Reservation
from vramctl.jobs._need import device_capacity, matching_devices, price
from vramctl.jobs._placement import BestFit, Fragmentation, LeastLoaded, MostFree, Policy
from vramctl.jobs._pricing import EstimateWorker
from vramctl.jobs._settings import POLICIES
from vramctl.jobs._spec import JobSpec, JobSpecError
from vramctl.jobs._store import ACTIVE, Job, JobStore
from vramctl.jobs._supervise import process_alive as _alive
from vramctl.jobs._supervise import run_key, tree_rss

__all__ = ["POLICIES", "LocalRunner", "Runner", "Scheduler"]

log = logging.getLogger("vramctl.jobs")


def _policy(name: str) -> Policy:
    made: dict[str, Callable[[], Policy]] = {
        "best-fit": BestFit,
        "most-free": MostFree,
        "least-loaded": LeastLoaded,
        "fragmentation": Fragmentation,
    }
    return made[name]()


class Runner(Protocol):
    """Where admitted jobs run: starts a job's supervisor, and says which jobs it is
    still starting or running (the scheduler's adoption leaves those alone)."""

    def start(self, store: JobStore, job: Job) -> None: ...

    def holds(self, job_id: str) -> bool: ...


class LocalRunner:
    """Runs each job's supervisor as a process of this machine, in a session of its own
    (it outlives the scheduler)."""

    def __init__(self) -> None:
        self._started: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, store: JobStore, job: Job) -> None:
        # Run by path: the supervisor imports neither vramctl nor PyTorch (see its module).
        script = str(Path(__file__).resolve().parent / "_supervise.py")
        argv = [sys.executable, script, str(store.path), job.id]
        self._started[job.id] = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # it outlives the scheduler
        )

    def holds(self, job_id: str) -> bool:
        proc = self._started.get(job_id)
        if proc is None:
            return False
        if proc.poll() is None:
            return True
        del self._started[job_id]
        return False


#: Queued jobs read from the store at a time, in admission order.
_READ_AHEAD = 64


@dataclass(frozen=True)
class _Passed:
    """A queued job that fit nowhere: the least it reserves anywhere (its margin in), the
    most it needs (for the wait-timeout message), and its candidate devices."""

    floor: int
    wanted: int | None
    candidates: tuple[int, ...]


@dataclass
class _Stopping:
    """An orphan being stopped: the state and reason it ends with, when SIGTERM went."""

    state: str
    reason: str
    since: float = field(default_factory=time.monotonic)
    killed: bool = False


#: Seconds between SIGTERM and SIGKILL when an orphan is stopped (as its supervisor does).
STOP_GRACE_S = 5.0


@dataclass
class Scheduler:
    """Admits the queued jobs of ``store`` onto ``devices`` (default: this machine's GPUs,
    else the CPU)."""

    store: JobStore
    devices: Sequence[Device] | None = None
    policy: str = "best-fit"
    #: Extra room asked of a device beyond a job's need, as a fraction of the need.
    margin: float = 0.1
    max_concurrent_jobs: int | None = None
    aging_s: float = 60.0
    #: Seconds between rounds in :meth:`run`.
    interval_s: float = 0.2
    #: Admit only these job ids (``vramctl run`` schedules its own job); None: every job.
    only: frozenset[str] | None = None
    #: Starts an admitted job; the default starts its supervisor process. A replay (the
    #: benchmarks) passes its own, which moves the job through its states itself.
    launch: Callable[[Job], None] | None = None
    #: Where admitted jobs' supervisors run (default: processes of this machine; a
    #: ``vramctl.jobs.RayRunner`` runs them on a Ray cluster).
    runner: Runner | None = None
    #: Runs the estimates that price jobs (a need of kind ``estimate``) in a process of
    #: its own (``vramctl serve`` passes one); None: in this process.
    estimate_worker: EstimateWorker | None = None
    # The queue as the last round read it, in admission order, and what the rounds
    # learned about its jobs: prices per (device, batch), and the jobs that fit nowhere.
    _queued: dict[str, Job] = field(default_factory=dict, repr=False)
    _order: list[str] = field(default_factory=list, repr=False)
    _order_ids: set[str] = field(default_factory=set, repr=False)
    _prices: dict[str, dict[tuple[int, int | None], int]] = field(default_factory=dict, repr=False)
    _passed: dict[str, _Passed] = field(default_factory=dict, repr=False)
    # The waiting reason last written on each queued job (written again when it changes).
    _waits: dict[str, str] = field(default_factory=dict, repr=False)
    # Orphans (jobs running on after their supervisor died) being stopped, by job id.
    _orphans: dict[str, _Stopping] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise JobSpecError(
                f"unknown placement policy {self.policy!r}; policies: {', '.join(POLICIES)}",
                what="invalid scheduler settings",
            )
        if self.devices is None:
            self.devices = gpus() or [resolve("cpu")]
        self.devices = list(self.devices)
        ids = [d.id for d in self.devices]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise JobSpecError(
                f"device {twice[0]} is given twice: the scheduler keys its ledger by device id"
                " (simulated GPUs of one size share theirs: give each a catalog name or size"
                " of its own)",
                what="invalid scheduler settings",
            )
        self._index = {d.id: i for i, d in enumerate(self.devices)}
        self._chooser = _policy(self.policy)
        if self.runner is None:
            self.runner = LocalRunner()

    # -- one round -----------------------------------------------------------------------

    def run_once(self) -> list[Job]:
        """One round: adopt, then admit what fits. Returns the jobs admitted."""
        self.adopt()
        admitted = []
        # One admission at a time per store: two schedulers (a service and a `vramctl
        # run`) reading the same ledger must not both promise the same memory.
        with self.store.admission_lock():
            ledger, free = self._ledger()
            largest = ledger.largest(free)
            now = time.time()
            for job in self._queue():
                if self.only is not None and job.id not in self.only:
                    continue
                passed = self._passed.get(job.id)
                if passed is not None and passed.floor > largest:
                    # It fit nowhere, and no device has got the room since: a look at
                    # its wait is all (a thousand queued jobs cost microseconds each).
                    self._check_wait(job, passed, ledger, free, now)
                    continue
                placed = self._place(job, ledger, free, now)
                if placed is not None:
                    admitted.append(placed)
                    largest = ledger.largest(free)
        # Started after the round's admissions are committed: starting a process takes tens
        # of milliseconds, which the admissions after it would otherwise wait for. (A
        # scheduler killed in between leaves admitted jobs without a supervisor: the next
        # adopts and queues them again after the start grace.)
        for job in admitted:
            if self.launch is not None:
                self.launch(job)
            else:
                assert self.runner is not None
                self.runner.start(self.store, job)
        return admitted

    def run(self, stop: threading.Event | None = None, *, until_idle: bool = False) -> None:
        """Rounds until ``stop`` is set (or, with ``until_idle``, until no job is queued,
        admitted or running)."""
        stop = stop or threading.Event()
        while not stop.is_set():
            self.run_once()
            if until_idle:
                counts = self.store.counts()
                if not any(counts[s] for s in ("queued", *ACTIVE)):
                    return
            stop.wait(self.interval_s)

    # -- adoption ------------------------------------------------------------------------

    def adopt(self) -> list[Job]:
        """Take over the active jobs whose supervisor is gone; returns those that ended.

        - A job admitted whose supervisor never started is queued again: it never ran.
        - A job whose processes still run (an orphan) keeps its reservation, and is held
          to its cancel request and its run timeout here: its process group gets SIGTERM,
          then SIGKILL after the grace.
        - A job whose processes are gone ends: cancelled or timed-out when that is why
          they were stopped, else failed with its exit status unknown. It is not run
          again (its run may have finished), unless its spec sets ``rerun_lost`` and
          retries are left.
        """
        lost: list[Job] = []
        if self.launch is not None:
            return lost  # jobs started by a launch hook have no supervisor to watch
        assert self.runner is not None
        for job in self.store.list(ACTIVE):
            if self.runner.holds(job.id):
                continue
            starting = time.time() - (job.admitted_at or 0) < 30
            if job.state == "admitted" and job.supervisor_pid is None and starting:
                continue  # its supervisor is starting
            if job.supervisor_pid is not None and _alive(
                job.supervisor_pid, job.supervisor_started
            ):
                continue
            if job.pid is not None and _group_runs(job):
                self._hold_orphan(job)  # its reservation stays until its processes end
                continue
            ended = self._end_orphan(job)
            if ended is not None:
                lost.append(ended)
        return lost

    def _hold_orphan(self, job: Job) -> None:
        """Stop an orphan's process group on its cancel request or past its run timeout
        (SIGTERM, SIGKILL once the grace is over)."""
        assert job.pid is not None
        stopping = self._orphans.get(job.id)
        if stopping is None:
            timeout = job.spec.run_timeout
            if job.cancel_requested:
                stopping = _Stopping("cancelled", "cancelled (its supervisor had died)")
            elif (
                timeout is not None
                and job.started_at is not None
                and time.time() - job.started_at >= timeout
            ):
                stopping = _Stopping(
                    "timed-out",
                    f"ran past its run timeout of {timeout:g} s (its supervisor had died)",
                )
            else:
                return
            self._orphans[job.id] = stopping
            log.warning("job %s (%s): %s; stopping it", job.id, job.name, stopping.reason)
            _signal_group(job.pid, signal.SIGTERM)
        elif not stopping.killed and time.monotonic() - stopping.since >= STOP_GRACE_S:
            stopping.killed = True
            _signal_group(job.pid, signal.SIGKILL)

    def _end_orphan(self, job: Job) -> Job | None:
        """Move a job whose supervisor and processes are gone to where it ends."""
        stopping = self._orphans.pop(job.id, None)
        if job.state == "admitted":
            # Its supervisor never moved it to running: it never started.
            reason = "its supervisor did not start it; queued again"
            if self.store.move(job.id, "admitted", "queued", reason=reason):
                log.warning("job %s (%s): %s", job.id, job.name, reason)
                return self.store.get(job.id)
            return None
        if stopping is not None:
            state, reason = stopping.state, stopping.reason
        elif job.cancel_requested:
            state, reason = "cancelled", "cancelled (its supervisor had died)"
        elif job.spec.rerun_lost and job.attempts <= job.spec.retries:
            reason = "its supervisor died; the job's exit status is unknown; queued again"
            if self.store.move(job.id, job.state, "queued", reason=reason):
                log.warning("job %s (%s): %s", job.id, job.name, reason)
                return self.store.get(job.id)
            return None
        else:
            state = "failed"
            reason = (
                "its supervisor died; the job's exit status is unknown (not run again:"
                " its run may have finished; submit it again to rerun it)"
            )
        if self.store.move(job.id, job.state, state, reason=reason, finished_at=time.time()):
            log.warning("job %s (%s): %s", job.id, job.name, reason)
            return self.store.get(job.id)
        return None

    # -- the ledger ----------------------------------------------------------------------

    def _ledger(self) -> tuple[Ledger, list[int | None]]:
        """The reservations of the jobs that hold the devices now, and what each device
        reports free (None where it is not read: a simulated GPU, whose jobs run in other
        processes, or a device that cannot be read, taken as its ledger says)."""
        assert self.devices is not None
        ledger = Ledger(
            [device_capacity(d) for d in self.devices],
            margin=self.margin,
            max_concurrent_jobs=self.max_concurrent_jobs,
        )
        held: list[list[Job]] = [[] for _ in self.devices]
        for job in self.store.list(ACTIVE):
            i = self._index.get(job.device or "")
            if i is not None:  # not a device of this scheduler's: not its ledger
                held[i].append(job)
        free: list[int | None] = []
        for i, dev in enumerate(self.devices):
            reported: int | None = None
            if not dev.is_simulated:
                try:
                    reported = int(dev.available())
                except Exception:
                    reported = None
            # What a device reports free already leaves out what its jobs hold; the
            # part of their reservations they have not used yet is still theirs.
            used = _usage(dev, held[i]) if reported is not None and held[i] else {}
            for job in held[i]:
                ledger.restore(job.id, i, job.reserved_bytes or 0, used.get(job.id, 0))
            free.append(reported)
        return ledger, free

    # -- admission -----------------------------------------------------------------------

    def _queue(self) -> Iterator[Job]:
        """The queued jobs in admission order: priority plus age (the age term shifts
        every job alike, so the order changes only when the queue does), then submission.

        A job is read in full once, when the round first comes to it (with the next few),
        and kept while it stays queued: admitting the first jobs of a long queue does not
        wait for the whole queue to be read."""
        rows = self.store.keys(["queued"])
        attempts = {r[0]: r[1] for r in rows}
        for job_id, job in list(self._queued.items()):
            if attempts.get(job_id) != job.attempts:  # gone, or queued again: read afresh
                del self._queued[job_id]
                self._passed.pop(job_id, None)
                self._waits.pop(job_id, None)
        for job_id in [i for i in self._prices if i not in attempts]:
            del self._prices[job_id]
        if attempts.keys() != self._order_ids:
            rows.sort(key=lambda r: (-(r[2] - r[3] / self.aging_s), r[4]))
            self._order = [r[0] for r in rows]
            self._order_ids = set(attempts)
        order = self._order
        for k, job_id in enumerate(order):
            if job_id not in self._queued:
                ahead = [i for i in order[k : k + _READ_AHEAD] if i not in self._queued]
                for got in self.store.get_many(ahead):
                    self._queued[got.id] = got
            found = self._queued.get(job_id)
            if found is not None and found.state == "queued":  # else moved on since read
                yield found

    def _price(self, job: Job, device: int, batch: int | None) -> int:
        assert self.devices is not None
        prices = self._prices.setdefault(job.id, {})
        if prices.get(_ATTEMPT, job.attempts) != job.attempts:
            prices.clear()  # run since it was priced: an overrun may have raised its need
        prices[_ATTEMPT] = job.attempts
        if (device, batch) not in prices:
            by_name = job.spec.memory.kind == "learned"
            key = job.name if by_name else run_key(job.spec.to_dict())
            learned = self.store.learned_peak(key)
            dev = self.devices[device]
            need = price(
                job.spec,
                dev,
                learned_peak=learned if by_name else None,
                batch_size=batch,
                estimator=self.estimate_worker,
            )
            floor = _floor(job, batch, None if by_name else learned)
            if floor > need and job.need_bytes is not None:
                # An overrun's growth asks no more than the device can give; what the job
                # was measured to use it must have.
                room = int(device_capacity(dev) / (1 + self.margin))
                floor = max(min(floor, room), min(job.peak_bytes or 0, job.need_bytes))
            prices[device, batch] = max(need, floor)
        return prices[device, batch]

    def _place(self, job: Job, ledger: Ledger, free: list[int | None], now: float) -> Job | None:
        assert self.devices is not None
        spec = job.spec
        if spec.devices.count > 1:
            self._fail(job, ONE_DEVICE)
            return None
        try:
            candidates = tuple(self._index[d.id] for d in matching_devices(spec, self.devices))
        except Exception as exc:  # one job's bad spec fails that job, never the round
            self._fail(job, _cannot_place(exc))
            return None
        got: Reservation | None = None
        wanted: int | None = None
        needs: dict[int, int] = {}
        batch: int | None = None
        accum: int | None = None
        try:
            for batch, accum in _batches(spec):  # noqa: B007 (the batch it is admitted at)
                needs = {i: self._price(job, i, batch) for i in candidates}
                wanted = max(needs.values(), default=None) if wanted is None else wanted
                got = ledger.place(job.id, needs, self._chooser, free)
                if got is not None:
                    break
        except Exception as exc:  # an estimate that fails at this batch, an overflow ...
            if self.estimate_worker is not None and self.estimate_worker.closed:
                raise  # the service stops: the job stays queued for the next scheduler
            self._fail(job, _cannot_place(exc))
            return None
        if got is None:
            if job.overruns and all(
                v + ledger.margin_for(v) > ledger.capacity[i] for i, v in needs.items()
            ):
                # It was measured to use more than any device here can give: it would wait
                # for ever. (A job never run waits: another scheduler may have the room.)
                least = min(needs.values(), default=0)
                self._fail(
                    job,
                    f"{job.reason or 'it used more memory than its share'}; it needs at least"
                    f" {format_bytes(least)} with the margin now, more than any device here"
                    " can take",
                )
                return None
            floor = min((v + ledger.margin_for(v) for v in needs.values()), default=0)
            passed = _Passed(floor, wanted, candidates)
            self._passed[job.id] = passed
            self._say_why(job, self._why_waiting(needs, ledger, free))
            self._check_wait(job, passed, ledger, free, now)
            return None
        device = self.devices[got.device]
        # The reason it waited goes with the wait.
        cleared = {"reason": None} if self._waits.pop(job.id, None) is not None else {}
        if not self.store.move(
            job.id,
            "queued",
            "admitted",
            device=device.id,
            reserved_bytes=got.total,
            admitted_at=time.time(),
            batch_size=batch,
            grad_accum=accum,
            supervisor_pid=None,
            supervisor_started=None,
            pid=None,
            **cleared,
        ):
            ledger.release(job.id)
            return None  # cancelled meanwhile
        log.info(
            "admitted job %s (%s) on %s with %s",
            job.id,
            job.name,
            device.id,
            format_bytes(got.total),
        )
        return self.store.get(job.id)

    def _why_waiting(self, needs: dict[int, int], ledger: Ledger, free: list[int | None]) -> str:
        """Why a job with ``needs`` (bytes per candidate device) fits nowhere now: its need
        with the margin against the most any device has free, or the largest device's
        capacity where no device could ever take it."""
        assert self.devices is not None
        if not needs:
            return "waiting: none of this scheduler's devices meets its device constraints"
        totals = {i: v + ledger.margin_for(v) for i, v in needs.items()}
        least = min(totals.values())
        if all(totals[i] > ledger.capacity[i] for i in totals):
            biggest = max(totals, key=lambda i: ledger.capacity[i])
            return (
                f"waiting: needs {format_bytes(totals[biggest])} with the margin; the largest"
                f" device has {format_bytes(ledger.capacity[biggest])}"
                f" ({self.devices[biggest].id}): no device here can ever take it"
            )
        limit = ledger.max_concurrent_jobs
        open_ = [i for i in totals if limit is None or ledger.jobs(i) < limit]
        if not open_:
            return f"waiting: every device runs its most jobs (max_concurrent_jobs {limit})"
        most = max(open_, key=lambda i: ledger.available(i, free[i]))
        return (
            f"waiting: needs {format_bytes(least)} with the margin, most free is"
            f" {format_bytes(ledger.available(most, free[most]))} on {self.devices[most].id}"
        )

    def _say_why(self, job: Job, reason: str) -> None:
        """Write why ``job`` waits as its reason, when that changed (a compare-and-set on
        ``queued``: a job cancelled meanwhile keeps its own)."""
        if self._waits.get(job.id) == reason:
            return
        if self.store.move(job.id, "queued", "queued", reason=reason):
            self._waits[job.id] = reason

    def _check_wait(
        self, job: Job, passed: _Passed, ledger: Ledger, free: list[int | None], now: float
    ) -> None:
        """Fail a job that fit nowhere once it has waited past its wait timeout."""
        assert self.devices is not None
        timeout = job.spec.wait_timeout
        if timeout is None or now - job.submitted_at < timeout:
            return
        rooms = passed.candidates or tuple(range(len(self.devices)))
        largest = max(rooms, key=lambda i: ledger.available(i, free[i]), default=None)
        where = (
            f"largest free: {format_bytes(ledger.available(largest, free[largest]))}"
            f" on {self.devices[largest].id}"
            if largest is not None
            else "no device matched"
        )
        wanted = format_bytes(passed.wanted) if passed.wanted is not None else "its need"
        self._fail(job, f"no device had {wanted} free within {timeout:g} s ({where})")

    def _fail(self, job: Job, reason: str, state: str = "failed") -> None:
        self.store.move(job.id, "queued", state, reason=reason, finished_at=time.time())


#: Why a job asking for several devices at once is refused (it was given one device and one
#: reservation, silently).
ONE_DEVICE = (
    "devices.count: this queue places a job on one device (with one reservation); a job that"
    " needs several at once cannot be placed as asked: run one job per device"
)


def _cannot_place(exc: Exception) -> str:
    """Why a job failed while it was priced or placed: a spec's own error as it is, any
    other with its type (the queue goes on without the job)."""
    if isinstance(exc, JobSpecError):
        return str(exc)
    log.warning("a job could not be priced or placed", exc_info=exc)
    first = str(exc).split("\n")[0][:300]
    return f"could not be priced or placed: {type(exc).__name__}: {first}"


def _batches(spec: JobSpec) -> list[tuple[int | None, int | None]]:
    """(batch, accumulation) to try, largest first: the spec's batch, then smaller
    divisors of the effective batch (only where an estimate can price them)."""
    if spec.batch_size is None:
        return [(None, None)]
    target = spec.effective_batch or spec.batch_size
    full: list[tuple[int | None, int | None]] = [(spec.batch_size, target // spec.batch_size)]
    if spec.effective_batch is None or spec.memory.kind != "estimate":
        return full
    smaller = [b for b in range(spec.batch_size - 1, 0, -1) if target % b == 0]
    return full + [(b, target // b) for b in smaller]


def _usage(device: Device, jobs: Sequence[Job]) -> dict[str, int]:
    """What each of ``jobs`` holds of ``device`` now, by job id: on a CUDA device the
    memory NVML gives its processes, elsewhere the resident memory of its processes (0
    where it cannot be read)."""
    job_usage = getattr(device, "job_usage", None)
    if job_usage is not None:  # a Ray cluster's GPU: what its resource already leaves out
        return dict(job_usage(jobs))
    out: dict[str, int] = {}
    if device.is_cuda:
        held = {p.pid: int(p.used) for p in device.processes() if p.used is not NA}
        for job in jobs:
            pids = _tree(job.pid) if job.pid is not None else []
            out[job.id] = sum(held.get(p, 0) for p in pids)
        return out
    for job in jobs:
        out[job.id] = 0 if job.pid is None else tree_rss(job.pid)
    return out


#: The key under which a job's prices keep the attempt they were made for.
_ATTEMPT = (-1, -1)


def _floor(job: Job, batch: int | None, learned: int | None) -> int:
    """The least a job needs whatever its spec says, from what its runs measured.

    - Its last attempt overran its share (``need_bytes``): at that attempt's batch or a
      larger one.
    - Earlier runs of this very job (the same spec: :func:`run_key`) peaked at
      ``learned``: at the spec's own batch. (A ``learned`` need prices its name's peak
      with its own margin.)
    """
    floor = 0
    if job.need_bytes is not None and (
        batch is None or job.batch_size is None or batch >= job.batch_size
    ):
        floor = job.need_bytes
    own = batch is None or batch == job.spec.batch_size
    if learned is not None and own:
        floor = max(floor, learned)
    return floor


def _group_runs(job: Job) -> bool:
    """Whether the job's process group (led by ``job.pid``, a session of its own) still has
    a process that runs (a zombie, exited and not yet reaped, does not). The group's id is
    not given to a new process while the group lasts; a leader that runs is checked to be
    the job's (started with or after its run)."""
    assert job.pid is not None
    try:
        os.killpg(job.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False  # gone, or not this user's (so not the job's)
    try:
        leader = psutil.Process(job.pid)
        if leader.status() != psutil.STATUS_ZOMBIE:
            if os.getpgid(job.pid) != job.pid:
                return False
            if job.pid_started is not None:  # the very process that was started
                return abs(leader.create_time() - job.pid_started) < 0.01
            # A store of an earlier version: started with or after the job's run.
            return leader.create_time() >= (job.started_at or 0.0) - 1.0
    except (psutil.Error, OSError):
        pass
    # The leader has exited: does the rest of its group run on?
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if (
                proc.pid != job.pid
                and os.getpgid(proc.pid) == job.pid
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (empty if it is gone)."""
    try:
        proc = psutil.Process(pid)
        return [pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.Error:
        return []
