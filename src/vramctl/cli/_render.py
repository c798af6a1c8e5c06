"""Turning readings into rich tables and JSON documents."""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

import vramctl
from vramctl import NA, Device, MemoryState, ProcessMemory, format_bytes
from vramctl.device import HealthState

if TYPE_CHECKING:  # the estimator (and PyTorch) is imported by `estimate`, not by `status`
    from vramctl.estimator import Estimate, MaxBatch

__all__ = [
    "STATUS_SCHEMA",
    "estimate_table",
    "max_batch_lines",
    "snapshot",
    "status_json",
    "status_view",
]

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


# -- vramctl estimate ---------------------------------------------------------------


def _fits_cell(e: Estimate) -> str:
    if e.fits_point == e.fits_safe:
        return "[green]yes[/]" if e.fits else "[red]no[/]"
    # Fits at the point estimate, not at the safe end of the range.
    return "[yellow]maybe[/]"


def estimate_table(results: list[Estimate]) -> Table:
    """The estimates of one model at several batch sizes: the three peaks and the verdict."""
    first = results[0]
    uncertain = any(e.device_uncertainty for e in results)
    if not first.cuda:
        caption = "CPU target: live tensor bytes (no allocator or CUDA context to add)"
    else:
        caption = (
            "allocated, reserved: torch.cuda.max_memory_allocated, max_memory_reserved; "
            "nvidia-smi: reserved + CUDA context"
        )
    if uncertain:
        caption += (
            f", from the point estimate to {format_bytes(first.device_uncertainty)} above it "
            f"(fits judged at the {'safe end' if first.safe else 'point estimate'}"
            + (
                "; maybe: fits at the point estimate only"
                if any(e.fits_point != e.fits_safe for e in results)
                else ""
            )
            + ")"
        )
    table = Table(
        title=f"{first.model} {first.mode} {first.precision} on {first.device} "
        f"(budget {format_bytes(first.budget)} = {first.target_utilization:.0%} of "
        f"{format_bytes(first.capacity)})",
        title_justify="left",
        caption=caption,
        caption_justify="left",
    )
    peak = "nvidia-smi" if first.cuda else "peak"
    for col in ("batch", peak, "reserved", "allocated", "fits", "traced in"):
        table.add_column(col, justify="right")
    for e in results:
        table.add_row(
            str(e.batch_size),
            e.device_range(),
            format_bytes(e.peak_reserved),
            format_bytes(e.peak_allocated),
            _fits_cell(e),
            f"{e.elapsed:.2f} s",
        )
    return table


def max_batch_lines(best: MaxBatch, batch_fn: str | None = None, what: str = "batch") -> list[str]:
    """What ``estimate --max-batch`` says: the answer and what it rests on, or that there
    is none up to where the search could go (``what``: "batch", or "micro-batch per rank")."""
    from vramctl.estimator._shared import SEARCH_INPUT_BYTES

    lines: list[str] = []
    per = f"{format_bytes(best.per_sample)} per sample"
    if best.limit_found and best.batch_size == 0:
        lines.append(f"largest {what} that fits: [bold]none[/] (batch 1 does not fit)")
    elif best.limit_found:
        n = best.batch_size
        lines.append(
            f"largest {what} that fits: [bold]{n}[/] ({per}; traced: {n} fits, {n + 1} does not)"
        )
    else:
        why = {
            "limit": "the search's limit",
            "bound": "the search's bound",
            "input": f"a larger batch from {batch_fn or 'the batch function'} would take over "
            f"{format_bytes(SEARCH_INPUT_BYTES)} of host memory to build",
            "traces": "the search used up its traces",
        }.get(best.stopped_by or "", "the search's end")
        lines.append(
            f"largest {what} that fits: [bold]no limit found up to {best.batch_size}[/]: every "
            f"batch traced fits ({per}); the search stopped there ({why}), larger batches may "
            "fit too"
        )
    est = best.estimate
    if est is not None and est.device_uncertainty:
        if best.safe:
            lines.append(
                f"  judged at the safe end of the device range (nvidia-smi up to "
                f"{format_bytes(est.device_uncertainty)} above the point estimate); "
                "--optimistic judges at the point estimate"
            )
        else:
            lines.append(
                f"  judged at the point estimate (--optimistic): nvidia-smi may read up to "
                f"{format_bytes(est.device_uncertainty)} more"
            )
    lines += [f"  note: {n}" for n in best.notes]
    return lines
