"""Step-aware memory leak detection: a trend test on each step's memory, and a census that names
the code that leaks.

Call :meth:`LeakDetector.step` once per training step, at the same point of
every step (after ``optimizer.step()``, say), or let :meth:`LeakDetector.hook`
call it from the optimizer. Each call reads the memory this process has
allocated on the device: ``torch.cuda.memory_allocated`` on a GPU, the bytes
malloc has handed out (glibc's ``mallinfo2``) on the CPU. After ``warmup``
steps it keeps the last ``window`` readings and tests them for a trend that a
healthy loop does not have: a Mann–Kendall test at ``confidence``, a
Theil–Sen slope of at least ``min_rate`` bytes per step, and growth that goes
on to the newest readings (a cache that fills, then stops, and a one-off jump
such as the optimizer state made at the first step, do not count).

When the trend becomes suspicious, a census watches the next steps: the
tensors they create, with the line of your code that created each one, and
which of them are still alive two steps later. Those survivors, grouped by
shape, dtype and line, are the report's suspects; what holds them (a list that
grows, an autograd graph kept alive) gives its likely causes. The census runs
for a few steps only, keeps no tensor alive and changes no result.

>>> import torch
>>> from vramctl.monitor._leak import LeakDetector
>>> detector = LeakDetector("cpu", census=True)
>>> kept = []
>>> for _ in range(50):
...     kept.append(torch.ones(256, 1024))       # 1 MiB kept every step: a leak
...     report = detector.step()
...     if report is not None:
...         break
>>> report.step <= 50, report.suspects[0].shape, report.suspects[0].holder
(True, (256, 1024), 'list')
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vramctl._errors import VramctlError
from vramctl._units import format_bytes, parse_size
from vramctl.device import Device, resolve
from vramctl.monitor._census import (
    CENSUS_MAX_RECORD_STEPS,
    CENSUS_SURVIVE_STEPS,
    Census,
    CensusResult,
    LeakSuspect,
)
from vramctl.monitor._heap import cpu_signal, cuda_reader
from vramctl.monitor._trend import Trend, Window, mann_kendall, persistent, theil_sen

__all__ = ["LeakDetector", "LeakDetectorError", "LeakHook", "LeakReport", "LeakSuspect"]

log = logging.getLogger("vramctl.monitor")

#: Readings before the census may start (the report needs ``max(10, window // 2)``).
_CENSUS_MIN_POINTS = 10


class LeakDetectorError(VramctlError, ValueError):
    """A leak detector was given a setting or a device it cannot use."""


# -- the report ------------------------------------------------------------------------


@dataclass(frozen=True)
class LeakReport:
    """A leak: memory that grows step after step, with what the census found.

    ``rate_bytes_per_step`` is the Theil–Sen slope of the last ``window``
    readings; ``p_value`` and ``z`` are the Mann–Kendall test's (one-sided, that
    memory grows). ``growth_bytes`` is the growth since the first reading after
    warmup (at ``baseline_step``). ``suspects`` are the census's, largest first;
    ``causes`` say in words what most likely holds the memory and what to do.
    """

    step: int
    device: str
    signal: str
    rate_bytes_per_step: float
    window: int
    confidence: float
    p_value: float
    z: float
    current_bytes: int
    growth_bytes: int
    baseline_step: int
    suspects: tuple[LeakSuspect, ...] = ()
    causes: tuple[str, ...] = ()
    census: str = "off"

    def format(self) -> str:
        """The report as a few readable lines."""
        lines = [
            f"memory leak on {self.device} at step {self.step}: "
            f"{format_bytes(self.rate_bytes_per_step, signed=True)} per step over the last "
            f"{self.window} steps (Mann-Kendall p = {self.p_value:.1e}), "
            f"{format_bytes(self.growth_bytes, signed=True)} since step {self.baseline_step}; "
            f"now {format_bytes(self.current_bytes)} ({self.signal})"
        ]
        if self.suspects:
            lines.append(f"  suspects ({self.census}):")
            lines += [f"    {s.describe()}" for s in self.suspects]
        else:
            lines.append(f"  census: {self.census}")
        lines += [f"  likely cause: {c}" for c in self.causes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = {k: v for k, v in asdict(self).items() if k not in ("suspects", "causes")}
        out["suspects"] = [s.to_dict() for s in self.suspects]
        out["causes"] = list(self.causes)
        return out


# -- the device ----------------------------------------------------------------------


def _resolve_device(device: str | torch.device | None) -> Device:
    """The device to watch: resolved by :func:`vramctl.device.resolve`'s rules."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, torch.device):
        device = str(device)
    try:
        dev = resolve(device)
    except VramctlError as exc:
        raise LeakDetectorError(
            f"{exc}; the leak detector reads memory: use 'cpu' or 'cuda:N'"
        ) from exc
    if dev.is_gpu and not dev.is_cuda:
        raise LeakDetectorError(
            f"the leak detector reads CPU and CUDA memory, not {dev.id}: use 'cpu' or 'cuda:N'"
        )
    return dev


# -- the detector ----------------------------------------------------------------------------


class LeakHook:
    """The handle :meth:`LeakDetector.hook` returns: ``remove()`` unhooks the detector."""

    def __init__(self, detector: LeakDetector, handle: Any) -> None:
        self._detector = detector
        self._handle = handle

    def remove(self) -> None:
        """Stop calling the detector from the optimizer, and end a census under way."""
        self._handle.remove()
        self._detector.close()


class LeakDetector:
    """Finds memory that grows step after step, and names the code that keeps it.

    ``step()`` reads this process's allocated memory on ``device`` (``cuda:N``
    by default when CUDA is available, else ``cpu``) once per training step.
    It returns a :class:`LeakReport` when the memory has grown by at least
    ``min_rate`` bytes per step (an int, or a size such as ``"1MiB"``) over the
    last ``window`` readings, significantly at ``confidence`` and up to the
    newest readings; else ``None``. The first ``warmup`` steps are ignored. A
    report goes out once per leak; the detector re-arms once memory stops
    growing. It is also logged (logger ``vramctl.monitor``, level WARNING; not
    with ``log_reports=False``) and passed to ``on_leak``; every report is kept
    in :attr:`reports`.

    With ``census=True`` (the default) a suspicious trend starts a census of a
    few steps that names the tensors that leak (:class:`LeakSuspect`). It
    records the steps of the thread that calls ``step()``. Call :meth:`close`
    (or use the detector as a context manager) if the loop may end while a
    census is under way. ``census=False`` only detects.

    :attr:`signal` says what is read (and :attr:`signal_note` why it is not the exact
    reading, where it is not); :meth:`read` reads it now. :meth:`reset`
    forgets the readings (a new phase of the run); :attr:`censuses` counts the
    censuses run.

    >>> import torch
    >>> from vramctl.monitor._leak import LeakDetector
    >>> model = torch.nn.Linear(64, 64)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> detector = LeakDetector("cpu")
    >>> handle = detector.hook(opt)          # step() runs after every opt.step()
    >>> for _ in range(60):
    ...     model(torch.randn(32, 64)).square().mean().backward()
    ...     opt.step()
    ...     opt.zero_grad()
    >>> handle.remove()
    >>> detector.steps, detector.reports
    (60, [])
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        min_rate: int | str = 256 * 1024,
        window: int = 40,
        warmup: int = 5,
        confidence: float = 0.999,
        census: bool = True,
        on_leak: Callable[[LeakReport], None] | None = None,
        log_reports: bool = True,
    ) -> None:
        try:
            rate = parse_size(min_rate)
        except VramctlError as exc:
            raise LeakDetectorError(f"min_rate: {exc}") from None
        if rate <= 0:
            raise LeakDetectorError(
                f"min_rate={min_rate!r}: the smallest growth to report must be more than 0 "
                "bytes per step, e.g. 256 * 1024 or '1MiB'"
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 10:
            raise LeakDetectorError(
                f"window={window!r}: the trend test needs at least 10 readings (default 40)"
            )
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise LeakDetectorError(f"warmup={warmup!r}: use a number of steps, 0 or more")
        if isinstance(confidence, bool) or not 0.0 < float(confidence) < 1.0:
            raise LeakDetectorError(
                f"confidence={confidence!r}: use a probability strictly between 0 and 1, e.g. 0.999"
            )
        if on_leak is not None and not callable(on_leak):
            raise LeakDetectorError(f"on_leak={on_leak!r}: use a function of one LeakReport")
        watched = _resolve_device(device)
        #: The torch device whose memory is read (its tensors are the census's).
        self.device = watched.torch_device
        self._cuda = watched.is_cuda
        self.min_rate = rate
        self.window = window
        self.warmup = warmup
        self.confidence = float(confidence)
        self.census = bool(census)
        self.on_leak = on_leak
        #: Log each report as a warning (a Monitor turns this off: it raises an alert instead).
        self.log_reports = log_reports
        self.reports: list[LeakReport] = []
        #: How many censuses have run (each records a few steps).
        self.censuses = 0
        self._alpha = 1.0 - self.confidence
        self._census_alpha = max(self._alpha, min(0.05, 20 * self._alpha))
        self._min_points = max(_CENSUS_MIN_POINTS, window // 2)
        #: Why :attr:`signal` is not the exact reading of the device (glibc's malloc
        #: counters on a CPU: they do not see tensors, or their probe could not be
        #: allocated), or None.
        self.signal_note: str | None = None
        if self._cuda:
            index = self.device.index or 0
            self.signal = f"torch.cuda.memory_allocated({index})"
            self._read = cuda_reader(index)
        else:
            self.signal, self._read, self.signal_note = cpu_signal()
        self._win = Window(window)
        self._steps = 0
        self._baseline: tuple[int, int] | None = None  # (step, bytes)
        self._episode = False
        self._pending: Trend | None = None
        self._census: Census | None = None
        self._census_result: CensusResult | None = None
        self._last_census_start = -(10**9)
        self._offset = 0  # memory the detector itself took (the census's first start)
        self._last_raw = 0

    # -- public ---------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """How many times :meth:`step` has been called."""
        return self._steps

    @property
    def readings(self) -> tuple[int, ...]:
        """The readings (bytes) the trend test looks at, oldest first."""
        return tuple(self._win.ys)

    def read(self) -> int:
        """The signal now, in bytes (what :meth:`step` reads; see :attr:`signal`)."""
        return self._read()

    @property
    def census_active(self) -> bool:
        """True while a census records or waits for the steps it checks."""
        return self._census is not None

    def step(self) -> LeakReport | None:
        """Read memory once for this step; a :class:`LeakReport` when a leak is found."""
        self._steps = k = self._steps + 1
        if k <= self.warmup:
            return None
        self._last_raw = raw = self._read()
        win = self._win
        win.push(raw - self._offset)
        if self._baseline is None:
            self._baseline = (k, raw - self._offset)
        if self._census is not None:
            self._advance_census(k, raw)
        # The hot path ends here: a cheap least-squares screen before any full test.
        if (
            self._episode
            or self._pending is not None
            or (len(win.ys) >= _CENSUS_MIN_POINTS and win.ols_slope() >= self.min_rate)
        ):
            return self._test(k)
        return None

    def _test(self, k: int) -> LeakReport | None:
        win = self._win
        n = len(win.ys)
        if self._episode:
            if n >= self._min_points and win.ols_slope() < self.min_rate / 2:
                self._episode = False  # memory stopped growing: re-armed
            return None
        if self._pending is not None:
            if self._census is None:
                return self._emit(k, self._pending)
            return None
        # The full test, cheapest part first: most windows that pass the screen (a jump,
        # a cache that filled) are not persistent growth.
        ys = list(win.ys)
        if not persistent(ys, self.min_rate):
            return None
        slope = theil_sen(ys)
        if slope < self.min_rate:
            return None
        trend = Trend(n, slope, *mann_kendall(ys), persistent=True)
        if n >= self._min_points and trend.p_value <= self._alpha:
            if not self.census or self._fresh_census(k):
                return self._emit(k, trend)
            self._pending = trend
            if self._census is None:
                self._start_census(k)
            return None
        if (
            self.census
            and trend.p_value <= self._census_alpha
            and self._census is None
            and k - self._last_census_start > 2 * self.window
        ):
            self._start_census(k)
        return None

    def hook(self, optimizer: torch.optim.Optimizer) -> LeakHook:
        """Call :meth:`step` after every ``optimizer.step()``; ``remove()`` the handle to stop.

        Reports go to ``on_leak``, the log and :attr:`reports`.
        """
        if not hasattr(optimizer, "register_step_post_hook"):
            raise LeakDetectorError(
                f"{type(optimizer).__name__} has no register_step_post_hook: call "
                "detector.step() yourself after each step"
            )

        def post_hook(opt: Any, args: Any, kwargs: Any) -> None:
            self.step()

        return LeakHook(self, optimizer.register_step_post_hook(post_hook))

    def reset(self) -> None:
        """Forget the readings (after a phase change, say); a census under way ends."""
        self.close()
        self._win.clear()
        self._baseline = None
        self._episode = False
        self._pending = None
        self._census_result = None

    def close(self) -> None:
        """End a census under way (it records nothing more and keeps nothing)."""
        if self._census is not None:
            self._census.close()
            self._census = None
            # A detection that waited for this census goes out with the next reading.

    def __del__(self) -> None:
        # A detector dropped during a census must not leave its dispatch mode recording.
        with contextlib.suppress(Exception):  # a half-built detector, or interpreter shutdown
            self.close()

    def __enter__(self) -> LeakDetector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LeakDetector(device={str(self.device)!r}, min_rate={self.min_rate}, "
            f"window={self.window}, warmup={self.warmup}, confidence={self.confidence}, "
            f"census={self.census}, signal={self.signal!r}, steps={self._steps})"
        )

    # -- internals ------------------------------------------------------------------------

    def _fresh_census(self, k: int) -> bool:
        r = self._census_result
        return r is not None and bool(r.suspects) and k - r.done_step <= self.window

    def _start_census(self, k: int) -> None:
        self.censuses += 1
        self._last_census_start = k
        self._census_result = None
        census = Census(self.device, k, cuda=self._cuda)
        before = self._read()
        try:
            census.start()
        except Exception as exc:
            census.close()
            self._census_result = CensusResult(k, (), (), f"the census could not start: {exc}")
            return
        finally:
            # What starting the census takes (imports, on the first one) is not the loop's.
            census.start_reading = after = self._read()
            self._offset += after - before
        self._census = census

    def _advance_census(self, k: int, raw: int) -> None:
        """Stop recording once the leak has shown itself, then check what outlived it.

        The census records at least ``CENSUS_RECORD_STEPS`` steps, and goes on (up to
        ``CENSUS_MAX_RECORD_STEPS``) until memory has grown by ``min_rate`` since it
        began, while the trend holds: a leak that strikes every eighth step is recorded
        when it strikes; a cache that has stopped filling ends it at once.
        """
        census = self._census
        assert census is not None
        if census.check is None:
            if census.recording and not (
                k >= census.last
                and (
                    raw - census.start_reading >= self.min_rate
                    or k >= census.first + CENSUS_MAX_RECORD_STEPS - 1
                    or not (self._pending is not None or self._growing())
                )
            ):
                return  # record one more step
            census.stop_recording()  # (recording may have stopped on its own: a failure)
            census.last = k
            census.check = k + CENSUS_SURVIVE_STEPS
        elif census.entered:
            census.stop_recording()  # a mode entered after ours was on top last time
        if k >= census.check:
            self._census_result = census.analyse(k)
            self._census = None

    def _growing(self) -> bool:
        """The window still shows persistent growth of ``min_rate`` (the cheap parts)."""
        win = self._win
        return win.ols_slope() >= self.min_rate and persistent(list(win.ys), self.min_rate)

    def _emit(self, k: int, trend: Trend) -> LeakReport:
        self.close()
        self._pending = None
        self._episode = True
        result = self._census_result
        self._census_result = None
        if not self.census:
            census_note = "off"
        elif result is None:
            census_note = "the census did not finish"
        else:
            census_note = result.note
        base_step, base = self._baseline or (k, self._win.ys[-1])
        report = LeakReport(
            step=k,
            device=str(self.device),
            signal=self.signal,
            rate_bytes_per_step=round(trend.slope, 1),
            window=trend.n,
            confidence=self.confidence,
            p_value=trend.p_value,
            z=round(trend.z, 3),
            current_bytes=self._last_raw,
            growth_bytes=self._win.ys[-1] - base,
            baseline_step=base_step,
            suspects=result.suspects if result else (),
            causes=result.causes if result else (),
            census=census_note,
        )
        self.reports.append(report)
        if self.log_reports:
            log.warning("%s", report.format())
        if self.on_leak is not None:
            self.on_leak(report)
        return report
