"""Typer application: ``vramctl status``, ``vramctl devices``, ``vramctl catalog``."""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

import vramctl
from vramctl import NA, VramctlError, format_bytes
from vramctl.cli._render import snapshot, status_json, status_view
from vramctl.device import Policy

app = typer.Typer(
    name="vramctl",
    help=(
        "See, predict, fit and share GPU memory for PyTorch work.\n\n"
        "Every command works without a GPU: the CPU is a device whose memory is the host's."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
console = Console()
err = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Print vramctl's bad-input errors as one line and exit 2, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except VramctlError as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vramctl {vramctl.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """See, predict, fit and share GPU memory for PyTorch work."""


def _emit_json(doc: dict[str, Any], *, indent: bool) -> None:
    sys.stdout.write(json.dumps(doc, indent=2 if indent else None) + "\n")
    sys.stdout.flush()


@app.command()
@user_errors
def status(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON (one document per reading).")
    ] = False,
    watch: Annotated[
        float | None,
        typer.Option(
            "--watch",
            "-w",
            metavar="SECONDS",
            help="Refresh every SECONDS until Ctrl-C (with --json: one JSON line per reading).",
        ),
    ] = None,
    count: Annotated[
        int | None,
        typer.Option("--count", "-n", min=1, help="With --watch: stop after this many readings."),
    ] = None,
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device", "-d", help="Only this device (repeatable): 0, cuda:1, cpu, a UUID."
        ),
    ] = None,
    processes: Annotated[
        int,
        typer.Option(
            "--processes", "-p", min=0, help="Processes to list per device, largest first."
        ),
    ] = 5,
) -> None:
    """Show every device's memory as NVML and PyTorch see it, with its processes.

    For each device: used, free and total memory; this process's PyTorch
    allocator (allocated, reserved, peaks, fragmentation); GPU utilization,
    temperature and power where NVML gives them; and the processes using it.
    Readings a device cannot give show as N/A (null in JSON).
    """
    if watch is not None and watch <= 0:
        raise VramctlError(f"--watch {watch:g}: give a positive number of seconds, e.g. --watch 2")
    devs = [vramctl.get_device(d) for d in device] if device else vramctl.devices()
    limit = processes

    if watch is None:
        snap = snapshot(devs, limit)
        if as_json:
            _emit_json(status_json(snap), indent=True)
        else:
            console.print(status_view(snap))
        return

    readings = 0
    try:
        if as_json:
            while True:
                _emit_json(status_json(snapshot(devs, limit)), indent=False)
                readings += 1
                if count is not None and readings >= count:
                    return
                time.sleep(watch)
        with Live(
            status_view(snapshot(devs, limit), watch), console=console, auto_refresh=False
        ) as live:
            readings = 1
            while count is None or readings < count:
                time.sleep(watch)
                live.update(status_view(snapshot(devs, limit), watch), refresh=True)
                readings += 1
    except KeyboardInterrupt:
        return


@app.command("devices")
@user_errors
def devices_cmd(
    select: Annotated[
        str | None,
        typer.Option(
            "--select",
            "-s",
            metavar="SIZE",
            help="Choose a device for SIZE of memory (e.g. 12GiB, 24GB, 512M) and say why.",
        ),
    ] = None,
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            help="With --select: most-free, least-loaded or best-fit.",
        ),
    ] = Policy.MOST_FREE.value,
    target: Annotated[
        float,
        typer.Option(help="With --select: the highest fraction of a device's memory to fill."),
    ] = 0.9,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the devices, or choose one with room for --select SIZE.

    Selection skips devices in the error or disabled state and falls back to the
    CPU, saying why, when no GPU fits or there is none.
    """
    if select is None:
        devs = vramctl.devices()
        if as_json:
            rows = [{**d.to_dict(), "memory": d.memory().to_dict()} for d in devs]
            _emit_json({"schema": "vramctl.devices/1", "devices": rows}, indent=True)
            return
        table = Table(title="devices", title_justify="left")
        for col in ("id", "name", "kind", "total", "free", "compute", "health"):
            table.add_column(col)
        for d in devs:
            mem = d.memory()
            cc = "" if d.capability is NA else str(d.capability)
            table.add_row(
                d.id,
                d.name,
                d.kind,
                format_bytes(mem.total),
                format_bytes(mem.free),
                cc,
                str(d.health.state),
            )
        console.print(table)
        return

    sel = vramctl.rank_devices(select, policy=policy, target=target)
    if as_json:
        _emit_json({"schema": "vramctl.selection/1", **sel.to_dict()}, indent=True)
        return
    console.print(f"[bold]{sel.device.id}[/]  {sel.device.name}")
    console.print(f"why: {sel.reason}", highlight=False, soft_wrap=True)


@app.command()
@user_errors
def catalog(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the GPU catalog used by simulated devices (sim:NAME) and the estimator."""
    specs = vramctl.catalog()
    if as_json:
        _emit_json(
            {"schema": "vramctl.catalog/1", "gpus": [s.to_dict() for s in specs]}, indent=True
        )
        return
    table = Table(title="GPU catalog", title_justify="left")
    for col in ("name", "NVML total", "CUDA-visible", "compute", "bf16", "tf32", "fp8"):
        table.add_column(col)
    for s in specs:
        cc = s.capability
        table.add_row(
            s.name,
            f"{s.total_mib} MiB",
            format_bytes(s.cuda_total_bytes),
            f"{cc} {cc.architecture}",
            *("yes" if f else "no" for f in (cc.bf16, cc.tf32, cc.fp8)),
        )
    console.print(table)
