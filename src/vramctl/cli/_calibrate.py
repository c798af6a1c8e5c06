"""``vramctl calibrate``: measure this GPU's CUDA constants for later estimates."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from vramctl import VramctlError, format_bytes
from vramctl.cli._common import app, check_can_write, console, emit_json, err, user_errors

if TYPE_CHECKING:  # the estimator (and PyTorch) is imported by the command, not by --help
    from vramctl.estimator import Calibration

__all__ = ["calibrate"]


def _value(name: str, v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if "handles" in name:
        return str(v)
    return format_bytes(v) if isinstance(v, int) else str(v)


def _print_profile(cal: Calibration) -> None:
    from vramctl.estimator import builtin_calibration
    from vramctl.estimator._shared import constant_rows

    builtin = builtin_calibration(cal.device, cal.capability)
    table = Table(title=f"CUDA constants of {cal.describe()}", title_justify="left")
    table.add_column("constant")
    table.add_column("built-in", justify="right")
    table.add_column("measured", justify="right")
    for name, old, new in constant_rows(cal, builtin):
        style = "" if old == new else "bold"
        table.add_row(
            name,
            _value(name, old),
            f"[{style}]{_value(name, new)}[/]" if style else _value(name, new),
        )
    console.print(table)
    ctx = cal.measurements.get("context") or {}
    if ctx.get("method"):
        console.print(f"context read from: {ctx['method']}", highlight=False)
    if ctx.get("other_processes"):
        console.print(
            f"[yellow]note:[/] {ctx['other_processes']} other process(es) used the GPU during "
            "the measurement",
            highlight=False,
        )
    for note in cal.measurements.get("notes") or []:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)


def _list(as_json: bool) -> None:
    from vramctl.estimator import calibration_dir, list_calibrations

    found = list_calibrations()
    if as_json:
        emit_json(
            {
                "schema": "vramctl.calibrations/1",
                "directory": str(calibration_dir()),
                "profiles": [{**c.to_dict(), "path": str(c.path)} for c in found],
            },
            indent=True,
        )
        return
    if not found:
        console.print(
            f"no calibration profiles in {calibration_dir()}; run `vramctl calibrate` on a GPU",
            highlight=False,
        )
        return
    table = Table(title=f"calibration profiles in {calibration_dir()}", title_justify="left")
    for col in ("#", "device", "sm", "created", "context", "cuBLAS", "cuDNN / output"):
        table.add_column(col)
    for n, c in enumerate(found, 1):
        cc = f"{c.capability.major}.{c.capability.minor}" if c.capability else "?"
        table.add_row(
            str(n),
            c.device,
            cc,
            c.created[:10],
            format_bytes(c.context_bytes),
            format_bytes(c.cublas_split()[0]),
            f"{c.cudnn_workspace_ratio:g}",
        )
    console.print(table)
    for n, c in enumerate(found, 1):
        console.print(f"{n}: {c.path}", highlight=False, soft_wrap=True)


def _check_out(out: Path, save: bool) -> None:
    """Refuse an --out the profile cannot be written to before measuring, not after."""
    if not save:
        raise VramctlError(
            f"--out {str(out)!r} saves the profile and --no-save saves none: drop one of them"
        )
    check_can_write("--out", out, make_parents=True)


def _calibrate_cpu(save: bool, as_json: bool) -> None:
    from vramctl.estimator._shared import cpu_profile_path, cpu_throughput

    with err.status("measuring this CPU's throughput", spinner="dots"):
        tp = cpu_throughput(remeasure=True, save=save)
    path = cpu_profile_path() if save else None
    if as_json:
        emit_json({**tp.to_dict(), "path": str(path) if path else None}, indent=True)
        return
    console.print(f"[bold]{tp.source}[/]", highlight=False)
    for group, rates in tp.rates.items():
        shown = ", ".join(f"{k} {v / 1e9:,.1f}" for k, v in rates.items())
        console.print(f"  {group:<26} GFLOP/s: {shown}", highlight=False)
    console.print(f"  {'memory':<26} {tp.bandwidth / 1e9:,.1f} GB/s", highlight=False)
    console.print(
        f"  {'overhead':<26} {tp.op_overhead * 1e6:.1f} us per operator, "
        f"{tp.view_overhead * 1e6:.1f} us per view, {tp.tensor_overhead * 1e6:.2f} us per "
        f"tensor of a list, {tp.dispatch_overhead * 1e6:.1f} us through a dispatch mode",
        highlight=False,
    )
    if tp.per_element:
        slowest = sorted(tp.per_element.items(), key=lambda kv: -kv[1])[:4]
        shown = ", ".join(f"{k} {v * 1e9:.2f}" for k, v in slowest)
        console.print(f"  {'ns per element':<26} {shown} ...", highlight=False)
    under = ""
    if tp.autocast_factors is not None:
        kernels, overheads = tp.autocast_factors
        under = f" (under autocast x{kernels:.2f}, x{overheads:.2f})"
    console.print(
        f"  {'fitted to reference steps':<26} kernels x{tp.step_factor:.2f}, overheads "
        f"x{tp.overhead_factor:.2f}{under}; step times within ±{100 * tp.error:.0f}%",
        highlight=False,
    )
    if path is not None:
        console.print(f"saved to {path}", highlight=False)


@app.command()
@user_errors
def calibrate(
    device: Annotated[
        str | None,
        typer.Argument(
            help="The GPU to measure (cuda:N, an index or a UUID). Default: the first GPU.",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Write the profile here instead of the calibration directory.",
            show_default=False,
        ),
    ] = None,
    save: Annotated[
        bool, typer.Option(help="Save the profile (--no-save only prints the figures).")
    ] = True,
    list_profiles: Annotated[
        bool, typer.Option("--list", help="List the saved profiles and exit.")
    ] = False,
    cpu: Annotated[
        bool,
        typer.Option(
            "--cpu", help="Measure this CPU's throughput (step times on the CPU) instead."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Measure this GPU's CUDA constants and speed; later estimates for it use them.

    In a fresh process, with the GPU otherwise idle, this reads the CUDA context
    (through NVML), the cuBLAS workspace per handle and the handles a training
    step uses, the cuDNN workspace of convolutions like those of ResNet,
    ConvNeXt and wav2vec2, and the caching allocator's segment sizes, with a
    few small workloads (at most 600 s). The profile goes to the calibration directory
    ($VRAMCTL_CONFIG_DIR, else ~/.config/vramctl, then calibration/); later
    estimates for this GPU, or another of its compute capability, use it.
    'vramctl estimate --calibration off' (or VRAMCTL_CALIBRATION=off) uses the
    built-in constants instead. The profile also keeps the GPU's measured
    throughput (matrix multiplies by dtype, convolutions, attention, memory
    bandwidth, per-operator overhead), which step-time predictions use in place
    of the data sheet's peaks. --cpu measures the CPU's the same way (a second
    or two; estimates for the CPU measure it once by themselves). Example:

        vramctl calibrate                # measure cuda:0 and save its profile
        vramctl calibrate --cpu          # measure this CPU's throughput
        vramctl calibrate --list         # the saved profiles
    """
    if list_profiles:
        _list(as_json)
        return
    if cpu:
        _calibrate_cpu(save, as_json)
        return
    from vramctl.estimator import calibrate as run_calibration

    if out is not None:
        _check_out(out, save)
    with err.status("measuring the GPU's CUDA constants in a fresh process", spinner="dots"):
        cal = run_calibration(device, path=out, save=save)
    if as_json:
        emit_json({**cal.to_dict(), "path": str(cal.path) if cal.path else None}, indent=True)
        return
    _print_profile(cal)
    if cal.path is not None:
        console.print(f"saved to {cal.path}", highlight=False)
