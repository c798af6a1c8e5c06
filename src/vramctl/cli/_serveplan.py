"""``vramctl serve-plan``: what vLLM and SGLang would make of a model on a GPU, before launch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from vramctl import format_bytes
from vramctl.cli._common import app, console, emit_json, err, user_errors

if TYPE_CHECKING:  # the estimator (and PyTorch) is imported by the command, not by --help
    from vramctl.estimator import ServePlan

__all__ = ["serve_plan_command"]


def _gib(n: int) -> str:
    return format_bytes(n)


def _print(plan: ServePlan) -> None:
    kv = plan.kv
    kinds = f"{kv.full_layers} full-attention layers"
    if kv.sliding_layers:
        kinds += f", {kv.sliding_layers} sliding-window ({kv.window} tokens)"
    console.print(
        f"[bold]{plan.model}[/] on {plan.device}"
        + (f" x {plan.tp} (tensor parallel; figures are one rank's)" if plan.tp > 1 else "")
        + f": {plan.quant or plan.dtype} weights, {plan.kv_dtype} KV cache, "
        f"{format_bytes(kv.token_bytes())} a token ({kinds}"
        + (", MLA latent" if kv.mla else "")
        + ")",
        highlight=False,
        soft_wrap=True,
    )
    table = Table(title_justify="left")
    table.add_column("")
    for e in plan.engines:
        table.add_column(e.engine, justify="right")
    rows: list[tuple[str, list[str]]] = [
        ("setting", [_setting(e.engine, e.settings) for e in plan.engines]),
        ("budget", [_gib(e.budget) for e in plan.engines]),
        ("weights", [_gib(e.weights) for e in plan.engines]),
        ("activation peak", [_gib(e.activation) for e in plan.engines]),
        ("non-torch", [_gib(e.non_torch) if e.non_torch else "-" for e in plan.engines]),
        ("CUDA graphs", [_gib(e.cuda_graphs) if e.cuda_graphs else "-" for e in plan.engines]),
        ("KV cache", [_gib(e.kv_bytes) for e in plan.engines]),
        ("KV tokens", [f"{e.kv_tokens:,}" for e in plan.engines]),
        ("blocks of 16", [f"{e.blocks:,}" if e.blocks is not None else "-" for e in plan.engines]),
        (
            f"requests of {plan.max_model_len:,}",
            [f"{e.concurrency:.2f}x" for e in plan.engines],
        ),
        ("starts", ["yes" if e.starts else "[red]no[/]" for e in plan.engines]),
    ]
    for label, cells in rows:
        table.add_row(label, *cells)
    console.print(table)
    for e in plan.engines:
        if e.error:
            console.print(f"[red]{e.engine}:[/] {e.error}", highlight=False, soft_wrap=True)
        for s in e.suggestions:
            console.print(f"[green]{e.engine}:[/] {s}", highlight=False, soft_wrap=True)
    for e in plan.engines:
        for n in e.notes:
            console.print(f"[dim]{e.engine}: {n}[/]", highlight=False, soft_wrap=True)
    for n in plan.notes:
        console.print(f"[yellow]note:[/] {n}", highlight=False, soft_wrap=True)


def _setting(engine: str, settings: dict[str, object]) -> str:
    if engine == "vllm":
        return f"utilization {settings['gpu_memory_utilization']}"
    return f"fraction {settings['mem_fraction_static']}"


@app.command("serve-plan")
@user_errors
def serve_plan_command(
    model: Annotated[
        str,
        typer.Argument(
            help="A causal language model by its config: a Hub id, a folder with "
            "config.json, or the JSON file."
        ),
    ],
    device: Annotated[
        str,
        typer.Option(
            "--device", "-d", help="The GPU: a catalog name (H100-80GB, L4-24GB) or a size."
        ),
    ] = "H100-80GB",
    max_model_len: Annotated[
        int | None,
        typer.Option(
            "--max-model-len",
            help="Longest request in tokens, prompt and output (SGLang's --context-length). "
            "Default: the config's positions.",
        ),
    ] = None,
    engine: Annotated[
        list[str] | None,
        typer.Option("--engine", help="vllm or sglang (repeat for both). Default: both."),
    ] = None,
    gpu_memory_utilization: Annotated[
        float,
        typer.Option("--gpu-memory-utilization", help="vLLM's share of the GPU, in (0, 1]."),
    ] = 0.9,
    mem_fraction_static: Annotated[
        float | None,
        typer.Option(
            "--mem-fraction-static",
            help="SGLang's share for weights and KV cache, in (0, 1]. Default: SGLang's own "
            "for the GPU.",
        ),
    ] = None,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel GPUs.")] = 1,
    dtype: Annotated[
        str, typer.Option("--dtype", help="auto, bf16, fp16 or fp32 weights.")
    ] = "auto",
    kv_dtype: Annotated[
        str,
        typer.Option("--kv-dtype", help="auto, bf16, fp16, fp8, fp8_e4m3 or fp8_e5m2."),
    ] = "auto",
    max_num_seqs: Annotated[
        int | None, typer.Option("--max-num-seqs", help="vLLM's most requests in a batch.")
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-num-batched-tokens", help="vLLM's tokens in one step (its profiling forward)."
        ),
    ] = None,
    chunked_prefill_size: Annotated[
        int | None, typer.Option("--chunked-prefill-size", help="SGLang's prefill chunk.")
    ] = None,
    enforce_eager: Annotated[
        bool, typer.Option("--enforce-eager", help="No CUDA graphs (both engines).")
    ] = False,
    cuda_graph_gib: Annotated[
        float | None,
        typer.Option("--cuda-graph-gib", help="vLLM's CUDA graph estimate. Default: 0.5."),
    ] = None,
    non_torch_gib: Annotated[
        float | None,
        typer.Option("--non-torch-gib", help="vLLM's non-torch memory. Default: 0.35."),
    ] = None,
    target_concurrency: Annotated[
        int | None,
        typer.Option(
            "--target-concurrency",
            help="Requests of --max-model-len to hold at once: say which settings reach it.",
        ),
    ] = None,
    quant: Annotated[
        str | None,
        typer.Option(
            "--quant",
            help="A quantized checkpoint's format: awq, gptq, fp8, int8 ... (a config's own "
            "quantization_config is read without it).",
        ),
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare",
            help="Price 16-bit, fp8 and AWQ int4 weights, each with a 16-bit and an fp8 KV "
            "cache, side by side.",
        ),
    ] = False,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Let a model with its own code build.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """How many tokens and requests vLLM and SGLang would hold, and whether they start.

    Each engine's own rule (vLLM: capacity x utilization less the weights, its profiling
    forward's activation peak, non-torch memory and CUDA graphs; SGLang: its static
    fraction of free memory less the weights), with the weights and the activation
    peak traced on fake tensors. No GPU is needed.

    Example: vramctl serve-plan Qwen/Qwen2.5-7B-Instruct -d L4-24GB --max-model-len 16384
    """
    from vramctl import VramctlError
    from vramctl.estimator import ENGINES, serve_plan
    from vramctl.estimator._shared import VARIANTS, serve_variants

    GiB = 1 << 30
    common: dict[str, Any] = dict(
        max_model_len=max_model_len,
        engine=tuple(engine) if engine else ENGINES,
        gpu_memory_utilization=gpu_memory_utilization,
        mem_fraction_static=mem_fraction_static,
        tp=tp,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        chunked_prefill_size=chunked_prefill_size,
        enforce_eager=enforce_eager,
        cuda_graph_memory=None if cuda_graph_gib is None else int(cuda_graph_gib * GiB),
        non_torch_memory=None if non_torch_gib is None else int(non_torch_gib * GiB),
        target_concurrency=target_concurrency,
        trust_remote_code=trust_remote_code,
    )
    if compare:
        if quant is not None or kv_dtype != "auto":
            raise VramctlError("--compare prices its own --quant and --kv-dtype: drop them")
        with err.status("tracing each variant's weights and profiling forward", spinner="dots"):
            plans = serve_variants(model, device, **common)
        if as_json:
            emit_json(
                {
                    "schema": "vramctl.serve-plan-compare/1",
                    "variants": [
                        {"variant": label, **p.to_dict()}
                        for (label, _, _), p in zip(VARIANTS, plans, strict=True)
                    ],
                },
                indent=True,
            )
            return
        _print_compare([label for label, _, _ in VARIANTS], plans)
        return
    with err.status("tracing the weights and the profiling forward", spinner="dots"):
        plan = serve_plan(model, device, kv_dtype=kv_dtype, quant=quant, **common)
    if as_json:
        emit_json({"schema": "vramctl.serve-plan/1", **plan.to_dict()}, indent=True)
        return
    _print(plan)


def _print_compare(labels: list[str], plans: list[ServePlan]) -> None:
    first = plans[0]
    console.print(
        f"[bold]{first.model}[/] on {first.device}"
        + (f" x {first.tp}" if first.tp > 1 else "")
        + f", requests of {first.max_model_len:,} tokens",
        highlight=False,
        soft_wrap=True,
    )
    table = Table(title_justify="left")
    table.add_column("weights", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    for e in first.engines:
        table.add_column(f"{e.engine} tokens", justify="right", no_wrap=True)
        table.add_column("requests", justify="right", no_wrap=True)
    for label, plan in zip(labels, plans, strict=True):
        cells = [label, f"{plan.engines[0].weights / (1 << 30):.2f}"]
        for e in plan.engines:
            cells += [
                f"{e.kv_tokens:,}",
                f"{e.concurrency:.2f}x" + ("" if e.starts else " ✗"),
            ]
        table.add_row(*cells)
    console.print(table)
    console.print(
        "[dim]quantized weights are priced in their libraries' storage (AWQ: 4-bit, groups of "
        "128; fp8: a byte a weight and a scale a row); the embeddings and the output head stay "
        "16-bit; ✗: the engine would not start[/]",
        highlight=False,
        soft_wrap=True,
    )
