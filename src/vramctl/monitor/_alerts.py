"""Alert rules with levels and hold times, the built-in rules, and actions.

A rule looks at a device's newest sample (and its recent history) and returns
a :class:`Finding` or ``None``. The :class:`AlertEngine` turns findings into
:class:`Alert` s: a finding must hold for the rule's ``for_s`` seconds before it
fires, it fires once per level (an escalation fires again), and when it clears
a resolved alert follows. Alerts go to logging and to callbacks; actions are
callbacks too (:func:`cleanup`, :class:`Shrink`).

>>> from vramctl import MemoryState
>>> from vramctl.monitor import Sample, UsageRule
>>> rule = UsageRule(warning=0.8, critical=0.95)
>>> s = Sample("cuda:0", MemoryState("cuda:0", total=100, used=85, free=15))
>>> rule.evaluate(s, [s]).level.name
'WARNING'
"""

from __future__ import annotations

import enum
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from vramctl._errors import VramctlError
from vramctl._na import NA
from vramctl._units import format_bytes
from vramctl.monitor._history import Sample

__all__ = [
    "Alert",
    "AlertEngine",
    "AlertRuleError",
    "FragmentationRule",
    "Level",
    "OomRiskRule",
    "RetriesRule",
    "Rule",
    "Shrink",
    "UsageRule",
    "cleanup",
    "default_rules",
]

log = logging.getLogger("vramctl.monitor")


class AlertRuleError(VramctlError, ValueError):
    """An alert rule was given a setting it cannot use."""


class Level(enum.IntEnum):
    """Alert levels; their values are the ``logging`` levels they are logged at."""

    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    CRITICAL = logging.CRITICAL

    @classmethod
    def parse(cls, value: Level | str | int) -> Level:
        if isinstance(value, Level):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                names = ", ".join(m.name.lower() for m in cls)
                raise AlertRuleError(f"unknown alert level {value!r}: use one of {names}") from None
        return cls(value)


@dataclass(frozen=True)
class Finding:
    """What a rule sees in one sample: a level, a message, and what to do about it."""

    level: Level
    message: str
    value: float | None = None
    threshold: float | None = None
    suggestion: str = ""


@dataclass(frozen=True)
class Alert:
    """A finding that held long enough, or (``resolved=True``) the end of one."""

    rule: str
    level: Level
    device: str
    message: str
    value: float | None = None
    threshold: float | None = None
    suggestion: str = ""
    resolved: bool = False
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "level": self.level.name.lower(),
            "device": self.device,
            "message": self.message,
            "value": self.value,
            "threshold": self.threshold,
            "suggestion": self.suggestion,
            "resolved": self.resolved,
            "timestamp": self.timestamp,
        }

    def __str__(self) -> str:
        head = "resolved" if self.resolved else self.level.name.lower()
        tail = f" ({self.suggestion})" if self.suggestion and not self.resolved else ""
        return f"[{head}] {self.device} {self.rule}: {self.message}{tail}"


@runtime_checkable
class Rule(Protocol):
    """An alert rule: a name, a hold time, and ``evaluate(sample, recent) -> Finding | None``.

    ``recent`` is the device's samples of the last :attr:`AlertEngine.lookback`
    seconds (60, or the longest ``window_s`` of the rules; at most 200 samples),
    oldest first, ending with ``sample``.
    """

    name: str
    for_s: float

    def evaluate(self, sample: Sample, recent: Sequence[Sample]) -> Finding | None: ...


def _ratio(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise AlertRuleError(
            f"{name}={value!r}: a threshold is a fraction of capacity between 0 and 1 "
            "(for 80% write 0.8)"
        )
    return float(value)


def _hold(for_s: float) -> float:
    if for_s < 0:
        raise AlertRuleError(f"for_s={for_s!r}: a hold time is 0 seconds or more")
    return float(for_s)


class UsageRule:
    """Memory in use over capacity: ``warning`` and ``critical`` fractions, 0-1.

    ``kind`` is ``"gpu"`` (GPUs and simulated GPUs), ``"cpu"`` (host memory) or
    ``None`` (every device). The defaults are 80% and 95% for GPUs, 75% and 90%
    for host memory (see :func:`default_rules`).
    """

    def __init__(
        self,
        warning: float = 0.8,
        critical: float = 0.95,
        *,
        for_s: float = 0.0,
        kind: str | None = "gpu",
        name: str | None = None,
    ) -> None:
        self.warning = _ratio("warning", warning)
        self.critical = _ratio("critical", critical)
        if self.warning > self.critical:
            raise AlertRuleError(
                f"warning={warning} is above critical={critical}: the warning level comes first"
            )
        if kind not in ("gpu", "cpu", None):
            raise AlertRuleError(f"kind={kind!r}: use 'gpu', 'cpu' or None (every device)")
        self.kind = kind
        self.for_s = _hold(for_s)
        self.name = name or ("host_memory" if kind == "cpu" else "memory")

    def applies(self, device: str) -> bool:
        scope = "cpu" if device == "cpu" else "gpu"  # a device id: host memory or a GPU's
        return self.kind is None or self.kind == scope

    def evaluate(self, sample: Sample, recent: Sequence[Sample]) -> Finding | None:
        mem = sample.memory
        util = mem.utilization
        if not self.applies(sample.device) or util is NA:
            return None
        for level, limit in ((Level.CRITICAL, self.critical), (Level.WARNING, self.warning)):
            if util >= limit:
                return Finding(
                    level,
                    f"{util:.0%} of memory in use ({format_bytes(mem.used)} of "
                    f"{format_bytes(mem.total)}), over the {limit:.0%} {level.name.lower()} level",
                    value=util,
                    threshold=limit,
                )
        return None


class FragmentationRule:
    """Reserved memory lost to fragmentation: inactive split blocks over reserved bytes.

    Fires (warning) when more than ``threshold`` of the allocator's reserved
    memory sits in inactive split blocks, once at least ``min_reserved`` bytes
    are reserved, and suggests ``expandable_segments:True``.
    """

    SUGGESTION = (
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts, "
        "so that the allocator grows segments instead of splitting blocks"
    )

    def __init__(
        self, threshold: float = 0.30, *, min_reserved: int = 256 * 2**20, for_s: float = 10.0
    ) -> None:
        self.threshold = _ratio("threshold", threshold)
        self.min_reserved = min_reserved
        self.for_s = _hold(for_s)
        self.name = "fragmentation"

    def evaluate(self, sample: Sample, recent: Sequence[Sample]) -> Finding | None:
        mem = sample.memory
        frag = mem.fragmentation
        if frag is NA or mem.reserved is NA or mem.reserved < self.min_reserved:
            return None
        if frag <= self.threshold:
            return None
        return Finding(
            Level.WARNING,
            f"{frag:.0%} of reserved memory ({format_bytes(mem.inactive_split)} of "
            f"{format_bytes(mem.reserved)}) is in inactive split blocks",
            value=frag,
            threshold=self.threshold,
            suggestion=self.SUGGESTION,
        )


class RetriesRule:
    """The allocator had to free its cache and retry (``num_alloc_retries`` rose).

    Each retry is a synchronising ``cudaFree`` of cached blocks: the device is
    close to full. Fires at warning when the count rose within ``window_s``.
    """

    SUGGESTION = (
        "the allocator is flushing its cache to find room: lower the batch size, or set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )

    def __init__(self, *, window_s: float = 60.0, for_s: float = 0.0) -> None:
        if window_s <= 0:
            raise AlertRuleError(f"window_s={window_s!r}: give a positive number of seconds")
        self.window_s = float(window_s)
        self.for_s = _hold(for_s)
        self.name = "alloc_retries"

    def evaluate(self, sample: Sample, recent: Sequence[Sample]) -> Finding | None:
        now = sample.memory.alloc_retries
        if now is NA:
            return None
        since = sample.timestamp - self.window_s
        base = next(
            (
                s.memory.alloc_retries
                for s in recent
                if s.timestamp >= since and s.memory.alloc_retries is not NA
            ),
            now,
        )
        if now <= base:
            return None
        return Finding(
            Level.WARNING,
            f"{now - base} allocator retries in the last {self.window_s:g} s ({now} in all)",
            value=float(now - base),
            suggestion=self.SUGGESTION,
        )


class OomRiskRule:
    """The trend of memory in use, extrapolated, reaches capacity within ``horizon_s``.

    Fits a straight line to ``used`` over the last ``window_s`` seconds (at
    least ``min_samples`` samples) and fires at error level when the device
    would be full within ``horizon_s`` seconds, critical within a quarter of it.
    """

    def __init__(
        self,
        horizon_s: float = 60.0,
        *,
        window_s: float = 30.0,
        min_samples: int = 5,
        for_s: float = 0.0,
    ) -> None:
        if horizon_s <= 0 or window_s <= 0:
            raise AlertRuleError("horizon_s and window_s are positive numbers of seconds")
        if min_samples < 3:
            raise AlertRuleError(f"min_samples={min_samples}: a trend needs at least 3 samples")
        self.horizon_s = float(horizon_s)
        self.window_s = float(window_s)
        self.min_samples = min_samples
        self.for_s = _hold(for_s)
        self.name = "oom_risk"

    def time_to_full(self, recent: Sequence[Sample]) -> tuple[float, float] | None:
        """``(seconds until full, bytes per second)`` from the recent trend, or None."""
        if not recent:
            return None
        end = recent[-1].timestamp
        since = end - self.window_s
        window = [s for s in recent if s.memory.timestamp >= since]
        # A straight line needs few points: at 10 Hz, fit every k-th sample (at most 64).
        stride = max(1, len(window) // _FIT_POINTS)
        pts = [
            (s.timestamp - end, float(used))
            for s in window[::-1][::stride]
            if (used := s.memory.used) is not NA
        ]
        last = recent[-1].memory
        if len(pts) < self.min_samples or last.total is NA or last.used is NA:
            return None
        n = len(pts)
        mt = sum(t for t, _ in pts) / n
        mu = sum(u for _, u in pts) / n
        stt = sum((t - mt) ** 2 for t, _ in pts)
        if stt <= 0:
            return None
        slope = sum((t - mt) * (u - mu) for t, u in pts) / stt
        if slope <= 0:
            return None
        # Extrapolate from the fitted line's end, not one noisy reading.
        now_fit = mu + slope * (0.0 - mt)
        left = max(0.0, float(last.total) - max(now_fit, float(last.used)))
        return left / slope, slope

    def evaluate(self, sample: Sample, recent: Sequence[Sample]) -> Finding | None:
        est = self.time_to_full(recent)
        if est is None:
            return None
        seconds, rate = est
        if seconds > self.horizon_s:
            return None
        level = Level.CRITICAL if seconds <= self.horizon_s / 4 else Level.ERROR
        return Finding(
            level,
            f"memory in use grows {format_bytes(int(rate))}/s: at this rate the device is "
            f"full in {seconds:.0f} s",
            value=seconds,
            threshold=self.horizon_s,
            suggestion="find what grows (monitor.step() names leaking tensors) or shrink the batch",
        )


#: Points the OOM-risk line is fitted to, at most.
_FIT_POINTS = 64


def default_rules() -> list[Rule]:
    """GPU memory 80%/95%, host memory 75%/90%, fragmentation, retries and OOM risk."""
    return [
        UsageRule(0.80, 0.95, kind="gpu"),
        UsageRule(0.75, 0.90, kind="cpu"),
        FragmentationRule(),
        RetriesRule(),
        OomRiskRule(),
    ]


# -- actions ------------------------------------------------------------------------


def cleanup(alert: Alert | None = None) -> int:
    """Emergency cleanup: a full garbage collection, then the CUDA allocator's cache.

    Returns the reserved bytes handed back to the driver (0 on the CPU). Attach
    it with ``monitor.on_alert(cleanup, level="critical")``.
    """
    gc.collect()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    freed = before - torch.cuda.memory_reserved()
    log.info("emergency cleanup released %s of cached GPU memory", format_bytes(freed))
    return freed


class Shrinkable(Protocol):
    def shrink(self, factor: float = 0.5) -> Any: ...


class Shrink:
    """An alert action that asks a guard or batcher to use smaller batches.

    ``target`` is anything with ``shrink(factor)``: :class:`vramctl.Guard` runs
    smaller pieces, :class:`vramctl.AdaptiveBatcher` draws smaller batches.
    Resolved alerts do nothing.
    """

    def __init__(self, target: Shrinkable, factor: float = 0.5) -> None:
        if not 0.0 < factor < 1.0:
            raise AlertRuleError(f"factor={factor!r}: shrink by a fraction between 0 and 1")
        if not callable(getattr(target, "shrink", None)):
            raise AlertRuleError(
                f"{type(target).__name__} has no shrink(): pass a vramctl Guard or AdaptiveBatcher"
            )
        self.target = target
        self.factor = factor
        self.calls = 0

    def __call__(self, alert: Alert) -> None:
        if alert.resolved:
            return
        self.calls += 1
        self.target.shrink(self.factor)


# -- the engine ---------------------------------------------------------------------


@dataclass
class _State:
    active: Level | None = None
    pending: dict[Level, float] = field(default_factory=dict)


Callback = Callable[[Alert], object]


class AlertEngine:
    """Evaluates rules on each sample, applies hold times, and dispatches alerts."""

    def __init__(self, rules: Sequence[Rule] | None = None) -> None:
        self.rules: list[Rule] = list(default_rules() if rules is None else rules)
        for r in self.rules:
            if not isinstance(r, Rule):
                raise AlertRuleError(f"{r!r} is not an alert rule (name, for_s, evaluate())")
        #: Seconds of history the rules see: the longest ``window_s`` of any rule, at least 60.
        self.lookback = max([60.0] + [float(getattr(r, "window_s", 0.0)) for r in self.rules])
        self._states: dict[tuple[str, str], _State] = {}
        self._callbacks: list[tuple[Callback, Level, str | None]] = []

    def on_alert(
        self, callback: Callback, *, level: Level | str = Level.INFO, rule: str | None = None
    ) -> Callable[[], None]:
        """Call ``callback(alert)`` for alerts at ``level`` or above (of ``rule`` only, if given).

        Resolved alerts reach callbacks registered at any level. Returns a function
        that removes the callback.
        """
        entry = (callback, Level.parse(level), rule)
        self._callbacks.append(entry)

        def remove() -> None:
            if entry in self._callbacks:
                self._callbacks.remove(entry)

        return remove

    def active(self) -> dict[tuple[str, str], Level]:
        """``{(rule, device): level}`` of the alerts firing now."""
        # A snapshot of the states: the sampling thread may add one meanwhile.
        states = list(self._states.items())
        return {k: s.active for k, s in states if s.active is not None}

    def evaluate(
        self, sample: Sample, recent: Sequence[Sample], *, dispatch: bool = True
    ) -> list[Alert]:
        """The alerts ``sample`` fires; dispatched to the log and callbacks unless told not.

        With ``dispatch=False`` the caller passes each one to :meth:`dispatch` itself
        (the monitor does so once it has let go of its lock).
        """
        fired: list[Alert] = []
        now = sample.timestamp
        for rule in self.rules:
            try:
                finding = rule.evaluate(sample, recent)
            except Exception:  # a broken custom rule must not stop the sampler
                log.exception("alert rule %s failed on %s", rule.name, sample.device)
                continue
            state = self._states.setdefault((rule.name, sample.device), _State())
            alert = self._step(rule, state, sample.device, finding, now)
            if alert is not None:
                fired.append(alert)
        if dispatch:
            for alert in fired:
                self.dispatch(alert)
        return fired

    def _step(
        self, rule: Rule, state: _State, device: str, finding: Finding | None, now: float
    ) -> Alert | None:
        if finding is None:
            state.pending.clear()
            if state.active is None:
                return None
            state.active = None
            return Alert(
                rule.name, Level.INFO, device, "back to normal", resolved=True, timestamp=now
            )
        level = finding.level
        for lv in list(state.pending):
            if lv > level:
                del state.pending[lv]
        # A level counts as held while the finding is at that level or above.
        for lv in Level:
            if lv <= level:
                state.pending.setdefault(lv, now)
        if state.active == level:
            return None
        held: Level | None
        if state.active is not None and state.active > level:
            # Stepping down (critical -> warning) reports the lower level at once.
            held = level
        else:
            # The highest level that has held for ``for_s``: a finding that went from
            # warning to critical before the hold ended fires its warning when the
            # warning has held, and the critical once the critical has.
            held = max(
                (lv for lv, since in state.pending.items() if now - since >= rule.for_s),
                default=None,
            )
            if held is None or (state.active is not None and held <= state.active):
                return None
        state.active = held
        message, threshold = finding.message, finding.threshold
        if held != level:
            message += f" ({level.name.lower()} for less than {rule.for_s:g} s so far)"
            threshold = None
        return Alert(
            rule.name,
            held,
            device,
            message,
            finding.value,
            threshold,
            finding.suggestion,
            timestamp=now,
        )

    def dispatch(self, alert: Alert) -> None:
        log.log(
            Level.INFO if alert.resolved else alert.level,
            "%s",
            alert,
            extra={"vramctl_alert": alert.to_dict()},
        )
        for callback, level, rule in list(self._callbacks):
            if rule is not None and rule != alert.rule:
                continue
            if not alert.resolved and alert.level < level:
                continue
            try:
                callback(alert)
            except Exception:
                log.exception("alert callback %r failed", callback)
