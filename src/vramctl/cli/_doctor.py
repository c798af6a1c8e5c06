"""``vramctl doctor``: check the environment and say what to change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from vramctl.cli._common import app, check_can_write, console, emit_json, user_errors

if TYPE_CHECKING:  # the doctor (and PyTorch) is imported by the command, not by --help
    from vramctl.doctor import DoctorReport

__all__ = ["doctor_cmd"]

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan", "ok": "green"}


def _table(report: DoctorReport) -> Table:
    table = Table(
        title=f"vramctl doctor: {report.summary()}", title_justify="left", show_lines=False
    )
    table.add_column("level", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("finding and what to change")
    for n, (level, found) in enumerate(report.by_level()):
        if n:
            table.add_section()
        for f in found:
            text = escape(f.message)
            if f.action:
                text += f"\n[dim]-> {escape(f.action)}[/]"
            table.add_row(f"[{_STYLE[level]}]{level}[/]", f.check, text)
    return table


def write_report(report: DoctorReport, path: Path) -> None:
    """``path``: the JSON object for a ``.json`` name, else the Markdown report."""
    if path.suffix.lower() == ".json":
        text = json.dumps(report.to_dict(), indent=2) + "\n"
    else:
        text = report.to_markdown()
    path.expanduser().write_text(text, encoding="utf-8")


@app.command("doctor")
@user_errors
def doctor_cmd(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as one JSON object.")
    ] = False,
    report: Annotated[
        Path | None,
        typer.Option(
            "--report",
            metavar="FILE",
            help="Also write the report to FILE: JSON for a .json name, else Markdown.",
            show_default=False,
        ),
    ] = None,
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device",
            "-d",
            metavar="DEVICE",
            help="Only this GPU (repeatable): 0, cuda:1, a UUID.",
        ),
    ] = None,
) -> None:
    """Check the environment for PyTorch work on GPUs, and say what to change.

    Checks the NVIDIA driver's CUDA version against torch's build, NVML access,
    each GPU's other processes, MIG, persistence mode, ECC errors and load,
    PYTORCH_CUDA_ALLOC_CONF, TF32 and cuDNN, /dev/shm, the cgroup memory limit,
    swap, CPU threads, and the versions of transformers, accelerate, lightning
    and nvidia-ml-py. Without a GPU it says so and checks the rest. Each finding
    has a level (ok, info, warning, error) and an action; doctor changes nothing.

    Exit status: 0, or 1 when a finding is an error. Examples:

      vramctl doctor

      vramctl doctor --json

      vramctl doctor --report doctor.md
    """
    if report is not None:
        check_can_write("--report", report)
    from vramctl.doctor import doctor

    result = doctor(devices=device or None)
    if report is not None:
        write_report(result, report)
    if as_json:
        emit_json(result.to_dict(), indent=True)
    else:
        console.print(_table(result))
        if report is not None:
            console.print(f"report written to {report}", highlight=False)
    if result.worst == "error":
        raise typer.Exit(1)
