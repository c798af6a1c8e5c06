"""``vramctl status``, ``devices``, ``catalog`` and ``estimate``.

The other commands live in their own modules, which register themselves on the shared
``app`` (``_common``) when this module imports them.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table

import vramctl
from vramctl import NA, VramctlError, format_bytes
from vramctl.cli import (  # noqa: F401
    _batch,
    _calibrate,
    _dashboard,
    _doctor,
    _jobs,
    _monitor,
    _plan,
    _ray,
    _serve,
    _serveplan,
    _top,
)
from vramctl.cli._common import (
    app,
    check_seconds,
    console,
    emit_json,
    err,
    parse_batches,
    user_errors,
)
from vramctl.cli._render import (
    estimate_table,
    max_batch_lines,
    snapshot,
    status_json,
    status_view,
)
from vramctl.device import Policy

__all__ = ["app"]


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
    if watch is not None:
        check_seconds("--watch", watch, "2")
    elif count is not None:
        raise VramctlError(f"--count {count} counts the readings of --watch: add --watch SECONDS")
    devs = [vramctl.get_device(d) for d in device] if device else vramctl.devices()
    limit = processes

    if watch is None:
        snap = snapshot(devs, limit)
        if as_json:
            emit_json(status_json(snap), indent=True)
        else:
            console.print(status_view(snap))
        return

    readings = 0
    try:
        if as_json:
            while True:
                emit_json(status_json(snapshot(devs, limit)), indent=False)
                readings += 1
                if count is not None and readings >= count:
                    return
                time.sleep(watch)
        if not console.is_terminal:
            # A pipe or a file: a live view would show nothing until the end; print each reading.
            while True:
                console.print(status_view(snapshot(devs, limit), watch))
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
        str | None,
        typer.Option(
            "--policy",
            help="With --select: most-free (the default), least-loaded or best-fit.",
            show_default=False,
        ),
    ] = None,
    target: Annotated[
        float | None,
        typer.Option(
            help="With --select: the highest fraction of a device's memory to fill (default: 0.9).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the devices, or choose one with room for --select SIZE.

    Selection skips devices in the error or disabled state and falls back to the
    CPU, saying why, when no GPU fits or there is none. When the CPU has no room
    either, it prints every device's verdict and exits with status 1.
    """
    if select is None:
        for option, value in (("--policy", policy), ("--target", target)):
            if value is not None:
                raise VramctlError(
                    f"{option} {value} only applies to a choice: add --select SIZE (e.g. 12GiB)"
                )
        devs = vramctl.devices()
        if as_json:
            rows = [{**d.to_dict(), "memory": d.memory().to_dict()} for d in devs]
            emit_json({"schema": "vramctl.devices/1", "devices": rows}, indent=True)
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

    sel = vramctl.rank_devices(
        select,
        policy=Policy.MOST_FREE.value if policy is None else policy,
        target=0.9 if target is None else target,
    )
    if as_json:
        emit_json({"schema": "vramctl.selection/1", **sel.to_dict()}, indent=True)
    elif sel.fits:
        console.print(f"[bold]{sel.device.id}[/]  {sel.device.name}")
        console.print(f"why: {sel.reason}", highlight=False, soft_wrap=True)
    else:
        table = Table(
            title=f"no device has room for {format_bytes(sel.need_bytes)}",
            title_justify="left",
        )
        for col in ("device", "name", "free", "why not"):
            table.add_column(col, justify="right" if col == "free" else "left")
        for v in sel.verdicts:
            table.add_row(v.device.id, v.device.name, format_bytes(v.memory.free), v.reason)
        console.print(table)
    if not sel.fits:
        raise typer.Exit(1)  # nothing can take it: not even the CPU


@app.command()
@user_errors
def catalog(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the GPU catalog used by simulated devices (sim:NAME) and the estimator."""
    specs = vramctl.catalog()
    if as_json:
        emit_json(
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


def _parallel_arg(
    text: str | None, world: int | None, per_node: int | None, plan: str | None
) -> Any:
    """The --parallel options as a Parallel (None without --parallel)."""
    if text is None:
        if world is not None or per_node is not None or plan is not None:
            raise VramctlError("--world-size, --ranks-per-node and --tp-plan need --parallel")
        return None
    from vramctl.estimator import Parallel

    overrides: dict[str, Any] = {}
    if world is not None:
        overrides["world_size"] = world
    if per_node is not None:
        overrides["ranks_per_node"] = per_node
    if plan is not None:
        overrides["plan"] = _json_arg(plan, "--tp-plan")
    return Parallel.parse(text, **overrides)


def _json_arg(text: str, option: str) -> Any:
    import json
    from pathlib import Path

    source = Path(text).read_text() if not text.lstrip().startswith("{") else text
    try:
        value = json.loads(source)
    except (json.JSONDecodeError, OSError) as exc:
        raise VramctlError(f"{option}: not JSON or a JSON file: {exc}") from exc
    if not isinstance(value, dict):
        raise VramctlError(f"{option}: expected a JSON object of module name -> style")
    return value


@app.command("estimate")
@user_errors
def estimate_cmd(
    model: Annotated[
        str,
        typer.Argument(
            help="A built-in model (see --list); a Hugging Face model by its config: a Hub "
            "id (only config.json is fetched, no weights), a folder with a config.json, or "
            "the JSON file; or 'package.module:factory' returning an nn.Module (its batch "
            "then comes from --batch-fn).",
            show_default=False,
        ),
    ] = "",
    mode: Annotated[
        str,
        typer.Option(
            help="train (forward, loss, backward, step), infer (one forward), or generate "
            "(a causal LM's greedy generate: --prompt-len, --max-new-tokens)."
        ),
    ] = "train",
    precision: Annotated[
        str, typer.Option(help="fp32, bf16, fp16, amp-bf16 or amp-fp16.")
    ] = "fp32",
    batch: Annotated[
        str, typer.Option("--batch", "-b", help="Batch sizes to estimate, e.g. 1,8,32.")
    ] = "1",
    seq_len: Annotated[
        int | None,
        typer.Option(
            help="Tokens per sample (text models); past the model's learned position table "
            "an error, past the length its RoPE was trained for a note.",
            min=1,
        ),
    ] = None,
    prompt_len: Annotated[
        int | None,
        typer.Option(
            help="With --mode generate: the prompt's tokens (the same as --seq-len).",
            min=1,
            show_default=False,
        ),
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            help="With --mode generate: the tokens generated after the prompt.",
            min=1,
            show_default=False,
        ),
    ] = None,
    cache: Annotated[
        str,
        typer.Option(
            help="With --mode generate: the KV cache, dynamic (grows by concatenation; "
            "transformers' default), static (allocated whole on the first step), quantized "
            "(optimum-quanto's 4 bits, the last 128 tokens kept unquantized) or offloaded "
            "(each layer kept in host memory but while it is used; a GPU device only)."
        ),
    ] = "dynamic",
    kv_dtype: Annotated[
        str | None,
        typer.Option(
            "--kv-dtype",
            help="With --cache quantized: the cache's width, int4 (the default) or int2. "
            "The other caches keep keys and values in the model's dtype (an engine's fp8 "
            "cache: see `vramctl serve-plan --kv-dtype`).",
            show_default=False,
        ),
    ] = None,
    seconds: Annotated[
        float | None, typer.Option(help="Audio seconds per sample (speech models).", min=0.03)
    ] = None,
    image_size: Annotated[
        int | None,
        typer.Option(
            help="Image side in pixels (image models; a model by its config is built for it).",
            min=1,
        ),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(
            help="The head of a model by its config: causal-lm, seq2seq-lm, speech-seq2seq, "
            "ctc, masked-lm, image-classification, audio-classification, seq-classification, "
            "token-classification or base. Default: the config's architectures.",
            show_default=False,
        ),
    ] = None,
    trust_remote_code: Annotated[
        bool,
        typer.Option(
            "--trust-remote-code",
            help="Let a Hub model with its own code (auto_map) run that code to build.",
        ),
    ] = False,
    device: Annotated[
        str | None,
        typer.Option(
            help="A catalog GPU (see 'vramctl catalog'), a size like 24GiB, cpu, or a local "
            "GPU. Default: this machine's first GPU, else the CPU."
        ),
    ] = None,
    optimizer: Annotated[
        str,
        typer.Option(
            help="adamw, adamw-fused, adam, sgd, sgd-momentum, rmsprop, adagrad, adamw-8bit "
            "(bitsandbytes' 8-bit state), paged-adamw, paged-adamw-8bit (state in CUDA "
            "unified memory, shown apart) or none."
        ),
    ] = "adamw",
    checkpointing: Annotated[
        bool, typer.Option(help="Activation checkpointing (transformers models).")
    ] = False,
    offload: Annotated[
        str | None,
        typer.Option(
            help="Training: what the loop keeps in host memory, comma-separated: "
            "'activations' (the tensors saved for backward, as "
            "torch.autograd.graph.save_on_cpu keeps them), 'optimizer' (the optimizer's "
            "state and step, as vramctl.optimize.OffloadedOptimizer runs it).",
            show_default=False,
        ),
    ] = None,
    keep_output: Annotated[
        bool,
        typer.Option(
            "--keep-output/--release-output",
            help="Training: whether the loop holds the model's output until backward is "
            "done (out = model(x); loss = f(out); loss.backward()), or lets go of it first, "
            "as Lightning's and the Hugging Face Trainer's loops do.",
        ),
    ] = True,
    grad_accumulation: Annotated[
        bool,
        typer.Option(
            "--grad-accumulation",
            help="Training: price a micro-batch of gradient accumulation after the first "
            "(the gradients already there through forward and backward).",
        ),
    ] = False,
    side_streams: Annotated[
        bool,
        typer.Option(
            "--side-streams",
            help="The loop takes a CUDA stream of its own (a loader that copies the next "
            "batch on a side stream): PyTorch's pool of streams, outside its allocator, "
            "is added to the context.",
        ),
    ] = False,
    target_utilization: Annotated[
        float, typer.Option(help="Share of the device's memory the step may use.", min=0.01, max=1)
    ] = 0.9,
    batch_fn: Annotated[
        str | None,
        typer.Option(
            help="'package.module:function' taking a batch size and returning the batch "
            "(for models given as a factory)."
        ),
    ] = None,
    max_batch: Annotated[
        bool, typer.Option("--max-batch", help="Also find the largest batch that fits.")
    ] = False,
    max_length: Annotated[
        bool,
        typer.Option("--max-length", help="Also find the longest input that fits at batch 1."),
    ] = False,
    optimistic: Annotated[
        bool,
        typer.Option(
            "--optimistic",
            help="Judge fits and --max-batch at the point estimate, not at the safe end of "
            "the device range (up to 1.5 GiB higher for a GPU without a calibration profile).",
        ),
    ] = False,
    calibration: Annotated[
        str | None,
        typer.Option(
            help="CUDA constants: a profile written by 'vramctl calibrate', or 'off' for the "
            "built-in ones. Default: the profile of this GPU (or one of its compute "
            "capability) if there is one.",
            show_default=False,
        ),
    ] = None,
    alloc_conf: Annotated[
        str | None,
        typer.Option(
            "--alloc-conf",
            help="The PYTORCH_CUDA_ALLOC_CONF the step runs under, as far as the allocator "
            "model follows it: max_split_size_mb:N and expandable_segments:True, e.g. "
            "expandable_segments:True. Default: this environment's PYTORCH_CUDA_ALLOC_CONF "
            "(else PYTORCH_ALLOC_CONF); '' for PyTorch's defaults.",
            show_default=False,
        ),
    ] = None,
    parallel: Annotated[
        str | None,
        typer.Option(
            help="Estimate one rank of a distributed step: STRATEGY[:WORLD][,option...] "
            "with ddp, fsdp, zero1, zero2, zero3 or tp, e.g. fsdp:8, "
            "ddp:4,bucket_cap_mb=50,gradient_as_bucket_view, "
            "fsdp:8,no_reshard_after_forward,param_dtype=bf16, zero3:16,offload. "
            "--batch is then the micro-batch per rank.",
            show_default=False,
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(help="Ranks in all (overrides --parallel's :WORLD).", min=1),
    ] = None,
    ranks_per_node: Annotated[
        int | None,
        typer.Option(help="Ranks per node (host memory per node). Default: all.", min=1),
    ] = None,
    tp_plan: Annotated[
        str | None,
        typer.Option(
            help="With --parallel tp: the plan as JSON (or a JSON file), module name "
            'pattern -> colwise or rowwise, e.g. \'{"mlp.up": "colwise"}\'.',
            show_default=False,
        ),
    ] = None,
    lora: Annotated[
        str | None,
        typer.Option(
            help="Fine-tune with a LoRA adapter built by PEFT, its settings separated by "
            "commas: r, alpha, targets (module names, or all-linear), dropout, dora, "
            "rslora, save (modules trained in full), e.g. r=16,alpha=32,targets=q_proj,v_proj. "
            "Or a saved adapter's folder or adapter_config.json. The base is frozen. "
            "Needs vramctl[finetune].",
            show_default=False,
        ),
    ] = None,
    quant: Annotated[
        str | None,
        typer.Option(
            help="Quantize the linear layers (not the output head, embeddings or norms) "
            "to a format's exact storage: nf4 or fp4 (bitsandbytes 4-bit), int8 "
            "(LLM.int8), gptq, awq, int8-weight-only, int4-weight-only or fp8 (torchao). "
            "With --lora it is QLoRA.",
            show_default=False,
        ),
    ] = None,
    double_quant: Annotated[
        bool,
        typer.Option(
            "--double-quant",
            help="With --quant nf4 or fp4: bitsandbytes' double quantization of the "
            "block scales (4.127 bits a weight instead of 4.5).",
        ),
    ] = False,
    kbit_prep: Annotated[
        bool,
        typer.Option(
            "--kbit-prep",
            help="With --quant: keep every weight not quantized (norms, embeddings, the "
            "output head) in fp32, as PEFT's prepare_model_for_kbit_training does.",
        ),
    ] = False,
    group_size: Annotated[
        int | None,
        typer.Option(
            help="With --quant gptq, awq or int4-weight-only: weights per scale (default 128).",
            show_default=False,
        ),
    ] = None,
    list_models: Annotated[
        bool, typer.Option("--list", help="List the built-in models and exit.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Predict a step's peak GPU memory without a GPU, and whether it fits.

    The step runs on fake tensors (no memory, no compute); the allocator, CUDA
    context and workspaces are modelled for the device. What nvidia-smi shows is
    given as a range: the CUDA context and cuDNN's workspaces vary with the driver
    and CUDA version, by a gigabyte or more unless 'vramctl calibrate' measured
    them on the GPU; fits and --max-batch judge at the range's safe end. Example:

        vramctl estimate gpt2 --precision amp-bf16 --batch 1,8,32 --seq-len 512 \\
            --device A10G-24GB --max-batch
        vramctl estimate Qwen/Qwen2.5-0.5B --batch 4 --seq-len 2048 \\
            --device H100-80GB
        vramctl estimate ./my-model/config.json --task seq-classification
        vramctl estimate llama-1b --parallel fsdp:8 --precision bf16 \\
            --batch 4 --seq-len 2048 --device H100-80GB --max-batch
        vramctl estimate llama-1b --lora r=16,alpha=32,targets=q_proj,v_proj \\
            --precision bf16 --batch 4 --seq-len 1024 --device L4-24GB
        vramctl estimate llama-1b --quant nf4 --double-quant --lora r=16 \\
            --precision bf16 --batch 4 --seq-len 1024 --device L4-24GB
        vramctl estimate llama-1b --mode generate --prompt-len 4096 \\
            --max-new-tokens 512 --precision bf16 --batch 8 --device L4-24GB
    """
    from vramctl.estimator import zoo

    if list_models:
        _list_zoo(zoo, as_json)
        return
    if not model:
        raise VramctlError("give a MODEL (vramctl estimate --list shows the built-in ones)")
    sizes = parse_batches(batch)
    batch_source: Any = None
    if batch_fn is not None:
        from vramctl.estimator._shared import load_model_source

        _, batch_source = load_model_source(batch_fn)
    quant_arg: Any = None
    if quant is not None:
        from vramctl.estimator._shared import quant_spec

        quant_arg = quant_spec(quant, group_size=group_size, double_quant=double_quant)
    elif double_quant or group_size is not None or kbit_prep:
        raise VramctlError("--double-quant, --group-size and --kbit-prep go with --quant")
    offloads = _offload_arg(offload)
    if mode != "train" and (offloads or not keep_output or grad_accumulation):
        raise VramctlError(
            "--offload, --release-output and --grad-accumulation go with --mode train"
        )
    step = vramctl.Step(
        mode=mode,
        precision=precision,
        optimizer=None if optimizer == "none" else optimizer,
        device=device,
        checkpointing=checkpointing,
        offload_activations="activations" in offloads,
        offload_optimizer="optimizer" in offloads,
        keep_output=keep_output,
        grad_accumulation=grad_accumulation,
        side_streams=side_streams,
        target_utilization=target_utilization,
        calibration=_calibration_arg(calibration),
        safe=not optimistic,
        task=task,
        image_size=image_size,
        trust_remote_code=trust_remote_code,
        allocator_config=_alloc_conf_arg(alloc_conf),
        parallel=_parallel_arg(parallel, world_size, ranks_per_node, tp_plan),
        adapter=lora,
        quant=quant_arg,
        kbit_prep=kbit_prep,
        max_new_tokens=max_new_tokens,
        cache=cache,
        kv_dtype=kv_dtype,
    )
    if mode != "generate" and (
        max_new_tokens is not None
        or cache != "dynamic"
        or prompt_len is not None
        or kv_dtype is not None
    ):
        raise VramctlError(
            "--prompt-len, --max-new-tokens, --cache and --kv-dtype go with --mode generate"
        )
    if prompt_len is not None:
        if seq_len is not None and seq_len != prompt_len:
            raise VramctlError("--prompt-len is --seq-len under another name: give one")
        seq_len = prompt_len
    results = []
    with err.status("tracing", spinner="dots") as spin:
        for b in sizes:
            spin.update(f"tracing {model} at batch {b}")
            results.append(
                vramctl.estimate(
                    model, batch_source, batch_size=b, seq_len=seq_len, seconds=seconds, step=step
                )
            )
        best = None
        if max_batch or max_length:
            spin.update(f"searching the largest batch for {model}")
            best = vramctl.max_batch_size(
                model,
                batch_source,
                lengths=max_length,
                seq_len=seq_len,
                seconds=seconds,
                step=step,
            )
    first = results[0]
    if as_json:
        from vramctl.estimator import Parallel

        emit_json(
            {
                "schema": "vramctl.estimate/1",
                "inputs": {
                    "model": model,
                    "batch_fn": batch_fn,
                    "batch_sizes": sizes,
                    "mode": first.mode,
                    "precision": first.precision,
                    "optimizer": first.optimizer,
                    "seq_len": first.seq_len,
                    "seconds": first.seconds,
                    "image_size": image_size,
                    "task": task,
                    "trust_remote_code": trust_remote_code,
                    "checkpointing": first.checkpointing,
                    "offload": sorted(offloads),
                    "keep_output": keep_output,
                    "grad_accumulation": grad_accumulation,
                    "side_streams": side_streams,
                    "device": first.device,
                    "capacity_bytes": first.capacity,
                    "target_utilization": first.target_utilization,
                    "calibration": first.calibration,
                    "calibrated": first.calibrated,
                    "safe": first.safe,
                    # the allocator priced: max_split_size (bytes) and expandable segments
                    "allocator": {
                        "max_split_size": getattr(step.allocator_config, "max_split_size", None),
                        "expandable_segments": bool(
                            getattr(step.allocator_config, "expandable_segments", False)
                        ),
                    },
                    "max_batch": max_batch,
                    "max_length": max_length,
                    "parallel": (
                        step.parallel.to_dict() if isinstance(step.parallel, Parallel) else None
                    ),
                    "lora": lora,
                    "adapter": first.adapter,
                    "quant": quant,
                    "double_quant": double_quant,
                    "kbit_prep": kbit_prep,
                    "group_size": group_size,
                    "quantization": first.quant,
                    "max_new_tokens": max_new_tokens,
                    "cache": cache if mode == "generate" else None,
                    "kv_dtype": kv_dtype,
                },
                "estimates": [e.to_dict() for e in results],
                "max_batch": None if best is None else best.to_dict(),
            },
            indent=True,
        )
        return
    console.print(estimate_table(results))
    last = results[-1]
    console.print(f"device: {first.device} ({format_bytes(first.capacity)})", highlight=False)
    console.print(f"parameters: {first.parameters:,}", highlight=False)
    if first.adapter:
        console.print(f"adapter: {first.adapter}", highlight=False)
    if first.quant:
        console.print(f"quantized: {first.quant}", highlight=False)
    if first.paged_optimizer:
        console.print(
            f"paged optimizer state: {format_bytes(first.paged_optimizer)} in unified memory, "
            "not in the peaks above",
            highlight=False,
        )
    if last.parallel:
        console.print(
            f"per rank: {last.parallel}; --batch is each rank's micro-batch", highlight=False
        )
    console.print(
        f"breakdown at batch {last.batch_size} (peak at {last.peak_op} in "
        f"{last.peak_module or 'the step'}, {last.peak_phase}):",
        highlight=False,
    )
    for k, v in last.breakdown.items():
        if v:
            console.print(f"  {k:<12} {format_bytes(v):>12}", highlight=False)
    if last.step_seconds is not None:
        console.print(
            f"step time at batch {last.batch_size}: {last.step_seconds:.4g} s predicted "
            f"({last.flops / 1e9:,.1f} GFLOP; {last.throughput})",
            highlight=False,
            soft_wrap=True,
        )
    for a in last.assumptions:
        console.print(f"[yellow]assumed:[/] {a}", highlight=False, soft_wrap=True)
    for n in last.notes:
        console.print(f"note: {n}", highlight=False, soft_wrap=True)
    if best is not None:
        if max_batch:
            what = "micro-batch per rank" if last.parallel else "batch"
            for line in max_batch_lines(best, batch_fn, what):
                console.print(line, highlight=False, soft_wrap=True)
        if best.max_length is not None:
            ceiling = ""
            if best.length_at_ceiling:
                from vramctl.estimator._shared import LENGTH_BOUND

                bound = LENGTH_BOUND.get(best.length_arg or "", math.inf)
                ceiling = (
                    " (the search's bound: longer may fit too)"
                    if best.max_length >= bound
                    else " (the model's limit)"
                )
            console.print(
                f"longest {best.length_arg} at batch 1: [bold]{best.max_length}[/]{ceiling}",
                highlight=False,
            )


def _offload_arg(text: str | None) -> set[str]:
    """``--offload``: the parts the loop keeps in host memory."""
    parts = {p.strip() for p in (text or "").split(",") if p.strip()}
    unknown = sorted(parts - {"activations", "optimizer"})
    if unknown:
        raise VramctlError(
            f"--offload {text!r}: {unknown[0]!r} is not one of activations, optimizer "
            "(comma-separated)"
        )
    return parts


def _alloc_conf_arg(text: str | None) -> Any:
    """``--alloc-conf``: the allocator configuration the estimate prices (None: this
    environment's; a value PyTorch would refuse is an error)."""
    from vramctl.estimator import AllocatorConfig

    if text is None:
        return AllocatorConfig.from_env()
    if not text.strip():
        return None
    from vramctl.doctor._shared import parse_alloc_conf

    errors = [why for level, why in parse_alloc_conf(text)[1] if level == "error"]
    if errors:
        raise VramctlError(f"--alloc-conf {text!r}: {errors[0]}")
    return AllocatorConfig.from_conf(text)


def _calibration_arg(text: str | None) -> Any:
    if text is None or text.strip().lower() == "auto":
        return None
    if text.strip().lower() in ("off", "none", "builtin", "built-in"):
        return False
    from vramctl.estimator import load_calibration

    # Read the profile now: a missing or broken file is an error for every --device,
    # not only for the GPU targets that use the constants.
    return load_calibration(text)


def _list_zoo(zoo: Any, as_json: bool) -> None:
    models = [zoo.get(n) for n in zoo.names()]
    if as_json:
        emit_json(
            {
                "schema": "vramctl.zoo/1",
                "models": [
                    {"name": m.name, "description": m.description, "inputs": m.inputs}
                    for m in models
                ],
            },
            indent=True,
        )
        return
    table = Table(title="built-in models (random weights, no download)", title_justify="left")
    for col in ("name", "inputs", "description"):
        table.add_column(col)
    for m in models:
        table.add_row(m.name, m.inputs, m.description)
    console.print(table)
