"""The scheduler: admits queued jobs by memory, places them, starts their supervisors.

Each round (:meth:`Scheduler.run_once`):

1. **Adopt.** Every ``admitted`` or ``running`` job whose supervisor is gone (its pid no
   longer runs with the start time recorded) is failed with the reason, or queued again
   while its retries last. A restarted scheduler so takes over the jobs its predecessor
   started: their supervisors went on without it.
2. **Ledger.** Per device: its capacity, the bytes reserved by the jobs that hold it
   (``admitted`` and ``running``), and what the device reports free now, so memory taken
   outside vramctl counts. A job's room on a device is the least of ``capacity - reserved``
   and ``free now``, less the safety margin of the need.
3. **Admit.** Queued jobs in order of priority plus age (a job gains one priority point
   for every ``aging_s`` it waits, so nothing starves), then submission. A job that fits
   nowhere is passed over and smaller ones behind it go first (backfill). A job with an
   ``effective_batch`` that does not fit at its batch size is priced at smaller batches
   (divisors of the effective batch) and admitted at the largest that fits, with the
   gradient accumulation that keeps the effective batch. A job that waits past its
   ``wait_timeout`` fails, saying how much it needed and the most any device had free.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from vramctl._units import format_bytes
from vramctl.device import Device, gpus, resolve
from vramctl.jobs._need import device_capacity, matching_devices, price
from vramctl.jobs._placement import (
    BestFit,
    ClusterState,
    Fragmentation,
    LeastLoaded,
    MostFree,
    Policy,
    Request,
)
from vramctl.jobs._spec import JobSpec, JobSpecError
from vramctl.jobs._store import ACTIVE, Job, JobStore
from vramctl.jobs._supervise import tree_rss

__all__ = ["POLICIES", "Scheduler"]

log = logging.getLogger("vramctl.jobs")

#: How a job's device is chosen among those with room (the placement module's policies):
#: ``best-fit`` (the least room left after it, which keeps large holes for large jobs),
#: ``most-free``, ``least-loaded`` (fewest jobs) and ``fragmentation`` (FGD's: where the
#: expected fragmentation for the mix of jobs seen grows least).
POLICIES = ("best-fit", "most-free", "least-loaded", "fragmentation")


def _policy(name: str) -> Policy:
    made: dict[str, Callable[[], Policy]] = {
        "best-fit": BestFit,
        "most-free": MostFree,
        "least-loaded": LeastLoaded,
        "fragmentation": Fragmentation,
    }
    return made[name]()


@dataclass
class _Room:
    device: Device
    capacity: int
    reserved: int
    free_now: int
    jobs: int

    @property
    def room(self) -> int:
        return max(0, min(self.capacity - self.reserved, self.free_now))


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
    _prices: dict[tuple[str, str, int | None], int] = field(default_factory=dict, repr=False)
    _started: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise JobSpecError(
                f"unknown placement policy {self.policy!r}; policies: {', '.join(POLICIES)}",
                what="invalid scheduler settings",
            )
        if self.devices is None:
            self.devices = gpus() or [resolve("cpu")]
        ids = [d.id for d in self.devices]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise JobSpecError(
                f"device {twice[0]} is given twice: the scheduler keys its ledger by device id"
                " (simulated GPUs of one size share theirs: give each a catalog name or size"
                " of its own)",
                what="invalid scheduler settings",
            )
        self._chooser = _policy(self.policy)

    # -- one round -----------------------------------------------------------------------

    def run_once(self) -> list[Job]:
        """One round: adopt, then admit what fits. Returns the jobs admitted."""
        self._reap()
        self.adopt()
        admitted = []
        # One admission at a time per store: two schedulers (a service and a `vramctl
        # run`) reading the same ledger must not both promise the same memory.
        with self.store.admission_lock():
            rooms = self._rooms()
            now = time.time()
            for job in self._queue(now):
                if self.only is not None and job.id not in self.only:
                    continue
                placed = self._place(job, rooms, now)
                if placed is not None:
                    admitted.append(placed)
        # Started after the round's admissions are committed: starting a process takes tens
        # of milliseconds, which the admissions after it would otherwise wait for. (A
        # scheduler killed in between leaves admitted jobs without a supervisor: the next
        # adopts and queues them again after the start grace.)
        for job in admitted:
            if self.launch is not None:
                self.launch(job)
            else:
                self._start(job.id)
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
        """Fail (or queue again) the active jobs whose supervisor is gone; returns them."""
        lost: list[Job] = []
        if self.launch is not None:
            return lost  # jobs started by a launch hook have no supervisor to watch
        for job in self.store.list(ACTIVE):
            if job.id in self._started and self._started[job.id].poll() is None:
                continue
            starting = job.id in self._started or time.time() - (job.admitted_at or 0) < 30
            if job.state == "admitted" and job.supervisor_pid is None and starting:
                continue  # its supervisor is starting
            if job.supervisor_pid is not None and _alive(
                job.supervisor_pid, job.supervisor_started
            ):
                continue
            if job.pid is not None and _alive(job.pid, None):
                continue  # the job itself runs on: its reservation stays until it ends
            reason = "its supervisor died; the job's exit status is unknown"
            retry = job.attempts <= job.spec.retries
            if retry and self.store.move(job.id, job.state, "queued", reason=reason):
                log.warning("job %s (%s): %s; queued again", job.id, job.name, reason)
            elif self.store.move(
                job.id, job.state, "failed", reason=reason, finished_at=time.time()
            ):
                log.warning("job %s (%s): %s", job.id, job.name, reason)
            lost.append(self.store.get(job.id))
        return lost

    def _reap(self) -> None:
        for job_id, proc in list(self._started.items()):
            if proc.poll() is not None:
                del self._started[job_id]

    # -- the ledger ----------------------------------------------------------------------

    def _rooms(self) -> dict[str, _Room]:
        assert self.devices is not None
        active = self.store.list(ACTIVE)
        rooms = {}
        for dev in self.devices:
            held = [j for j in active if j.device == dev.id]
            reserved = sum(j.reserved_bytes or 0 for j in held)
            capacity = device_capacity(dev)
            try:
                free_now = int(dev.available())
            except Exception:  # an unreadable device is taken as its ledger says
                free_now = capacity - reserved
            # What the device reports free already excludes what the jobs holding it use;
            # the part of their reservations they have not used yet is still theirs.
            used_by_jobs = sum(_job_usage(j) for j in held)
            unused = max(0, reserved - used_by_jobs)
            rooms[dev.id] = _Room(dev, capacity, reserved, free_now - unused, len(held))
        return rooms

    # -- admission -----------------------------------------------------------------------

    def _queue(self, now: float) -> list[Job]:
        queued = self.store.list(["queued"])
        return sorted(
            queued, key=lambda j: (-(j.priority + (now - j.submitted_at) / self.aging_s), j.seq)
        )

    def _price(self, job: Job, dev: Device, batch: int | None) -> int:
        key = (job.id, dev.id, batch)
        if key not in self._prices:
            learned = (
                self.store.learned_peak(job.name) if job.spec.memory.kind == "learned" else None
            )
            self._prices[key] = price(job.spec, dev, learned_peak=learned, batch_size=batch)
        return self._prices[key]

    def _place(self, job: Job, rooms: dict[str, _Room], now: float) -> Job | None:
        spec = job.spec
        try:
            candidates = [
                rooms[d.id] for d in matching_devices(spec, [r.device for r in rooms.values()])
            ]
        except JobSpecError as exc:
            self._fail(job, str(exc))
            return None
        best: tuple[_Room, int, int | None, int | None] | None = None
        need_full: int | None = None
        try:
            for batch, accum in _batches(spec):
                needs = {r.device.id: self._price(job, r.device, batch) for r in candidates}
                need_full = max(needs.values(), default=None) if need_full is None else need_full
                room = self._choose(candidates, needs)
                if room is not None:
                    # The reservation is the need and its margin: the job's share.
                    held = int(needs[room.device.id] * (1 + self.margin))
                    best = (room, held, batch, accum)
                    break
        except JobSpecError as exc:
            self._fail(job, str(exc))
            return None
        if best is None:
            waited = now - job.submitted_at
            timeout = spec.wait_timeout
            if timeout is not None and waited >= timeout:
                largest = max(candidates or rooms.values(), key=lambda r: r.room, default=None)
                where = (
                    f"largest free: {format_bytes(largest.room)} on {largest.device.id}"
                    if largest is not None
                    else "no device matched"
                )
                wanted = format_bytes(need_full) if need_full is not None else "its need"
                self._fail(
                    job, f"no device had {wanted} free within {timeout:g} s ({where})", "failed"
                )
            return None
        room, need, batch, accum = best
        if not self.store.move(
            job.id,
            "queued",
            "admitted",
            device=room.device.id,
            reserved_bytes=need,
            admitted_at=time.time(),
            batch_size=batch,
            grad_accum=accum,
            supervisor_pid=None,
            supervisor_started=None,
            pid=None,
        ):
            return None  # cancelled meanwhile
        room.reserved += need
        room.free_now -= need  # reserved, not used yet: no longer free for the next job
        room.jobs += 1
        log.info(
            "admitted job %s (%s) on %s with %s",
            job.id,
            job.name,
            room.device.id,
            format_bytes(need),
        )
        return self.store.get(job.id)

    def _choose(self, rooms: list[_Room], needs: dict[str, int]) -> _Room | None:
        """The room the policy picks among those where the job's need (plus the margin)
        fits: one node of one GPU per device."""
        if not rooms:
            return None
        asked = {r.device.id: needs[r.device.id] * (1 + self.margin) for r in rooms}
        if self.policy != "fragmentation":
            # The simple policies on a few devices: plain numbers, the same rules as the
            # placement module's (building its tensors per job would cost milliseconds).
            cap = self.max_concurrent_jobs
            fits = [
                r for r in rooms if asked[r.device.id] <= r.room and (cap is None or r.jobs < cap)
            ]
            if not fits:
                return None
            left = {r.device.id: r.room - asked[r.device.id] for r in fits}
            if self.policy == "best-fit":
                return min(fits, key=lambda r: left[r.device.id])
            if self.policy == "most-free":
                return max(fits, key=lambda r: left[r.device.id])
            return min(fits, key=lambda r: (r.jobs, -left[r.device.id]))  # least-loaded
        top = max(asked.values())
        state = ClusterState(
            [1] * len(rooms),
            [float(r.capacity) for r in rooms],
            max_jobs_per_gpu=self.max_concurrent_jobs,
        )
        for i, r in enumerate(rooms):
            # Asked the most any device needs; a device that needs less gets the difference.
            state.free[i] = float(r.room) + (top - asked[r.device.id])
            state.jobs[i] = r.jobs
        got = self._chooser.choose(state, Request(top))
        return None if got is None else rooms[got.gpus[0]]

    def _fail(self, job: Job, reason: str, state: str = "failed") -> None:
        self.store.move(job.id, "queued", state, reason=reason, finished_at=time.time())

    def _start(self, job_id: str) -> None:
        # Run by path: the supervisor imports neither vramctl nor PyTorch (see its module).
        script = str(Path(__file__).resolve().parent / "_supervise.py")
        argv = [sys.executable, script, str(self.store.path), job_id]
        self._started[job_id] = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # it outlives the scheduler
        )


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


def _job_usage(job: Job) -> int:
    """What a running job uses now (the resident memory of its processes); 0 if unknown."""
    return 0 if job.pid is None else min(tree_rss(job.pid), job.reserved_bytes or 0)


def _alive(pid: int, started: float | None) -> bool:
    """Whether ``pid`` runs, and is the process that started at ``started`` (not a reuse)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 0.01
    except psutil.Error:
        return False
