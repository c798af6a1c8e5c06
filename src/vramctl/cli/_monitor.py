"""``vramctl monitor``: sample every device, print alerts, serve Prometheus metrics, export."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from vramctl import NA, format_bytes
from vramctl.cli._common import (
    app,
    check_can_write,
    check_seconds,
    console,
    err,
    library_log_to,
    user_errors,
)

if TYPE_CHECKING:  # the monitor (and PyTorch) is imported by the command, not by --help
    from vramctl.monitor import Event, Monitor, Rule

__all__ = ["monitor_cmd"]

# By the names of vramctl.monitor.Level.
_LEVEL_STYLE = {
    "INFO": "cyan",
    "WARNING": "yellow",
    "ERROR": "red",
    "CRITICAL": "bold red",
}


def _open_jsonl(path: Path) -> IO[str]:
    from vramctl.monitor import ExportError

    try:
        return path.open("a", encoding="utf-8")
    except OSError as exc:
        raise ExportError(
            f"cannot write the history to {str(path)!r}: {exc.strerror or exc}; "
            "choose a path in a writable directory"
        ) from None


def _check_plot(path: Path) -> None:
    """Refuse a plot path that cannot be written now, not after the whole run."""
    from vramctl.monitor import ExportError

    if path.suffix.lower() not in (".html", ".htm", ".png"):
        raise ExportError(f"--plot {str(path)!r}: use a .html or .png file name")
    check_can_write("--plot", path)


def _check_levels(kind: str, warning: float, critical: float) -> None:
    from vramctl.monitor import MonitorError

    for level, value in (("warning", warning), ("critical", critical)):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise MonitorError(
                f"--{kind}-{level} {value:g}: a memory level is a fraction of capacity between "
                "0 and 1 (for 80% write 0.8)"
            )
    if warning > critical:
        raise MonitorError(
            f"--{kind}-warning {warning:g} is above --{kind}-critical {critical:g}: "
            "the warning level comes first"
        )


def _line(samples: list[dict[str, Any]]) -> str:
    parts = []
    for s in samples:
        m = s["memory"]
        if m["used"] is None or m["total"] is None:
            parts.append(f"{s['device']} N/A")
            continue
        text = f"{s['device']} {format_bytes(m['used'])}/{format_bytes(m['total'])}"
        text += f" ({m['utilization']:.0%})"
        if m["allocated"] is not None and s["device"] != "cpu":
            text += f" alloc {format_bytes(m['allocated'])}"
        parts.append(text)
    return time.strftime("%H:%M:%S") + "  " + " · ".join(parts)


def _print_alert(alert: dict[str, Any]) -> None:
    head = "resolved" if alert["resolved"] else alert["level"]
    style = "green" if alert["resolved"] else _LEVEL_STYLE[alert["level"].upper()]
    text = f"[{style}]{head:>8}[/] {alert['device']} {alert['rule']}: {alert['message']}"
    if alert["suggestion"] and not alert["resolved"]:
        text += f"\n         [dim]→ {alert['suggestion']}[/]"
    err.print(text, highlight=False, soft_wrap=True)


def _peaks_table(mon: Monitor) -> Table:
    table = Table(title="peaks while monitoring", title_justify="left")
    for col in ("device", "peak used", "at", "peak %", "peak allocated", "peak reserved"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for dev in mon.devices:
        p = mon.history.peak(dev.id)
        when = "N/A" if p.used_at is NA else time.strftime("%H:%M:%S", time.localtime(p.used_at))
        pct = "N/A" if p.utilization is NA else f"{p.utilization:.0%}"
        table.add_row(
            dev.id,
            format_bytes(p.used),
            when,
            pct,
            format_bytes(p.allocated),
            format_bytes(p.reserved),
        )
    return table


def _rules(
    gpu_warning: float,
    gpu_critical: float,
    host_warning: float,
    host_critical: float,
    hold: float,
    horizon: float,
) -> list[Rule]:
    from vramctl.monitor import FragmentationRule, OomRiskRule, RetriesRule, UsageRule

    return [
        UsageRule(gpu_warning, gpu_critical, kind="gpu", for_s=hold),
        UsageRule(host_warning, host_critical, kind="cpu", for_s=hold),
        FragmentationRule(),
        RetriesRule(),
        OomRiskRule(horizon),
    ]


@app.command("monitor")
@user_errors
def monitor_cmd(
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device",
            "-d",
            help="Monitor this device (repeatable): 0, cuda:1, cpu, a UUID, sim:NAME. "
            "Default: every device.",
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", "-i", help="Seconds between samples.")
    ] = 1.0,
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds (default: until Ctrl-C).")
    ] = None,
    count: Annotated[
        int | None, typer.Option("--count", "-n", min=1, help="Stop after this many samples.")
    ] = None,
    prometheus: Annotated[
        str | None,
        typer.Option(
            metavar="[HOST]:PORT",
            help="Serve Prometheus metrics at http://HOST:PORT/metrics (HOST defaults to "
            "127.0.0.1; any other address needs --token).",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="VRAMCTL_TOKEN",
            help="Bearer token the metrics endpoint requires (needed off 127.0.0.1).",
        ),
    ] = None,
    jsonl: Annotated[
        Path | None,
        typer.Option(help="Append every sample to this JSON Lines file as it is taken."),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="On exit, plot the history to this .html or .png file.")
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print one JSON line per sample and per alert on stdout."),
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print alerts only, not a line per sample.")
    ] = False,
    gpu_warning: Annotated[float, typer.Option(help="GPU memory warning level, 0-1.")] = 0.80,
    gpu_critical: Annotated[float, typer.Option(help="GPU memory critical level, 0-1.")] = 0.95,
    host_warning: Annotated[float, typer.Option(help="Host memory warning level, 0-1.")] = 0.75,
    host_critical: Annotated[float, typer.Option(help="Host memory critical level, 0-1.")] = 0.90,
    hold: Annotated[
        float, typer.Option(help="Seconds a memory level must hold before it alerts.")
    ] = 0.0,
    horizon: Annotated[
        float,
        typer.Option(help="OOM risk: alert when the trend fills the device within this many s."),
    ] = 60.0,
) -> None:
    """Sample every device's memory, print alerts as they fire, serve Prometheus metrics.

    Each sample holds the device's memory as NVML sees it, this process's
    PyTorch allocator figures, and the largest processes; the CPU is sampled
    like a GPU (host memory, process RSS). Alerts: memory over the warning or
    critical level, fragmentation, allocator retries, and the OOM risk (the
    trend reaches capacity within --horizon seconds).

    Examples:

      vramctl monitor                       # every device, each second, to Ctrl-C
      vramctl monitor --prometheus :9400 -q # Prometheus metrics; alerts on stderr
      vramctl monitor -d cpu -i 0.5 --duration 60 --plot mem.html
    """
    check_seconds("--interval", interval, "0.5")
    if duration is not None:
        check_seconds("--duration", duration, "60")
    _check_levels("gpu", gpu_warning, gpu_critical)
    _check_levels("host", host_warning, host_critical)
    check_seconds("--hold", hold, "5", zero=True)
    check_seconds("--horizon", horizon, "60")
    from vramctl.monitor import Monitor, serve_prometheus
    from vramctl.monitor._shared import parse_address

    rules = _rules(gpu_warning, gpu_critical, host_warning, host_critical, hold, horizon)
    mon = Monitor(device or None, interval, rules=rules)
    if plot is not None:
        _check_plot(plot)
    sink = _open_jsonl(jsonl) if jsonl is not None else None
    server = None
    if prometheus is not None:
        host, port = parse_address(prometheus)
        server = serve_prometheus(mon, host, port, token=token)
        err.print(f"Prometheus metrics at {server.url}", highlight=False)

    taken = threading.Semaphore(0)
    out_lock = threading.Lock()
    closed = threading.Event()  # stdout went away (a pipe into `head`): stop

    def on_event(event: Event) -> None:
        try:
            write(event)
        except BrokenPipeError:
            closed.set()
            taken.release()

    def write(event: Event) -> None:
        with out_lock:
            if event.kind == "sample":
                rows = event.data["samples"]
                if sink is not None:
                    sink.writelines(json.dumps(r) + "\n" for r in rows)
                    sink.flush()
                if as_json:
                    sys.stdout.write(json.dumps({"kind": "sample", "samples": rows}) + "\n")
                elif not quiet:
                    console.print(_line(rows), highlight=False)
                taken.release()
            elif event.kind == "alert":
                if as_json:
                    sys.stdout.write(json.dumps({"kind": "alert", **event.data}) + "\n")
                else:
                    _print_alert(event.data)
            if as_json:
                sys.stdout.flush()

    mon.subscribe(on_event)
    # Alerts are shown through the subscriber; keep the library's log lines off the terminal.
    started = time.monotonic()
    seen = 0
    library_logs = contextlib.ExitStack()
    try:
        library_logs.enter_context(library_log_to(logging.NullHandler(), "vramctl.monitor"))
        mon.start()
        while True:
            if taken.acquire(timeout=0.2):
                seen += 1
            if closed.is_set() or (count is not None and seen >= count):
                break
            if duration is not None and time.monotonic() - started >= duration:
                break
    except KeyboardInterrupt:
        pass
    finally:
        mon.stop()
        if server is not None:
            server.close()
        if sink is not None:
            sink.close()
        library_logs.close()
    if plot is not None:
        mon.export(plot)
        err.print(f"plot written to {plot}", highlight=False)
    if closed.is_set():
        # Point stdout at nothing so that the interpreter's final flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    if not as_json:
        console.print(_peaks_table(mon))
