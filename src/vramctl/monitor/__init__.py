"""The monitor layer: sampler, history, alerts, leaks, fragmentation, profiling, exporters.

>>> from vramctl.monitor import Monitor
>>> with Monitor(["cpu"], interval=0.05, rules=[]) as mon:
...     _ = mon.sample()
>>> mon.summary()["devices"]["cpu"]["peak"]["used"] > 0
True
"""

from __future__ import annotations

from vramctl.monitor._alerts import (
    Alert,
    AlertEngine,
    AlertRuleError,
    Finding,
    FragmentationRule,
    Level,
    OomRiskRule,
    RetriesRule,
    Rule,
    Shrink,
    UsageRule,
    cleanup,
    default_rules,
)
from vramctl.monitor._history import ExportError, History, Peak, Sample, load_jsonl
from vramctl.monitor._http import AddressError
from vramctl.monitor._leak import (
    LeakDetector,
    LeakDetectorError,
    LeakHook,
    LeakReport,
    LeakSuspect,
)
from vramctl.monitor._monitor import Event, Monitor, MonitorError
from vramctl.monitor._plot import plot
from vramctl.monitor._profile import OpStats, Profiler, profile, profiler
from vramctl.monitor._prometheus import MetricsServer, serve_prometheus

__all__ = [
    "AddressError",
    "Alert",
    "AlertEngine",
    "AlertRuleError",
    "Event",
    "ExportError",
    "Finding",
    "FragmentationRule",
    "History",
    "LeakDetector",
    "LeakDetectorError",
    "LeakHook",
    "LeakReport",
    "LeakSuspect",
    "Level",
    "MetricsServer",
    "Monitor",
    "MonitorError",
    "OomRiskRule",
    "OpStats",
    "Peak",
    "Profiler",
    "RetriesRule",
    "Rule",
    "Sample",
    "Shrink",
    "UsageRule",
    "cleanup",
    "default_rules",
    "load_jsonl",
    "plot",
    "profile",
    "profiler",
    "serve_prometheus",
]
