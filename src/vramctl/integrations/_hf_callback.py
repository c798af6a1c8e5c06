"""The Hugging Face ``Trainer``'s memory monitor: :class:`VramctlCallback`
(:mod:`vramctl.integrations.transformers`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vramctl._optional import require

require(
    ("transformers", "accelerate"), extra="transformers", what="vramctl.integrations.transformers"
)

from transformers import DefaultFlowCallback, TrainerCallback  # noqa: E402

from vramctl.device import Device  # noqa: E402
from vramctl.guard import Guard  # noqa: E402
from vramctl.integrations._hf_common import (  # noqa: E402
    TrainerIntegrationError,
    log,
    training_device,
)
from vramctl.monitor import Alert, LeakReport, Level, Monitor, Rule  # noqa: E402

__all__ = ["PREFIX", "VramctlCallback"]

GiB = 2**30

#: The reading names this module adds to the Trainer's logs.
PREFIX = "vramctl/"


def _gib(value: Any) -> float | None:
    return round(value / GiB, 6) if isinstance(value, int) and value >= 0 else None


class VramctlCallback(TrainerCallback):
    """A ``TrainerCallback`` that monitors the training device's memory.

    - ``on_train_begin`` starts a :class:`vramctl.Monitor` on ``device`` (default: the
      active simulated GPU, else the Trainer's ``args.device``) sampling every
      ``interval`` seconds with ``rules`` (default: the monitor's default rules);
      ``on_train_end`` stops it (:attr:`monitor` stays readable afterwards).
    - ``on_step_end`` (once per optimizer step) calls ``monitor.step()``: a leak is
      logged as a warning with its report, kept in :attr:`leaks`, and with
      ``stop_on_leak=True`` stops training (``control.should_training_stop``).
    - Alerts at ``alert_level`` or above are kept in :attr:`alerts`; the monitor logs
      every alert once, on the ``vramctl.monitor`` logger at its level (warning, error,
      critical).
    - ``on_log`` adds the readings of :meth:`readings` to the logs: ``vramctl/used_gib``
      (the device's memory in use now), ``vramctl/peak_gib`` (its highest: the highest
      sample since training began, or what is held outside this process's allocator now
      plus the allocator's peak, which sees the spikes between samples), and for a
      guarded trainer ``vramctl/ooms`` (OOMs survived) and ``vramctl/split_steps`` (steps
      run in pieces). They are written into the entry of ``trainer.state.log_history``
      for that log as well. The Trainer calls callbacks in
      order, and adds the reporting integrations' before yours: call :meth:`attach` (a
      :class:`GuardedTrainer` does it for the instances in its ``callbacks``) to run this
      one before them, so that they report the readings too.
    """

    def __init__(
        self,
        device: Device | str | int | None = None,
        interval: float = 1.0,
        rules: Sequence[Rule] | None = None,
        *,
        stop_on_leak: bool = False,
        alert_level: Level | str = Level.WARNING,
        guard: Guard | None = None,
    ) -> None:
        if not isinstance(interval, int | float) or isinstance(interval, bool) or interval <= 0:
            raise TrainerIntegrationError(
                f"interval={interval!r}: the sampling interval is a positive number of seconds"
            )
        if guard is not None and not isinstance(guard, Guard):
            raise TrainerIntegrationError(f"guard must be a vramctl.Guard, got {guard!r}")
        self.device_spec = device
        self.interval = float(interval)
        self.rules = None if rules is None else list(rules)
        self.stop_on_leak = bool(stop_on_leak)
        self.alert_level = Level.parse(alert_level)
        #: The guard whose counts are logged (set by :meth:`attach` or a GuardedTrainer).
        self.guard = guard
        #: The monitor of the latest training run (None before the first).
        self.monitor: Monitor | None = None
        self.device: Device | None = None
        #: Leaks reported, and alerts at ``alert_level`` or above, in this callback's runs.
        self.leaks: list[LeakReport] = []
        self.alerts: list[Alert] = []

    def attach(self, trainer: Any) -> VramctlCallback:
        """Add this callback to ``trainer`` right after its ``DefaultFlowCallback``.

        There it runs before the reporting integrations, which then log its readings;
        ``trainer.add_callback`` would put it after them. Takes the trainer's ``guard``
        (a :class:`GuardedTrainer`'s) when it has one. Returns the callback.
        """
        handler = getattr(trainer, "callback_handler", None)
        callbacks = getattr(handler, "callbacks", None)
        if not isinstance(callbacks, list):
            raise TrainerIntegrationError(
                f"attach needs a transformers Trainer, got {type(trainer).__name__}"
            )
        if any(cb is self for cb in callbacks):
            callbacks.remove(self)
        at = next(
            (i + 1 for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)), 0
        )
        callbacks.insert(at, self)
        found = getattr(trainer, "guard", None)
        if self.guard is None and isinstance(found, Guard):
            self.guard = found
        return self

    # -- events ---------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.close()
        self.device = dev = training_device(args, self.device_spec)
        self.monitor = mon = Monitor([dev], self.interval, rules=self.rules)
        mon.on_alert(self._on_alert, level=self.alert_level)
        mon.start()
        mon.sample()  # the peak starts from what training begins with
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        mon, dev = self.monitor, self.device
        if mon is None or dev is None:
            return control
        # The detector's own tensors (its first reading's probe) are host memory, not the
        # training device's: on a simulated GPU they would take its budget.
        with dev.uncounted():
            report = mon.step()
        if report is not None:
            self.leaks.append(report)
            log.warning("vramctl: %s", report.format())
            if self.stop_on_leak:
                log.warning(
                    "vramctl: training stops at step %d (stop_on_leak=True)", state.global_step
                )
                control.should_training_stop = True
        return control

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        if logs is None or self.monitor is None:
            return control
        readings = self.readings(sample=True)
        history = getattr(state, "log_history", None)
        if history:
            # The Trainer appends a copy of ``logs`` (with "step") just before on_log.
            entry = history[-1]
            if (
                isinstance(entry, dict)
                and entry.get("step") == state.global_step
                and all(k in entry for k in logs)
            ):
                entry.update(readings)
        logs.update(readings)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.monitor is not None:
            self.monitor.stop()
        return control

    # -- readings -------------------------------------------------------------------

    def readings(self, sample: bool = False) -> dict[str, float | int]:
        """The numbers added to the logs (``sample=True`` reads the device first)."""
        mon, dev = self.monitor, self.device
        out: dict[str, float | int] = {}
        if mon is not None and dev is not None:
            if sample:
                mon.sample()
            latest = mon.history.latest(dev.id)
            now = latest.memory if latest is not None else None
            used = _gib(now.used) if now is not None else None
            if used is not None:
                out[PREFIX + "used_gib"] = used
            peak = mon.history.peak(dev.id)
            highs = [peak.used]
            if (
                now is not None
                and isinstance(now.used, int)
                and isinstance(now.reserved, int)
                and isinstance(peak.reserved, int)
            ):
                # What is held outside this process's allocator now, plus the allocator's
                # own peak, which sees the spikes between samples.
                highs.append(now.used - now.reserved + peak.reserved)
            found = [v for v in map(_gib, highs) if v is not None]
            if found:
                out[PREFIX + "peak_gib"] = max(found)
        if self.guard is not None:
            out[PREFIX + "ooms"] = self.guard.ooms
            out[PREFIX + "split_steps"] = self.guard.split_steps
        return out

    def close(self) -> None:
        """Stop the monitor (training that ends with an error does not call on_train_end)."""
        if self.monitor is not None:
            self.monitor.stop()

    def _on_alert(self, alert: Alert) -> None:
        # The monitor has logged it already (logger "vramctl.monitor", at its level); a
        # leak's whole report is logged by on_step_end.
        if alert.rule != "leak":
            self.alerts.append(alert)
