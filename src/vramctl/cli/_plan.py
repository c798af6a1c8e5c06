"""``vramctl plan``: the fastest way to train a model at an effective batch on a GPU."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from vramctl import VramctlError, format_bytes
from vramctl.cli._common import app, console, emit_json, err, user_errors

if TYPE_CHECKING:
    from vramctl.optimize import Plan, PlanResult

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
    finetune: Annotated[
        str | None,
        typer.Option(
            help="Fine-tuning to price, comma-separated (full,lora,qlora). Default: full, "
            "and all three with --lora or --quant."
        ),
    ] = None,
    lora: Annotated[
        str | None,
        typer.Option(
            help="The LoRA adapter of the lora and qlora plans, as vramctl estimate "
            "--lora takes it (default r=16,alpha=32,targets=all-linear)."
        ),
    ] = None,
    quant: Annotated[
        str | None,
        typer.Option(
            help="The 4-bit weights of the qlora plans (nf4 or fp4; default nf4 with "
            "double quantization)."
        ),
    ] = None,
    double_quant: Annotated[
        bool,
        typer.Option("--double-quant", help="With --quant: bitsandbytes' double quantization."),
    ] = False,
    kbit_prep: Annotated[
        bool,
        typer.Option(
            "--kbit-prep",
            help="Price the qlora plans as PEFT's prepare_model_for_kbit_training leaves "
            "the model (what is not quantized kept in fp32).",
        ),
    ] = False,
    utilization: Annotated[
        float, typer.Option(min=0.05, max=1.0, help="Share of the memory a plan may use.")
    ] = 0.9,
    show_all: Annotated[
        bool,
        typer.Option("--all", help="Print every plan priced, in a table, and why each lost."),
    ] = False,
    exhaustive: Annotated[
        bool,
        typer.Option(
            "--exhaustive",
            help="Price every combination, even those that cannot beat the best plan "
            "(slower; the choice is the same).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Find the fastest way to train MODEL on a device at an effective batch.

    Prices precision x activation checkpointing x offloading x optimizer x
    micro-batch (with gradient accumulation) on fake tensors, nothing run: each
    combination's largest micro-batch that fits, and its predicted step time.
    Prints the fastest plan that fits, the runner-up, and the fastest plan of each
    other choice (--all: every plan, and why each lost). Combinations that cannot
    beat the best by the time model are not priced (--exhaustive prices them).
    About a minute for GPT-2 on a 2-core machine. Example:

        vramctl plan gpt2 --device A10G-24GB --effective-batch 256 --seq-len 512

    With --lora or --quant, full fine-tuning, LoRA on a 16-bit base and QLoRA
    (LoRA on 4-bit weights) are priced side by side (needs vramctl[finetune]):

    \b
        vramctl plan docs/examples/llama-3.1-8b --device L4-24GB \\
            --effective-batch 16 --seq-len 1024 \\
            --lora r=16,alpha=32,targets=all-linear \\
            --checkpointing full --offload none --optimizer adamw
    """
    from vramctl.optimize import plan

    quant_arg: object = None
    if quant is not None:
        from vramctl.estimator._shared import quant_spec

        quant_arg = quant_spec(quant, double_quant=double_quant)
    elif double_quant:
        raise VramctlError("--double-quant goes with --quant")

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
            finetune=_split(finetune),
            adapter=lora,
            quant=quant_arg,
            kbit_prep=kbit_prep,
            progress=lambda line: status.update(f"pricing {line}"),
            prune=not exhaustive,
        )
    if as_json:
        emit_json(result.to_dict(), indent=True)
        return
    title = f"{result.model} on {result.device}, effective batch {result.effective_batch}"
    if not show_all:
        _summary(result, title)
        return
    # The settings every plan shares are said once, above the table, so that the
    # table keeps to the axes that vary and stays readable in 80 columns.
    axes = dict(_AXES)
    if not any(p.parallel for p in result.plans):
        del axes["parallel"]
    shared = {
        k: f(result.plans[0]) for k, f in axes.items() if len({f(p) for p in result.plans}) == 1
    }
    varying = [k for k in axes if k not in shared]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("#", *varying, "micro x acc", "peak", "s/step", "samples/s"):
        table.add_column(col, no_wrap=True)
    why = Table.grid(padding=(0, 2))
    why.add_column(justify="right", no_wrap=True)
    why.add_column(overflow="fold")
    for n, p in enumerate(result.plans, 1):
        tag = "best" if p is result.best else ("2nd" if p is result.runner_up else str(n))
        table.add_row(
            tag,
            *(axes[k](p) for k in varying),
            f"{p.micro_batch} x {p.accumulation}",
            format_bytes(p.peak_bytes) if p.peak_bytes else "-",
            f"{p.seconds:.3f}" if p.seconds is not None else "-",
            f"{p.samples_per_second:.1f}" if p.samples_per_second else "-",
            style="bold green" if p is result.best else None,
        )
        if p.rejected and p is not result.runner_up:
            why.add_row(tag, p.rejected)
    console.print(title, highlight=False)
    if shared:
        console.print(
            "every plan: " + ", ".join(f"{k} {v}" for k, v in shared.items()), highlight=False
        )
    console.print(table)
    if result.runner_up is not None and result.runner_up.rejected:
        console.print(f"2nd: {result.runner_up.rejected}", highlight=False)
    if why.row_count:
        console.print("why not:", highlight=False)
        console.print(why, highlight=False)
    for line in (*result.skipped, *result.notes):
        console.print(f"  {line}", highlight=False)
    if result.best is None:
        raise typer.Exit(1)


#: The axes a plan varies on, by name and how a plan reads on it.
_AXES: dict[str, Callable[[Plan], str]] = {
    "parallel": lambda p: p.parallel or "one process",
    "tuning": lambda p: p.finetune,
    "precision": lambda p: p.precision + ("+tf32" if p.tf32 else ""),
    "ckpt": lambda p: p.checkpointing,
    "offload": lambda p: p.offload,
    "optimizer": lambda p: p.optimizer,
}


def _summary(result: PlanResult, title: str) -> None:
    """The best plan, the runner-up, and the fastest plan of each other value of each axis
    (or why it has none), a line each."""
    lines = [title]
    best = result.best
    if best is None:
        lines.append("best: none fits: " + (result.plans[0].rejected if result.plans else ""))
    else:
        rate = f", {best.samples_per_second:.1f} samples/s" if best.samples_per_second else ""
        error = f" ±{100 * best.seconds_error:.0f}%" if best.seconds_error else ""
        seconds = f"{best.seconds:.3g} s/step{error}{rate}, " if best.seconds is not None else ""
        lines.append(f"best: {best.label}")
        peak = f"peak {format_bytes(best.peak_bytes)} of {format_bytes(best.budget_bytes)}"
        lines.append(f"      {seconds}{peak}")
        if result.runner_up is not None:
            lines.append(f"2nd:  {result.runner_up.label}: {_short(result.runner_up.rejected)}")
        same = result.equivalent
        if same and best.seconds_error:
            lines.append(
                f"      {len(same)} plan{'s' if len(same) > 1 else ''} within the time model's "
                f"±{100 * best.seconds_error:.0f}% of the best: equivalent to it by the model"
            )
        others = []
        for axis, of in _AXES.items():
            values = dict.fromkeys(of(p) for p in result.plans)
            for value in values:
                if value != of(best) and len(values) > 1:
                    family = [p for p in result.plans if of(p) == value]
                    others.append(f"  {axis} {value}: {_family(result, family)}")
        if others:
            lines += ["the fastest with another choice:", *others]
    pruned = sum(p.priced == "pruned" for p in result.plans)
    if pruned:
        lines.append(
            f"{pruned} of {len(result.plans)} plans not priced: they cannot beat the best "
            "(--all says why, --exhaustive prices them)"
        )
    lines += [f"  {line}" for line in (*result.skipped, *result.notes)]
    for line in lines:
        console.print(line, highlight=False)
    if best is None:
        raise typer.Exit(1)


def _short(rejected: str) -> str:
    """A rejection in a summary line: ``12% slower`` (the time model's error is said once)."""
    text = re.sub(r" \(within the time model's ±\d+%\)", "", rejected)
    text = re.sub(
        r"^not priced: .*cannot beat the best plan \([^)]*\): .* takes? ([0-9.e+-]+ s)\b.*$",
        r"cannot beat the best (at least \1)",
        text,
    )
    text = re.sub(
        r"^not priced: it adds recomputation or copies to checkpointing (\S+), offload (\S+), "
        r"which cannot beat the best plan.*$",
        r"cannot beat the best (more than ckpt \1, offload \2)",
        text,
    )
    return text.replace(" slower than the best", " slower")


def _family(result: PlanResult, plans: list[Plan]) -> str:
    """The fastest fitting plan of ``plans`` against the best, or why none fits."""
    fitting = [p for p in plans if p.fits]
    if fitting:
        fastest = fitting[0]  # the plans are ranked, the fastest first
        if fastest is result.runner_up:
            return f"{_short(fastest.rejected)} (the 2nd)"
        return f"{_short(fastest.rejected)} ({fastest.label})"
    traced = [p for p in plans if p.priced != "pruned"]
    if not traced:
        best = result.best
        if best is None:
            return _short(plans[0].rejected)
        # the one that differs from the best in the fewest other ways
        nearest = min(plans, key=lambda p: sum(of(p) != of(best) for of in _AXES.values()))
        return _short(nearest.rejected)
    return "nothing fits: " + min(traced, key=lambda p: p.micro_batch).rejected
