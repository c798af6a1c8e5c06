"""Turning readings into rich tables and JSON documents."""

from __future__ import annotations

import socket
import time
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

import vramctl
from vramctl import NA, Device, MemoryState, ProcessMemory, format_bytes
from vramctl.device import HealthState

__all__ = ["STATUS_SCHEMA", "snapshot", "status_json", "status_view"]

STATUS_SCHEMA = "vramctl.status/1"

_HEALTH_STYLE = {
    HealthState.AVAILABLE: "green",
    HealthState.BUSY: "yellow",
    HealthState.ERROR: "red",
    HealthState.DISABLED: "bold red",
}


# What the views draw with, for a terminal that cannot show it (LANG=en_US.ISO-8859-1,
# PYTHONIOENCODING=ascii): rich swaps its box characters itself, but not those in text.
_ASCII = str.maketrans(
    {
        "█": "#",
        "░": ".",
        "·": "-",
        "–": "-",
        "—": "-",
        "…": "~",
        "→": "->",
        "↑": "^",
        "↓": "v",
        "°": "",
        **dict.fromkeys("▁▂▃", "_"),
        **dict.fromkeys("▄▅", "="),
        **dict.fromkeys("▆▇", "#"),
    }
)


class EncodingSafe:
    """``renderable`` as is on a UTF-8 console; on any other, with ASCII stand-ins.

    Characters the console's encoding cannot write otherwise raise
    ``UnicodeEncodeError`` from ``print``.
    """

    def __init__(self, renderable: RenderableType) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        encoding = (options.encoding or "utf-8").lower()
        if encoding.startswith("utf"):
            yield self.renderable
            return
        for seg in console.render(self.renderable, options):
            if seg.control or seg.text.isascii():
                yield seg
                continue
            text = seg.text.translate(_ASCII)
            text = text.encode(encoding, errors="replace").decode(encoding, errors="replace")
            yield Segment(text, seg.style, seg.control)


def snapshot(devs: list[Device], process_limit: int | None) -> list[dict[str, Any]]:
    """One reading of each device: description, memory, processes."""
    out = []
    for dev in devs:
        mem = dev.memory()
        procs = dev.processes(limit=process_limit)
        out.append({"device": dev, "memory": mem, "processes": procs})
    return out


def status_json(snap: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "schema": STATUS_SCHEMA,
        "version": vramctl.__version__,
        "host": socket.gethostname(),
        "timestamp": time.time(),
        "devices": [
            {
                **row["device"].to_dict(),
                "memory": row["memory"].to_dict(),
                "processes": [p.to_dict() for p in row["processes"]],
            }
            for row in snap
        ],
    }


def _pct(value: float | Any) -> str:
    return "N/A" if value is NA else f"{value:.0%}"


def _bar(frac: float | Any, width: int = 24) -> Text:
    if frac is NA:
        return Text("·" * width, style="dim")
    filled = max(0, min(width, round(frac * width)))
    style = "green" if frac < 0.8 else ("yellow" if frac < 0.95 else "red")
    return Text("█" * filled, style=style) + Text("░" * (width - filled), style="dim")


def _memory_grid(mem: MemoryState, dev: Device) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row(
        "memory",
        Text.assemble(
            _bar(mem.utilization),
            f"  {format_bytes(mem.used)} / {format_bytes(mem.total)} used "
            f"({_pct(mem.utilization)}), {format_bytes(mem.free)} free",
        ),
    )
    grid.add_row("this process", format_bytes(mem.process_used))
    if dev.is_gpu:
        grid.add_row(
            "PyTorch",
            f"allocated {format_bytes(mem.allocated)} (peak {format_bytes(mem.peak_allocated)}), "
            f"reserved {format_bytes(mem.reserved)} (peak {format_bytes(mem.peak_reserved)}), "
            f"fragmentation {_pct(mem.fragmentation)}, retries {mem.alloc_retries}, "
            f"OOMs {mem.ooms}",
        )
        temp = "N/A" if mem.temperature_c is NA else f"{mem.temperature_c:.0f} °C"
        power = "N/A" if mem.power_w is NA else f"{mem.power_w:.0f} W"
        util = "N/A" if mem.compute_utilization is NA else f"{mem.compute_utilization:.0f}%"
        grid.add_row("GPU", f"utilization {util}, temperature {temp}, power {power}")
        cc = dev.capability
        if cc is not NA:
            feats = ", ".join(k for k, v in cc.features().items() if v) or "none of bf16/tf32/fp8"
            grid.add_row("compute", f"{cc} ({cc.architecture}): {feats}")
    if dev.health.reason:
        grid.add_row("health", f"{dev.health.state}: {dev.health.reason}")
    return grid


def _process_table(procs: list[ProcessMemory], cpu: bool) -> Table:
    table = Table(show_edge=False, box=None, header_style="bold dim", pad_edge=False)
    for col in ("PID", "user", "name", "RSS" if cpu else "GPU memory", "command"):
        table.add_column(col, justify="right" if col in ("PID", "RSS", "GPU memory") else "left")
    for p in procs:
        cmd = "N/A" if p.command is NA else p.command
        table.add_row(
            str(p.pid),
            str(p.user),
            str(p.name),
            format_bytes(p.used),
            (cmd[:60] + "…") if len(cmd) > 61 else cmd,
        )
    return table


def status_view(snap: list[dict[str, Any]], every: float | None = None) -> Group:
    return Group(EncodingSafe(_status_panels(snap, every)))


def _status_panels(snap: list[dict[str, Any]], every: float | None) -> Group:
    panels: list[Any] = []
    if every is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        panels.append(
            Text(f"vramctl status · every {every:g} s · {stamp} · Ctrl-C to stop", style="dim")
        )
    for row in snap:
        dev: Device = row["device"]
        mem: MemoryState = row["memory"]
        procs: list[ProcessMemory] = row["processes"]
        style = _HEALTH_STYLE[dev.health.state]
        title = Text.assemble((dev.id, "bold"), f"  {dev.name}  ", (str(dev.health.state), style))
        body: list[Any] = [_memory_grid(mem, dev)]
        if procs:
            body.append(Text(""))
            body.append(_process_table(procs, not dev.is_gpu))
        else:
            body.append(Text("no processes listed", style="dim"))
        panels.append(Panel(Group(*body), title=title, title_align="left", border_style=style))
    return Group(*panels)
