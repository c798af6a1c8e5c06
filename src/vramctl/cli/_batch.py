"""``vramctl process`` and ``vramctl demo``: runs over audio manifests, with a live progress bar."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from vramctl import VramctlError, format_bytes
from vramctl.cli._common import (
    app,
    check_can_write,
    console,
    emit_json,
    err,
    library_log_to,
    user_errors,
)

if TYPE_CHECKING:
    from vramctl.batching import RunConflictError

__all__ = ["demo_cmd", "process_cmd", "progress_bar"]


def _stats_text(status: Any) -> str:
    mem = " ".join(f"{100 * used / total:.0f}%" for _, used, total in status.memory if total)
    return (
        f"{status.items_per_s:.1f} it/s {status.audio_hours_per_hour:.0f} audio h/h "
        f"pad {100 * status.padding:.1f}% OOM {status.ooms} mem {mem}"
    )


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[Any], None]]:
    """A rich progress bar fed by :class:`vramctl.batching.ProcessStatus` snapshots."""
    if not enabled:
        yield lambda status: None
        return
    bar = Progress(
        SpinnerColumn(),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
        console=err,
        transient=False,
    )
    task = bar.add_task("process", total=None, stats="")

    def update(status: Any) -> None:
        finished = status.done + status.failed + status.skipped
        bar.update(task, completed=finished, total=status.total, stats=_stats_text(status))

    bar.start()
    failed = False
    try:
        yield update
    except Exception:
        failed = True
        raise
    finally:
        if failed:
            # An error (bad input found by the library, a failed run) is then the last line
            # to read, not under a progress bar frozen at 0/?: take the bar off the screen.
            bar.live.transient = True
            bar.live.stop()
        else:
            bar.stop()


@contextlib.contextmanager
def _quiet_library_log() -> Iterator[None]:
    """Send the library's warnings through rich's console (not through the progress bar)."""
    from rich.logging import RichHandler

    with library_log_to(RichHandler(console=err, show_time=False, show_path=False)):
        yield


def _load_model(spec: str) -> Any:
    """The demo's own models by name (random weights, said so); anything else as given."""
    from vramctl.cli._demo import MODELS, build_model

    if spec in MODELS:
        from vramctl.batching import ModelSource

        return ModelSource(spec, lambda: build_model(spec), kind="zoo", random_weights=True)
    return spec


def _budget(text: str | None) -> Any:
    from vramctl.batching import PaddedDuration

    if text is None:
        return None
    number = text[:-1] if text.endswith("s") else text
    try:
        seconds = float(number)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise VramctlError(
            f"--budget {text!r}: give a positive number of seconds of padded audio per batch, "
            "like 600s"
        )
    return PaddedDuration(seconds)


def _check_process_options(target: float, chunk: float, overlap: float) -> None:
    if not (math.isfinite(target) and 0 < target <= 1):
        raise VramctlError(
            f"--target {target:g}: give the share of free memory for a batch as a fraction "
            "in (0, 1], e.g. --target 0.9"
        )
    if not (math.isfinite(chunk) and chunk > 0):
        raise VramctlError(f"--chunk {chunk:g}: give a positive number of seconds, e.g. --chunk 30")
    if not (math.isfinite(overlap) and 0 <= overlap < chunk / 2):
        raise VramctlError(
            f"--overlap {overlap:g}: give 0 or more seconds, less than half of --chunk "
            f"({chunk:g} s), e.g. --overlap 1"
        )


@contextlib.contextmanager
def _devices(names: list[str] | None) -> Iterator[list[Any] | None]:
    """The devices named; a simulated one ('sim:SIZE') counts the steps run on it.

    The run counts each simulated device's steps in the thread that runs them; entering
    several here (nested, in this thread) would count this thread's work on all of them.
    """
    from vramctl.device import get_device

    yield [get_device(n) for n in names] if names else None


@app.command("process")
@user_errors
def process_cmd(
    model: Annotated[
        str,
        typer.Argument(
            help="A checkpoint: a folder saved with save_pretrained, or a Hub id like "
            "facebook/wav2vec2-base-960h. Also 'package.module:factory' (an nn.Module taking "
            "waveforms [B, T]) or wav2vec2-base, hubert-base, wav2vec2-mini (random weights).",
            show_default=False,
        ),
    ],
    manifest: Annotated[
        str,
        typer.Argument(
            help="A folder of audio files, or a JSON Lines, CSV or Lhotse manifest "
            "(id, path, duration or num_samples).",
            show_default=False,
        ),
    ],
    output: Annotated[
        str,
        typer.Argument(
            help="Where the outputs go (JSON Lines); failures go to OUT.failed.jsonl.",
            show_default=False,
        ),
    ],
    output_kind: Annotated[
        str | None,
        typer.Option(
            "--output-kind",
            help="text (a CTC checkpoint's transcript), frames, embedding or summary. "
            "Default: text where the model has a tokenizer, else summary.",
            show_default=False,
        ),
    ] = None,
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device",
            "-d",
            help="A device to use (repeat for several; 'sim:16GiB' simulates one). "
            "Default: every usable GPU, least loaded first, else the CPU.",
            show_default=False,
        ),
    ] = None,
    max_devices: Annotated[
        int | None, typer.Option(help="Use at most this many GPUs.", min=1, show_default=False)
    ] = None,
    target: Annotated[
        float, typer.Option(help="Share of the smallest device's free memory for a batch.")
    ] = 0.9,
    budget: Annotated[
        str | None,
        typer.Option(
            help="Padded seconds of audio per batch (like 600s) instead of the memory budget "
            "the estimator predicts for the model.",
            show_default=False,
        ),
    ] = None,
    chunk: Annotated[
        float, typer.Option(help="Recordings longer than this (s) are processed in chunks.")
    ] = 30.0,
    overlap: Annotated[float, typer.Option(help="Seconds of overlap between chunks.")] = 1.0,
    buckets: Annotated[int, typer.Option(help="Duration buckets.", min=1)] = 50,
    workers: Annotated[
        int | None,
        typer.Option(help="Audio loading threads (default: up to 4).", min=0, show_default=False),
    ] = None,
    order: Annotated[str, typer.Option(help="Output order: manifest or id.")] = "manifest",
    loader: Annotated[
        str, typer.Option(help="audio (read the files) or synthetic (noise of each length).")
    ] = "audio",
    sample_rate: Annotated[
        int | None,
        typer.Option(
            help="Sample rate the model takes (default: the checkpoint's, else 16000).",
            min=1,
            show_default=False,
        ),
    ] = None,
    progress_db: Annotated[
        str | None,
        typer.Option(
            "--progress",
            help="The progress store (default: OUT.progress.db).",
            show_default=False,
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue the run saved in the progress store (the default), if it was made "
            "by the same manifest, model and settings.",
        ),
    ] = False,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Refuse to run if the progress store holds a run.")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Discard the run saved in the progress store, if any."),
    ] = False,
    allow_failures: Annotated[
        bool,
        typer.Option(
            "--allow-failures", help="Exit 0 even when some recordings failed (else exit 1)."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Transcribe (or embed) every recording of a folder or manifest, durably.

    Long recordings are chunked and stitched back before decoding; recordings are
    batched by duration, each bucket's batch size predicted by the estimator for the
    model and device; every step runs under the guard (a batch that runs out of memory
    finishes in pieces; one item that fits nowhere runs on the CPU). Each batch is
    committed to a progress store: an interrupted run (Ctrl-C, SIGTERM, a kill) started
    again with the same command resumes, losing and repeating nothing; a different
    model or setting on the same output is refused. A record that repeats an earlier id
    is skipped (the first is kept); a truncated audio file fails its recording; audio of
    another length than the manifest's duration is processed as read and warned of. Example:

        vramctl process ./wav2vec2-base-960h recordings/ transcripts.jsonl

    Exit status: 0 when every recording was processed; 1 when some failed (listed in
    OUT.failed.jsonl; --allow-failures makes it 0); 2 for bad input; 130 when
    interrupted.
    """
    from vramctl.batching import OUTPUT_KINDS, ProcessInterrupted, RunConflictError, process

    _check_process_options(target, chunk, overlap)
    if sum((resume, fresh, overwrite)) > 1:
        raise VramctlError("--resume, --fresh and --overwrite exclude each other: give one")
    if output_kind is not None and output_kind not in OUTPUT_KINDS:
        raise VramctlError(
            f"--output-kind {output_kind!r}: give {', '.join(OUTPUT_KINDS[:-1])} or"
            f" {OUTPUT_KINDS[-1]}"
        )
    source = _load_model(model)
    bar = progress_bar(not quiet and not as_json)
    try:
        with _devices(device) as devs, _quiet_library_log(), _sigterm_interrupts(), bar as update:
            result = process(
                source,
                manifest,
                output,
                devices=devs,
                max_devices=max_devices,
                budget=_budget(budget),
                target=target,
                chunk_duration=chunk,
                overlap=overlap,
                num_buckets=buckets,
                sample_rate=sample_rate,
                loader=loader,  # type: ignore[arg-type]
                num_workers=workers,
                order=order,  # type: ignore[arg-type]
                postprocess=output_kind,
                progress=progress_db,
                resume=not fresh and not overwrite,
                overwrite=overwrite,
                on_progress=update,
            )
    except RunConflictError as exc:
        raise VramctlError(_conflict_message(exc)) from None
    except ProcessInterrupted as exc:
        of = f" of {exc.total}" if exc.total is not None else ""
        err.print(
            f"[yellow]interrupted:[/] saved {exc.saved}{of} recordings in {exc.progress};"
            " run the same command to resume",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    _report_process(result, as_json, allow_failures)


def _conflict_message(exc: RunConflictError) -> str:
    """A refused resume, in the command line's own words (its flags, not Python's)."""
    held = f"{exc.done} done, {exc.failed} failed"
    if not exc.differences:
        return (
            f"progress store {exc.path} already holds a run ({held}) and --fresh was given:"
            " resume it (leave --fresh out), discard it (--overwrite) or give another OUT"
        )
    return (
        f"progress store {exc.path} was made by a different run ({held}):"
        f" {'; '.join(exc.differences)}. Run with --overwrite to discard it and start over,"
        " give another OUT, or use the model and settings it was made with to resume it"
    )


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a scheduler's stop) ends the run as Ctrl-C does: committed work kept, said."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _print_warnings(result: Any) -> None:
    """The run's warnings, counted (the library logged the first of them as they came)."""
    parts = []
    if result.duplicate_ids:
        parts.append(
            f"{result.duplicate_ids} manifest records repeat an earlier id and were skipped"
            " (the first of each was processed)"
        )
    if result.length_mismatches:
        parts.append(
            f"{result.length_mismatches} recordings hold audio of another length than the"
            " manifest's duration"
        )
    if parts:
        err.print(
            f"[yellow]warning:[/] {'; '.join(parts)}; the first are named above",
            highlight=False,
            soft_wrap=True,
        )


def _report_process(result: Any, as_json: bool, allow_failures: bool) -> None:
    """Print the run's result; exit 1 when something was not processed (unless allowed)."""
    failed = result.store_failed + result.lost + result.manifest_problems
    if as_json:
        emit_json({"schema": "vramctl.process/1", **result.to_dict()}, indent=True)
    else:
        console.print(
            f"[bold]{result.done}[/] recordings done, {result.failed} failed, "
            f"{result.skipped} done before; lost {result.lost}",
            highlight=False,
            soft_wrap=True,
        )
        console.print(
            f"{result.items_per_s:.1f} items/s, {result.audio_hours_per_hour:.1f} h of audio per "
            f"hour, padding {100 * result.padding:.1f}%, {result.ooms} OOMs recovered, "
            f"{result.cpu_fallbacks} batches on the CPU",
            highlight=False,
            soft_wrap=True,
        )
        console.print(
            f"outputs: {result.output}\nfailures: {result.failed_path}",
            highlight=False,
            soft_wrap=True,
        )
    _print_warnings(result)
    if failed:
        parts = []
        if result.store_failed:
            parts.append(f"{result.store_failed} recordings failed (see {result.failed_path})")
        if result.manifest_problems:
            parts.append(f"{result.manifest_problems} bad manifest records were skipped")
        if result.lost:
            parts.append(f"{result.lost} recordings were lost")
        status = "" if allow_failures else "; exit 1 (--allow-failures makes it 0)"
        err.print(
            f"[yellow]not all processed:[/] {', '.join(parts)}{status}",
            highlight=False,
            soft_wrap=True,
        )
        if not allow_failures:
            raise typer.Exit(1)


@app.command("demo")
@user_errors
def demo_cmd(
    clips: Annotated[int, typer.Option(help="How many clips to process.", min=1)] = 300,
    model: Annotated[
        str | None,
        typer.Option(
            help="wav2vec2-base (95M; the default on a GPU) or wav2vec2-mini (4 layers of 256;"
            " the default on a CPU)."
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="A GPU, cpu, or sim:SIZE for a simulated GPU. Default: the first usable GPU, "
            "else a simulated 256 MiB GPU on the CPU."
        ),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(help="Keep the manifest, outputs and progress store in this folder."),
    ] = None,
    squeeze: Annotated[
        bool, typer.Option(help="Take memory away part way, as another job would.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Estimate, fit and process LibriSpeech-length clips with a wav2vec 2.0 model.

    The model is built from its transformers config with random weights; the clip
    lengths come from a sample of LibriSpeech train-clean-100 shipped with vramctl and the
    waveforms are synthesized. Part way, a ballast takes half of the device's memory (the
    squeeze) and is given back later: the guard recovers every batch that no longer fits.
    Takes about a minute on a CPU with the defaults.
    """
    from vramctl.cli._demo import MODELS, demo

    if model is not None and model not in MODELS:
        raise VramctlError(f"--model {model!r}: the demo runs {' or '.join(MODELS)}")
    if output is not None:
        check_can_write("--output", output, folder=True)

    def stage(text: str) -> None:
        if not as_json:
            err.print(f"[cyan]•[/] {text}", highlight=False)

    with _quiet_library_log(), progress_bar(not as_json) as update:
        report = demo(
            clips,
            model=model,
            device=device,
            output=output,
            squeeze=squeeze,
            on_stage=stage,
            on_progress=update,
        )
    doc = report.to_dict()
    if output is None:
        doc["output"] = None  # a temporary folder, removed
    if as_json:
        emit_json({"schema": "vramctl.demo/1", **doc}, indent=True)
        return
    _print_demo(doc)


def _print_demo(doc: dict[str, Any]) -> None:
    cap = doc["capacity_bytes"]
    kind = "simulated GPU" if doc["simulated"] else "device"
    console.print(
        f"[bold]{doc['model']}[/] ({doc['parameters'] / 1e6:.1f}M parameters) on "
        f"{doc['device']} ({kind}, {format_bytes(cap)})",
        highlight=False,
    )
    sizes = Table(title="estimated batch size per bucket (no step run)", title_justify="left")
    for length in doc["batch_sizes"]:
        sizes.add_column(f"≤ {length}", justify="right")
    sizes.add_row(*(str(n) for n in doc["batch_sizes"].values()))
    console.print(sizes)
    fit = Table(title="fit: one real step per bucket", title_justify="left")
    for col in (
        "longest",
        "batch",
        "predicted peak",
        "measured peak",
        "difference",
        "of capacity",
    ):
        fit.add_column(col, justify="right")
    for f in doc["fit"]:
        over = f["predicted_bytes"] / f["measured_bytes"] - 1 if f["measured_bytes"] else None
        fit.add_row(
            f"{f['seconds']:g} s",
            str(f["count"]),
            format_bytes(f["predicted_bytes"]),
            format_bytes(f["measured_bytes"]),
            "N/A" if over is None else f"{over:+.0%}",
            f"{f['measured_bytes'] / cap:.0%}",
        )
    console.print(fit)
    if doc.get("fit_note"):
        console.print(f"[dim]predicted vs measured: {doc['fit_note']}.[/]", highlight=False)
    report = Table(title="processing", title_justify="left", show_header=False)
    report.add_column("what")
    report.add_column("value", justify="right")
    rows = [
        ("clips", f"{doc['clips']} ({doc['audio_seconds'] / 3600:.2f} h of audio)"),
        ("throughput", f"{doc['clips_per_s']:.1f} clips/s, {doc['audio_hours_per_hour']:.0f} h/h"),
        (
            "peak memory",
            f"{format_bytes(doc['peak_bytes'])} of {format_bytes(cap)}"
            f" ({doc['peak_of_capacity']:.0%})",
        ),
        ("squeeze", format_bytes(doc["squeeze_bytes"]) if doc["squeeze_bytes"] else "off"),
        ("OOMs recovered", f"{doc['ooms_recovered']} of {doc['ooms']}"),
        ("padding", f"{doc['padding_pct']:.1f}% ({doc['batches']} batches)"),
        ("done / failed", f"{doc['done']} / {doc['failed']}"),
        ("lost", f"[bold green]{doc['lost']}[/]" if doc["lost"] == 0 else f"[red]{doc['lost']}[/]"),
    ]
    for what, value in rows:
        report.add_row(what, value)
    console.print(report)
    for note in doc["notes"]:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if doc["output"]:
        console.print(f"outputs: {doc['output']}", highlight=False)
