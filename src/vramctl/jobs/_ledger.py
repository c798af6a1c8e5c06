"""The ledger: memory reserved per device by the jobs vramctl admitted.

A job is admitted to a device with a reservation of its need plus a safety margin
(``max(min_margin, ceil(need * margin))`` bytes). What a device can still promise is

    available = min(capacity - reserved,
                    reported_free - outstanding)

- ``reserved``: the device's reservations summed;
- ``reported_free``: the device's own free memory, read each round (NVML / the driver),
  which already leaves out memory taken outside vramctl and what admitted jobs have
  allocated so far; None when it is not read (then only the first term counts);
- ``outstanding``: what admitted jobs may still allocate: each reservation less what
  :meth:`Ledger.mark_used` last said the job holds (its whole reservation until then).

So the ledger never promises memory twice: not to two jobs (the first term), and not
memory that someone outside vramctl took (the second). ``max_concurrent_jobs`` caps the
jobs per device. :meth:`Ledger.place` asks a placement :class:`Policy` for the device
among those that can take the job.

>>> ledger = Ledger([1000, 1000], margin=0.1)
>>> ledger.reserve("a", 0, 500).total
550
>>> ledger.available(0), ledger.available(0, reported_free=400)
(450, 0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vramctl._errors import VramctlError
from vramctl.jobs._placement import ClusterState, Policy, Request

__all__ = ["AdmissionError", "Ledger", "Reservation"]


class AdmissionError(VramctlError, RuntimeError):
    """A reservation the ledger cannot make (no room, too many jobs, a job id twice)."""


@dataclass(frozen=True)
class Reservation:
    """``job``'s reservation on ``device``: ``need`` plus ``margin`` (bytes)."""

    job: str
    device: int
    need: int
    margin: int

    @property
    def total(self) -> int:
        """What is reserved: need plus margin."""
        return self.need + self.margin


class Ledger:
    """Reservations per device (see the module). ``capacity``: each device's bytes;
    ``margin``: the safety margin as a share of the need, at least ``min_margin`` bytes;
    ``max_concurrent_jobs``: jobs per device at most (None: no limit)."""

    def __init__(
        self,
        capacity: Sequence[int],
        *,
        margin: float = 0.05,
        min_margin: int = 0,
        max_concurrent_jobs: int | None = None,
    ) -> None:
        if margin < 0 or min_margin < 0:
            raise ValueError("the safety margin cannot be negative")
        if max_concurrent_jobs is not None and max_concurrent_jobs < 1:
            raise ValueError("max_concurrent_jobs must be at least 1")
        self.capacity = [int(c) for c in capacity]
        self.margin = margin
        self.min_margin = min_margin
        self.max_concurrent_jobs = max_concurrent_jobs
        self._held: dict[str, Reservation] = {}
        self._used: dict[str, int] = {}
        # Per device, kept as reservations come and go: a scheduler asks for every
        # queued job, and its admissions must not cost a walk over every reservation.
        self._reserved = [0] * len(self.capacity)
        self._jobs = [0] * len(self.capacity)
        self._outstanding = [0] * len(self.capacity)

    def margin_for(self, need: int) -> int:
        """The safety margin added to ``need``."""
        return max(self.min_margin, math.ceil(need * self.margin))

    def reservations(self, device: int | None = None) -> list[Reservation]:
        """The reservations held, on ``device`` or on every device."""
        return [r for r in self._held.values() if device is None or r.device == device]

    def reserved(self, device: int) -> int:
        """The bytes reserved on ``device``."""
        return self._reserved[device]

    def jobs(self, device: int) -> int:
        """How many jobs hold a reservation on ``device``."""
        return self._jobs[device]

    def outstanding(self, device: int) -> int:
        """What the jobs on ``device`` may still allocate beyond what they hold."""
        return self._outstanding[device]

    def _unused(self, job: str) -> int:
        return max(0, self._held[job].total - self._used.get(job, 0))

    def mark_used(self, job: str, used: int) -> None:
        """``job`` now holds ``used`` bytes on its device (so the device's reported free
        memory already leaves them out)."""
        if job not in self._held:
            raise KeyError(f"no reservation for job {job!r}")
        device = self._held[job].device
        self._outstanding[device] -= self._unused(job)
        self._used[job] = max(0, int(used))
        self._outstanding[device] += self._unused(job)

    def available(self, device: int, reported_free: int | None = None) -> int:
        """The bytes ``device`` can still promise (see the module), never below 0."""
        room = self.capacity[device] - self._reserved[device]
        if reported_free is not None:
            room = min(room, int(reported_free) - self._outstanding[device])
        return max(0, room)

    def _full(self, device: int) -> bool:
        return (
            self.max_concurrent_jobs is not None and self._jobs[device] >= self.max_concurrent_jobs
        )

    def can_reserve(self, device: int, need: int, reported_free: int | None = None) -> bool:
        """Whether ``need`` (plus its margin) fits on ``device`` now."""
        total = int(need) + self.margin_for(int(need))
        return not self._full(device) and total <= self.available(device, reported_free)

    def largest(self, reported_free: Sequence[int | None] | None = None) -> int:
        """The most any device can still promise (0 on full devices), for a quick "fits
        nowhere" before a placement."""
        free = reported_free if reported_free is not None else [None] * len(self.capacity)
        return max(
            (self.available(d, free[d]) for d in range(len(self.capacity)) if not self._full(d)),
            default=0,
        )

    def reserve(
        self, job: str, device: int, need: int, reported_free: int | None = None
    ) -> Reservation:
        """Reserve ``need`` plus its margin on ``device`` for ``job``; raises
        :class:`AdmissionError` where it does not fit or the job already holds one."""
        if job in self._held:
            raise AdmissionError(f"job {job!r} already holds a reservation")
        if not 0 <= device < len(self.capacity):
            raise AdmissionError(f"no device {device} in this ledger")
        if not self.can_reserve(device, need, reported_free):
            raise AdmissionError(
                f"job {job!r}: {need} + margin does not fit on device {device} "
                f"({self.available(device, reported_free)} available, "
                f"{self.jobs(device)} jobs)"
            )
        return self._hold(Reservation(job, device, int(need), self.margin_for(int(need))))

    def restore(self, job: str, device: int, total: int, used: int = 0) -> Reservation:
        """Hold again a reservation made earlier (``total`` bytes, its margin included, as a
        store recorded it), without the checks of :meth:`reserve`: it was admitted once,
        and stays while its job runs even where the device has less room now."""
        if job in self._held:
            raise AdmissionError(f"job {job!r} already holds a reservation")
        if not 0 <= device < len(self.capacity):
            raise AdmissionError(f"no device {device} in this ledger")
        held = self._hold(Reservation(job, device, int(total), 0))
        self.mark_used(job, used)
        return held

    def _hold(self, held: Reservation) -> Reservation:
        self._held[held.job] = held
        self._reserved[held.device] += held.total
        self._jobs[held.device] += 1
        self._outstanding[held.device] += held.total
        return held

    def release(self, job: str) -> Reservation:
        """Drop ``job``'s reservation (when it ends) and return it."""
        if job not in self._held:
            raise KeyError(f"no reservation for job {job!r}")
        held = self._held[job]
        self._outstanding[held.device] -= self._unused(job)
        self._reserved[held.device] -= held.total
        self._jobs[held.device] -= 1
        self._used.pop(job, None)
        return self._held.pop(job)

    def state(self, reported_free: Sequence[int | None] | None = None) -> ClusterState:
        """The devices as a :class:`ClusterState` for a policy: one node per device, its
        free memory what it can still promise, its jobs counted."""
        n = len(self.capacity)
        free = reported_free if reported_free is not None else [None] * n
        state = ClusterState(
            [1] * n, [float(c) for c in self.capacity], max_jobs_per_gpu=self.max_concurrent_jobs
        )
        state.free = torch.tensor(
            [float(self.available(d, free[d])) for d in range(n)], dtype=torch.float64
        )
        state.jobs = torch.tensor(self._jobs, dtype=torch.int64)
        return state

    def place(
        self,
        job: str,
        need: int | Mapping[int, int],
        policy: Policy,
        reported_free: Sequence[int | None] | None = None,
    ) -> Reservation | None:
        """Reserve ``need`` for ``job`` on the device ``policy`` chooses among those where
        it fits, or None where it fits on none.

        ``need`` is bytes on any device, or bytes per device (a need estimated for each
        GPU model): then only those devices are candidates, and each is offered to the
        policy as if the job asked the most it asks anywhere, with the difference added
        to the device's free memory, so one request compares them all.
        """
        n = len(self.capacity)
        needs = (
            dict.fromkeys(range(n), int(need))
            if isinstance(need, int)
            else {int(d): int(v) for d, v in need.items()}
        )
        if not needs:
            return None
        totals = {d: v + self.margin_for(v) for d, v in needs.items()}
        top = max(totals.values())
        given = reported_free if reported_free is not None else [None] * n
        free = [-1.0] * n  # not a candidate: fits nothing
        for d, total in totals.items():
            free[d] = float(self.available(d, given[d]) + (top - total))
        pick = getattr(policy, "pick", None)
        if pick is not None:
            device = pick(free, self._jobs, float(top), self.max_concurrent_jobs)
        else:
            state = ClusterState(
                [1] * n,
                [float(c) for c in self.capacity],
                max_jobs_per_gpu=self.max_concurrent_jobs,
            )
            state.free = torch.tensor(free, dtype=torch.float64)
            state.jobs = torch.tensor(self._jobs, dtype=torch.int64)
            got = policy.choose(state, Request(float(top)))
            device = None if got is None else got.gpus[0]
        if device is None:
            return None
        return self.reserve(job, device, needs[device], given[device])
