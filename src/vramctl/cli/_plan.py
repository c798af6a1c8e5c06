"""``vramctl plan``: the fastest way to train a model at an effective batch on a GPU."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from vramctl import format_bytes
from vramctl.cli._common import app, console, emit_json, err, user_errors

__all__ = ["plan_cmd"]


def _split(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


@app.command("plan")
@user_errors
def plan_cmd(
    model: Annotated[
        str,
        typer.Argument(help="A built-in model (vramctl estimate --list), a Hub id or config."),
    ],
    device: Annotated[
        str,
        typer.Option(help="The target: a catalog GPU (A10G-24GB), a size, or cpu."),
    ] = "A10G-24GB",
    effective_batch: Annotated[
        int, typer.Option(min=1, help="Samples per optimizer step (micro-batch x steps).")
    ] = 256,
    seq_len: Annotated[
        int | None, typer.Option(min=1, help="Tokens per sample (text models).")
    ] = None,
    seconds: Annotated[
        float | None, typer.Option(min=0.03, help="Audio seconds per sample (speech models).")
    ] = None,
    mode: Annotated[str, typer.Option(help="train, or infer (precision x batch only).")] = "train",
    precision: Annotated[
        str | None,
        typer.Option(help="Precisions to price, comma-separated (fp32,amp-bf16,amp-fp16)."),
    ] = None,
    checkpointing: Annotated[
        str | None,
        typer.Option(help="Checkpointing to price, comma-separated (none,selective,full)."),
    ] = None,
    offload: Annotated[
        str | None,
        typer.Option(
            help="Offloading to price, comma-separated "
            "(none,activations,optimizer,activations+optimizer)."
        ),
    ] = None,
    optimizer: Annotated[
        str | None,
        typer.Option(help="Optimizers to price, comma-separated (adamw,adamw-fused,adamw-8bit)."),
    ] = None,
    utilization: Annotated[
        float, typer.Option(min=0.05, max=1.0, help="Share of the memory a plan may use.")
    ] = 0.9,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Find the fastest way to train MODEL on a device at an effective batch.

    Prices precision x activation checkpointing x offloading x optimizer x
    micro-batch (with gradient accumulation) on fake tensors, nothing run: each
    combination's largest micro-batch that fits, and its predicted step time.
    Prints the fastest plan that fits, the runner-up, and why every other was
    rejected. Takes a minute or more for a large model. Example:

        vramctl plan gpt2 --device A10G-24GB --effective-batch 256 --seq-len 512
    """
    from vramctl.optimize import plan

    with err.status("pricing plans", spinner="dots") as status:
        result = plan(
            model,
            device=device,
            effective_batch=effective_batch,
            mode=mode,
            seq_len=seq_len,
            seconds=seconds,
            precisions=_split(precision),
            checkpointing=_split(checkpointing),
            offload=_split(offload),
            optimizers=_split(optimizer),
            target_utilization=utilization,
            progress=lambda line: status.update(f"pricing {line}"),
        )
    if as_json:
        emit_json(result.to_dict(), indent=True)
        return
    title = f"{result.model} on {result.device}, effective batch {result.effective_batch}"
    table = Table(title=title, title_justify="left")
    for col in (
        "",
        "precision",
        "ckpt",
        "offload",
        "optimizer",
        "micro x acc",
        "peak",
        "s/step",
        "samples/s",
        "why not",
    ):
        table.add_column(col, overflow="fold")
    for p in result.plans:
        tag = "best" if p is result.best else ("2nd" if p is result.runner_up else "")
        table.add_row(
            tag,
            p.precision + ("+tf32" if p.tf32 else ""),
            p.checkpointing,
            p.offload,
            p.optimizer,
            f"{p.micro_batch} x {p.accumulation}",
            format_bytes(p.peak_bytes) if p.peak_bytes else "-",
            f"{p.seconds:.3f}" if p.seconds is not None else "-",
            f"{p.samples_per_second:.1f}" if p.samples_per_second else "-",
            p.rejected,
            style="bold green" if p is result.best else None,
        )
    console.print(table)
    for line in (*result.skipped, *result.notes):
        console.print(f"  {line}", highlight=False)
    if result.best is None:
        raise typer.Exit(1)
