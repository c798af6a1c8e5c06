"""Device health: retry with backoff, and the states available, busy, error, disabled.

A reading that fails is retried with exponential backoff. A device whose
readings keep failing goes to ``ERROR`` and then ``DISABLED``; it keeps the
reason, selection skips it, and it is re-checked after ``recheck_after``
seconds so that a device that recovers comes back.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["DeviceHealth", "HealthPolicy", "HealthState", "ReadingFailed"]

log = logging.getLogger("vramctl.device")
T = TypeVar("T")


class HealthState(str, enum.Enum):
    """Whether a device takes work: available, busy, in error or disabled by its policy."""

    AVAILABLE = "available"
    BUSY = "busy"
    ERROR = "error"
    DISABLED = "disabled"

    def __str__(self) -> str:
        return self.value

    @property
    def usable(self) -> bool:
        """Whether selection may place work on a device in this state."""
        return self in (HealthState.AVAILABLE, HealthState.BUSY)


@dataclass(frozen=True)
class HealthPolicy:
    """How hard to retry, and when to give up on a device and look again."""

    #: Attempts per reading (the first one included).
    attempts: int = 3
    backoff_initial: float = 0.05
    backoff_factor: float = 2.0
    backoff_max: float = 1.0
    #: Consecutive failed readings before a device is disabled.
    disable_after: int = 3
    #: Seconds before a disabled device is tried again.
    recheck_after: float = 30.0
    #: Memory utilization at or above which a device is busy.
    busy_utilization: float = 0.98


class ReadingFailed(Exception):
    """A reading failed after every retry, or was skipped because the device is disabled."""


@dataclass
class _Status:
    state: HealthState = HealthState.AVAILABLE
    reason: str = ""
    failures: int = 0
    since: float = 0.0
    recheck_at: float = 0.0


class DeviceHealth:
    """Tracks one device's health across readings.

    >>> h = DeviceHealth("cuda:0", sleep=lambda s: None)
    >>> h.call(lambda: 42)
    42
    >>> h.state
    <HealthState.AVAILABLE: 'available'>
    """

    def __init__(
        self,
        name: str,
        policy: HealthPolicy | None = None,
        *,
        retry_on: tuple[type[BaseException], ...] = (Exception,),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.name = name
        self.policy = policy or HealthPolicy()
        self._retry_on = retry_on
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._status = _Status(since=clock())

    @property
    def state(self) -> HealthState:
        return self._status.state

    @property
    def reason(self) -> str:
        return self._status.reason

    @property
    def failures(self) -> int:
        return self._status.failures

    def to_dict(self) -> dict[str, Any]:
        s = self._status
        return {"state": s.state.value, "reason": s.reason, "consecutive_failures": s.failures}

    def _set(self, state: HealthState, reason: str) -> None:
        s = self._status
        if state != s.state:
            log.log(
                logging.WARNING if not state.usable else logging.INFO,
                "%s: %s -> %s%s",
                self.name,
                s.state.value,
                state.value,
                f" ({reason})" if reason else "",
            )
            s.since = self._clock()
        s.state, s.reason = state, reason

    def call(self, fn: Callable[[], T]) -> T:
        """Run one reading with retries; record success or failure.

        Raises :class:`ReadingFailed` (carrying the last error) when every
        attempt failed, or at once while the device is disabled and not yet due
        for a re-check.
        """
        with self._lock:
            s = self._status
            if s.state is HealthState.DISABLED and self._clock() < s.recheck_at:
                raise ReadingFailed(f"{self.name} is disabled: {s.reason}")
            rechecking = s.state is HealthState.DISABLED
        attempts = 1 if rechecking else max(1, self.policy.attempts)
        delay = self.policy.backoff_initial
        last: BaseException | None = None
        for attempt in range(attempts):
            try:
                value = fn()
            except self._retry_on as exc:
                last = exc
                if attempt + 1 < attempts:
                    self._sleep(delay)
                    delay = min(delay * self.policy.backoff_factor, self.policy.backoff_max)
                continue
            with self._lock:
                if self._status.state in (HealthState.ERROR, HealthState.DISABLED):
                    log.info("%s recovered after: %s", self.name, self._status.reason)
                    self._set(HealthState.AVAILABLE, "")
                self._status.failures = 0
            return value
        assert last is not None
        self._record_failure(last)
        raise ReadingFailed(f"{self.name}: {type(last).__name__}: {last}") from last

    def _record_failure(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        with self._lock:
            s = self._status
            s.failures += 1
            if s.failures >= self.policy.disable_after:
                s.recheck_at = self._clock() + self.policy.recheck_after
                self._set(
                    HealthState.DISABLED,
                    f"{reason} ({s.failures} failed readings; re-checked every "
                    f"{self.policy.recheck_after:g} s)",
                )
            else:
                self._set(HealthState.ERROR, reason)

    def observe(self, *, busy_reason: str | None) -> None:
        """After a good reading: mark the device busy (with why) or available."""
        with self._lock:
            if self._status.state in (HealthState.ERROR, HealthState.DISABLED):
                return
            if busy_reason:
                self._set(HealthState.BUSY, busy_reason)
            else:
                self._set(HealthState.AVAILABLE, "")

    def disable(self, reason: str) -> None:
        """Take the device out of selection by hand (re-checked like any disabled device)."""
        with self._lock:
            self._status.recheck_at = self._clock() + self.policy.recheck_after
            self._set(HealthState.DISABLED, reason)
