"""``vramctl top``: a live terminal view of devices, processes and vramctl's activity.

The frame is built by :func:`top_view`, a pure function of a
:class:`~vramctl.monitor.Monitor`; the command runs the monitor, redraws the
frame with ``rich.live.Live`` after every sample and reads single keys from the
terminal in cbreak mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from vramctl import NA, Device, MemoryState, NotAvailable, ProcessMemory, VramctlError, format_bytes
from vramctl.cli._common import app, check_seconds, console, library_log_to, user_errors
from vramctl.cli._render import EncodingSafe, _bar, _pct

if TYPE_CHECKING:  # the monitor (and PyTorch) is imported by the command, not by --help
    from vramctl.monitor import Event, Monitor

__all__ = [
    "KEYS_HELP",
    "SORT_KEYS",
    "SPARK_BLOCKS",
    "ProcessRow",
    "TopState",
    "sort_processes",
    "sparkline",
    "top_view",
]

#: The process table's sort keys, in the order ``s`` cycles through them.
SORT_KEYS = ("memory", "pid", "name", "device")
#: Keys that sort biggest first (the others sort smallest first); ``r`` reverses either.
_DESCENDING = {"memory": True, "pid": False, "name": False, "device": False}
SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
KEYS_HELP = "q quit · s sort · r reverse · p pause"
#: The narrowest range of memory utilization a sparkline stretches over its eight levels,
#: so that noise of a few MiB is not drawn as a wave.
MIN_SPARK_SPAN = 0.01
#: Samples of history the sparkline shows at most.
SPARK_SAMPLES = 60
#: Lines of the activity panel.
ACTIVITY_LINES = 6

_LEVEL_STYLE = {
    "info": "blue",
    "warning": "yellow",
    "error": "red",
    "critical": "bold white on red",
}


# -- pieces ------------------------------------------------------------------------------------


def sparkline(values: Sequence[float | NotAvailable], width: int = SPARK_SAMPLES) -> str:
    """The last ``width`` values as block characters; a missing value is a space.

    The scale runs from the lowest to the highest value shown, widened to at
    least :data:`MIN_SPARK_SPAN` (and kept within 0-1), so that a flat line
    stays flat and a real change fills the eight levels.

    >>> sparkline([0.0, 0.5, 1.0, 0.25])
    '▁▅█▃'
    """
    shown = list(values)[-width:] if width > 0 else []
    present = [float(v) for v in shown if v is not NA]
    if not present:
        return " " * len(shown)
    lo, hi = min(present), max(present)
    if hi - lo < MIN_SPARK_SPAN:
        mid = (hi + lo) / 2
        lo = min(max(0.0, mid - MIN_SPARK_SPAN / 2), 1.0 - MIN_SPARK_SPAN)
        hi = lo + MIN_SPARK_SPAN
    top = len(SPARK_BLOCKS) - 1
    out = []
    for v in shown:
        if v is NA:
            out.append(" ")
            continue
        level = round((float(v) - lo) / (hi - lo) * top)
        out.append(SPARK_BLOCKS[max(0, min(top, level))])
    return "".join(out)


@dataclass(frozen=True)
class ProcessRow:
    """One process on one device, with the device's reading it came with."""

    order: int
    device: Device
    memory: MemoryState
    process: ProcessMemory


def _name(p: ProcessMemory) -> str:
    if p.name is not NA and p.name:
        return p.name
    if p.command is not NA and p.command:
        return os.path.basename(p.command.split()[0])
    return ""


def _used(p: ProcessMemory) -> int:
    return -1 if p.used is NA else p.used


_SORTERS: dict[str, Callable[[ProcessRow], Any]] = {
    "memory": lambda r: (_used(r.process), -r.process.pid),
    "pid": lambda r: (r.process.pid, r.order),
    "name": lambda r: (_name(r.process).lower(), r.process.pid, r.order),
    "device": lambda r: (r.order, -_used(r.process), r.process.pid),
}


def _check_sort(sort: str) -> str:
    key = sort.strip().lower()
    if key not in SORT_KEYS:
        raise VramctlError(f"--sort {sort!r}: sort the processes by one of {', '.join(SORT_KEYS)}")
    return key


def sort_processes(
    monitor: Monitor, sort: str = "memory", reverse: bool = False
) -> list[ProcessRow]:
    """Every device's newest process list, sorted by ``sort``.

    ``memory`` puts the biggest first; ``pid``, ``name`` and ``device`` (in the
    monitor's device order) the smallest first; ``reverse`` turns either round.
    """
    key = _check_sort(sort)
    rows = []
    for order, dev in enumerate(monitor.devices):
        latest = monitor.history.latest(dev.id)
        if latest is None:
            continue
        rows += [ProcessRow(order, dev, latest.memory, p) for p in latest.processes]
    return sorted(rows, key=_SORTERS[key], reverse=_DESCENDING[key] != reverse)


def _events(monitor: Monitor) -> list[Event]:
    for _ in range(3):  # the sampler may append while we copy
        try:
            return [e for e in list(monitor.events) if e.kind != "sample"]
        except RuntimeError:
            continue
    return []


# -- the frame ---------------------------------------------------------------------------------


def _header(
    monitor: Monitor, sort: str, reverse: bool, paused: bool, keys: str | None
) -> RenderableType:
    line = Text.assemble(
        ("vramctl top", "bold"),
        f" · {socket.gethostname()} · {time.strftime('%H:%M:%S')} · every {monitor.interval:g} s",
        " · sort: ",
        (sort, "bold cyan"),
        " (reversed)" if reverse else "",
        f" · {monitor.overhead * 1000:.1f} ms/sample",
    )
    if paused:
        line.append("  PAUSED ", style="bold black on yellow")
    if keys:
        return Group(line, Text(keys, style="dim"))
    return line


def _device_cell(dev: Device) -> Text:
    return Text.assemble((dev.id, "bold"), "\n", (dev.name, "dim"))


def _span(values: list[float]) -> str:
    lo, hi = _pct(min(values)), _pct(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _details(monitor: Monitor, dev: Device, width: int) -> RenderableType:
    samples = monitor.history.samples(dev.id)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    if not samples:
        grid.add_row("memory", Text("no sample yet", style="dim"))
        return grid
    mem = samples[-1].memory
    peak = monitor.history.peak(dev.id)
    peak_util = NA if peak.used is NA or mem.total is NA else peak.used / mem.total
    grid.add_row(
        "memory",
        Text.assemble(
            _bar(mem.utilization, 30 if width >= 100 else 16),
            f" {format_bytes(mem.used)} / {format_bytes(mem.total)} ({_pct(mem.utilization)})",
        ),
    )
    spark_width = max(8, min(SPARK_SAMPLES, width - 70))
    shown = [s.memory.utilization for s in samples[-spark_width:]]
    present = [float(u) for u in shown if u is not NA]
    grid.add_row(
        "history",
        Text.assemble(
            (sparkline(shown, spark_width), "cyan"),
            f" {_span(present) if present else 'N/A'}",
            (f" ({len(shown)} samples)", "dim"),
            f" · peak {format_bytes(peak.used)} ({_pct(peak_util)})",
        ),
    )
    wide = width >= 110
    grid.add_row(
        "process",
        f"{format_bytes(mem.process_used)} · PyTorch "
        f"{'allocated' if wide else 'alloc'} {format_bytes(mem.allocated)}"
        f" · reserved {format_bytes(mem.reserved)}"
        f" · {'fragmentation' if wide else 'frag'} {_pct(mem.fragmentation)}",
    )
    if dev.is_gpu:
        util = "N/A" if mem.compute_utilization is NA else f"{mem.compute_utilization:.0f}%"
        temp = "N/A" if mem.temperature_c is NA else f"{mem.temperature_c:.0f} °C"
        power = "N/A" if mem.power_w is NA else f"{mem.power_w:.0f} W"
        grid.add_row("GPU", f"utilization {util} · temperature {temp} · power {power}")
    return grid


def _devices(monitor: Monitor, width: int) -> Table:
    table = Table(
        box=box.ROUNDED,
        show_header=False,
        show_lines=True,
        expand=True,
        title="devices",
        title_justify="left",
        title_style="bold",
    )
    table.add_column("device", overflow="fold", max_width=20 if width >= 100 else 14)
    table.add_column("memory", ratio=1)
    for dev in monitor.devices:
        table.add_row(_device_cell(dev), _details(monitor, dev, width))
    return table


def _processes(monitor: Monitor, sort: str, reverse: bool) -> Table:
    arrow = "↑" if _DESCENDING[sort] == reverse else "↓"
    table = Table(
        box=box.SIMPLE_HEAD,
        expand=True,
        title=f"processes (sort: {sort} {arrow})",
        title_justify="left",
        title_style="bold",
        header_style="bold dim",
    )
    table.add_column("device", no_wrap=True)
    table.add_column("PID", justify="right", no_wrap=True)
    table.add_column("user", no_wrap=True, max_width=12, overflow="ellipsis")
    table.add_column("name", no_wrap=True, max_width=20, overflow="ellipsis")
    table.add_column("memory", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    table.add_column("command", no_wrap=True, overflow="ellipsis", ratio=1)
    me = os.getpid()
    rows = sort_processes(monitor, sort, reverse)
    for r in rows:
        p = r.process
        share = NA if p.used is NA or r.memory.total is NA else p.used / r.memory.total
        table.add_row(
            r.device.id,
            str(p.pid),
            str(p.user),
            _name(p) or ("this process" if p.pid == me else "N/A"),
            format_bytes(p.used),
            _pct(share),
            str(p.command),
            style="bold" if p.pid == me else None,
        )
    if not rows:
        table.add_row("", "", "", Text("no processes listed", style="dim"), "", "", "")
    return table


def _event_line(event: Event) -> Text:
    d = event.data
    stamp = time.strftime("%H:%M:%S", time.localtime(event.timestamp))
    line = Text(f"{stamp} ", style="dim")
    if event.kind == "alert":
        if d.get("resolved"):
            line.append(" resolved ", style="green")
        else:
            level = str(d.get("level", "info"))
            line.append(f" {level.upper()} ", style=_LEVEL_STYLE.get(level, ""))
        line.append(f" {d.get('device', '')} {d.get('rule', '')}: ", style="bold")
        line.append(str(d.get("message", "")))
        if d.get("suggestion") and not d.get("resolved"):
            line.append(f"\n         → {d['suggestion']}", style="dim")
        return line
    if event.kind == "guard":
        what = d.get("event") or d.get("guard") or d.get("kind") or "event"
        line.append(f" guard {what} ", style="magenta")
        line.append(
            f" step {d.get('step', '?')}: batch {d.get('batch_size', '?')} "
            f"in {d.get('pieces', '?')} pieces"
        )
        if d.get("detail"):
            line.append(f" · {d['detail']}")
        return line
    if event.kind == "leak":
        line.append(" leak ", style="bold red")
        line.append(f" {d.get('device', '')}")
        rate = d.get("rate_bytes_per_step")
        if isinstance(rate, (int, float)):
            line.append(f" grows {format_bytes(int(rate))} per step")
        causes = d.get("causes")
        if isinstance(causes, list) and causes:
            line.append(f" · {causes[0]}")
        return line
    if event.kind == "log":
        level = str(d.get("level", "warning"))
        line.append(f" {level.upper()} ", style=_LEVEL_STYLE.get(level, ""))
        line.append(f" {d.get('message', '')}")
        return line
    line.append(f" {event.kind} ", style="cyan")
    line.append(
        " " + " ".join(f"{k}={v}" for k, v in d.items() if isinstance(v, (str, int, float)))
    )
    return line


def _activity(monitor: Monitor) -> Panel:
    events = _events(monitor)[-ACTIVITY_LINES:]
    active = len(monitor.alerts.active())
    if events:
        body: RenderableType = Group(*(_event_line(e) for e in reversed(events)))
    else:
        rules = ", ".join(r.name for r in monitor.alerts.rules) or "none"
        body = Text(f"no alerts or events yet (rules: {rules})", style="dim")
    subtitle = f"{active} alert{'s' if active != 1 else ''} active"
    return Panel(
        body,
        title="vramctl activity",
        title_align="left",
        subtitle=subtitle,
        subtitle_align="right",
        border_style="red" if active else "dim",
    )


def top_view(
    monitor: Monitor,
    sort: str = "memory",
    reverse: bool = False,
    width: int | None = None,
    *,
    paused: bool = False,
    keys: str | None = KEYS_HELP,
) -> RenderableType:
    """One frame of ``vramctl top`` from what ``monitor`` has sampled.

    ``width`` (default 120 columns) sizes the bars and sparklines; ``keys`` is
    the help line under the header (None for none).
    """
    key = _check_sort(sort)
    cols = 120 if width is None else max(40, width)
    parts = [
        _header(monitor, key, reverse, paused, keys),
        _devices(monitor, cols),
        _activity(monitor),
    ]
    if monitor.processes:
        parts.append(_processes(monitor, key, reverse))
    return EncodingSafe(Group(*parts))


# -- keys --------------------------------------------------------------------------------------


@dataclass
class TopState:
    """What the keys change: the sort key, its direction, and whether sampling is paused."""

    sort: str = "memory"
    reverse: bool = False
    paused: bool = False

    def press(self, key: str) -> bool:
        """Apply one key; False means quit."""
        k = key.lower()
        if k == "q" or key in ("\x03", "\x04"):  # q, Ctrl-C, Ctrl-D
            return False
        if k == "s":
            self.sort = SORT_KEYS[(SORT_KEYS.index(self.sort) + 1) % len(SORT_KEYS)]
        elif k == "r":
            self.reverse = not self.reverse
        elif k == "p":
            self.paused = not self.paused
        return True


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[None]:
    """Single keys without Enter or echo; the terminal's settings come back on any exit."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _keys_possible(no_keys: bool) -> bool:
    if no_keys:
        return False
    try:
        import termios  # noqa: F401
        import tty  # noqa: F401
    except ImportError:  # not a POSIX terminal
        return False
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):  # closed or replaced stdin
        return False


def _wake_pipe(monitor: Monitor) -> tuple[int, Callable[[], None]]:
    """A pipe that gets a byte whenever the monitor samples or records an event."""
    r, w = os.pipe()
    os.set_blocking(w, False)

    def poke(event: Event) -> None:
        with contextlib.suppress(OSError):  # full (we are behind) or closed
            os.write(w, b".")

    remove = monitor.subscribe(poke)

    def close() -> None:
        remove()
        os.close(r)
        os.close(w)

    return r, close


class _LogToEvents(logging.Handler):
    """vramctl's log records become activity events instead of lines across the screen."""

    def __init__(self, monitor: Monitor) -> None:
        super().__init__(logging.WARNING)
        self.monitor = monitor

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "vramctl_alert"):
            return  # already an alert event
        try:
            message = record.getMessage()
        except Exception:  # a malformed record must not stop the view
            message = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            message += f": {record.exc_info[1]!r}"
        self.monitor.record("log", level=record.levelname.lower(), message=message)


@contextlib.contextmanager
def _logs_as_events(monitor: Monitor) -> Iterator[None]:
    """Route the library's log records into ``monitor.events`` while the view is up."""
    with library_log_to(_LogToEvents(monitor)):
        yield


def _loop(monitor: Monitor, state: TopState, keys: bool) -> None:
    screen = console.is_terminal
    stdin = sys.stdin.fileno() if keys else None
    help_line = KEYS_HELP if keys else "Ctrl-C to quit"

    def frame() -> RenderableType:
        return top_view(
            monitor, state.sort, state.reverse, console.width, paused=state.paused, keys=help_line
        )

    with contextlib.ExitStack() as stack:
        stack.enter_context(_logs_as_events(monitor))
        if stdin is not None:
            stack.enter_context(_cbreak(stdin))
        watched: list[int] = []
        wake = -1
        if os.name == "posix":  # select() waits on pipes and terminals there only
            wake, close = _wake_pipe(monitor)
            stack.callback(close)
            watched = [wake] if stdin is None else [wake, stdin]
        monitor.start()  # samples at once: the wake pipe redraws the first frame
        stack.callback(monitor.stop)
        live = stack.enter_context(
            Live(frame(), console=console, screen=screen, auto_refresh=False)
        )
        while True:
            # Redraw after a sample, a key, or at least once an interval (the clock).
            if watched:
                ready, _, _ = select.select(watched, [], [], monitor.interval)
            else:
                time.sleep(monitor.interval)
                ready = []
            if wake in ready:
                os.read(wake, 4096)
            if stdin is not None and stdin in ready:
                typed = os.read(stdin, 64).decode(errors="ignore")
                if not typed:  # the terminal went away
                    return
                for key in typed:
                    if not state.press(key):
                        return
                if state.paused and monitor.running:
                    monitor.stop()
                elif not state.paused and not monitor.running:
                    monitor.start()
            live.update(frame(), refresh=True)


# -- the command -------------------------------------------------------------------------------


@app.command("top")
@user_errors
def top_cmd(
    interval: Annotated[
        float,
        typer.Option("--interval", "-i", metavar="SECONDS", help="Seconds between samples."),
    ] = 1.0,
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device",
            "-d",
            help="Watch this device (repeatable): 0, cuda:1, cpu, a UUID, sim:T4-16GB. "
            "Default: every GPU, then the CPU.",
        ),
    ] = None,
    sort: Annotated[
        str,
        typer.Option("--sort", help="Sort the processes by memory, pid, name or device."),
    ] = "memory",
    reverse: Annotated[bool, typer.Option("--reverse", help="Reverse the sort.")] = False,
    processes: Annotated[
        int,
        typer.Option(
            "--processes", "-p", min=0, help="Processes to list per device, largest first."
        ),
    ] = 5,
    once: Annotated[
        bool,
        typer.Option("--once", help="Take two samples INTERVAL apart, print one frame and exit."),
    ] = False,
    no_keys: Annotated[
        bool,
        typer.Option("--no-keys", help="Do not read keys from the terminal (Ctrl-C quits)."),
    ] = False,
) -> None:
    """A live view of the devices' memory, their processes and vramctl's alerts.

    Per device: a memory bar, this process's PyTorch allocator, a sparkline of
    memory use over the last samples, the peak, and for GPUs utilization,
    temperature and power. Below: alerts and guard events, and the processes of
    every device. Keys: q quit, s change the sort, r reverse it, p pause.
    Example:

        vramctl top --interval 0.5 --device cuda:0 --sort pid
    """
    from vramctl.monitor import Monitor

    check_seconds("--interval", interval, "1")
    state = TopState(sort=_check_sort(sort), reverse=reverse)
    monitor = Monitor(
        device or None, interval, history=max(SPARK_SAMPLES * 2, 120), processes=processes
    )
    try:
        if once:
            with _logs_as_events(monitor):
                monitor.sample()
                time.sleep(interval)
                monitor.sample()
            console.print(top_view(monitor, state.sort, state.reverse, console.width, keys=None))
        else:
            _loop(monitor, state, _keys_possible(no_keys))
    except KeyboardInterrupt:  # Ctrl-C is how a view without keys ends
        return
