"""How close are vramctl's estimates to the memory a real step uses?

Runs the built-in model zoo x {train, infer} x {fp32, amp-bf16} x batch sizes.
For every row it makes an estimate and measures the truth:

- CPU (always): the step runs for real on CPU under PyTorch's profiler; the
  truth is the live bytes before the step (parameters, buffers, optimizer
  state, inputs, summed from the real tensors) plus the peak of the profiler's
  memory timeline (its CREATE and DESTROY events) during the step. It is
  compared with the estimate's logical peak for a CPU target. Rows too large
  for this machine's memory are estimated (coverage) but not measured.
  The two are not independent on a CPU: for a CPU target the estimator itself
  runs each distinct convolution, LSTM layer and CPU scaled-dot-product
  attention kernel call of the step for real (on zero-filled tensors, under the
  same profiler memory events) to read the scratch those kernels take, and
  adds what it measured. For models built of those kernels the CPU error
  partly checks that measurement against itself, so CPU accuracy is not
  evidence for a CUDA target, where those kernels' workspaces come from the
  estimator's CUDA model and constants instead (``--cuda`` measures that).
- CUDA (``--cuda``, on a machine with a GPU): the step runs on the GPU after a
  warm-up step; the truth is ``torch.cuda.max_memory_allocated`` and
  ``max_memory_reserved`` and NVML's figure for this process, compared with the
  predicted allocated, reserved and device peaks for that GPU. Rows predicted
  not to fit the GPU are estimated but not run. Each row is estimated twice:
  with the GPU's calibration profile (``--calibrate`` measures one first, in a
  fresh process, as ``vramctl calibrate`` does; ``--calibration PATH`` names
  one) and with the built-in CUDA constants, so the error before and after
  calibration comes from the same measured steps.

Beside each row it prints Accelerate's ``estimate-memory`` figure for the same
model (weights only; for training the largest of model, gradients, optimizer
and step, as the ``accelerate estimate-memory`` command reports).

- Recorded truth (``--truth DIR``, no GPU needed): every case of a CUDA truth corpus
  (``benchmarks/cuda_truth.py capture``; ``benchmarks/data/cuda_truth/``) is estimated for
  the corpus' GPU and compared with its warm step's recorded allocated and reserved peaks
  and NVML reading. The calibration is the corpus' own ``calibration.json`` where it has
  one, else the built-in constants with the CUDA context the corpus measured. A capture
  runs every case in one process, and CUDA unloads nothing: a case's NVML reading carries
  the kernel modules and streams earlier cases loaded. The device peak is compared with the
  estimate's plus what the process held outside the allocator beyond the estimate's context
  when the case began (:func:`contexts_before`); ``device_fresh`` gives it without, as a
  fresh process would be estimated, and the profile's device evidence is written from
  that. Cases whose
  model cannot be built here (torchvision or timm not installed) are listed with the
  reason, never dropped in silence; a damaged index fails with a line naming it.

The last line is one JSON object with the summary figures.

    python benchmarks/estimate_accuracy.py --truth benchmarks/data/cuda_truth/DIR [--quick]
    python benchmarks/estimate_accuracy.py --quick
    python benchmarks/estimate_accuracy.py            # the whole zoo
    python benchmarks/estimate_accuracy.py --cuda     # on a GPU machine
    python benchmarks/estimate_accuracy.py --cuda --calibrate   # calibrate first, compare
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from vramctl import VramctlError, format_bytes
from vramctl.estimator import Calibration, calibrate, estimate, load_calibration, zoo
from vramctl.estimator._spec import StepSpec, prepare_model, run_step, warm_optimizer

import _common
from _common import error_stats as stats

#: (model, length keyword, length) for the rows; lengths kept small so real CPU runs are quick.
ZOO = [
    ("gpt2", "seq_len", 128),
    ("bert-base", "seq_len", 128),
    ("t5-small", "seq_len", 128),
    ("llama-1b", "seq_len", 128),
    ("llama-7b", "seq_len", 128),
    ("whisper-base", "seq_len", 64),
    ("wav2vec2-base", "seconds", 2.0),
    ("hubert-base", "seconds", 2.0),
    ("vit-base", None, None),
    ("resnet-50", None, None),
    ("convnext-tiny", None, None),
    ("lstm", "seq_len", 128),
]
QUICK = {"gpt2", "wav2vec2-base", "lstm"}
#: In --quick on the CPU only these rows run for real (a profiled real step of GPT-2 takes
#: ~15 s here); on a GPU every quick row runs.
QUICK_MEASURED = {"lstm"}
MODES = ("train", "infer")
PRECISIONS = ("fp32", "amp-bf16")
BATCHES = (1, 2, 4)
QUICK_BATCHES = (1, 4)


@dataclass
class Row:
    model: str
    mode: str
    precision: str
    batch: int
    predicted: int | None = None
    measured: int | None = None
    accelerate: int | None = None
    seconds: float | None = None
    assumptions: int = 0
    error: str | None = None
    predicted_reserved: int | None = None
    measured_reserved: int | None = None
    measured_device: int | None = None
    predicted_device: int | None = None
    #: The same row estimated with the built-in CUDA constants (when a calibration is used).
    builtin_allocated: int | None = None
    builtin_reserved: int | None = None
    builtin_device: int | None = None

    @property
    def error_pct(self) -> float | None:
        if self.predicted is None or not self.measured:
            return None
        return 100.0 * (self.predicted - self.measured) / self.measured


def length_kwargs(key: str | None, value: float | None) -> dict[str, Any]:
    return {} if key is None else {key: value}


def accelerate_figure(name: str, mode: str, precision: str) -> int | None:
    """Accelerate's estimate-memory figure for the same model (built empty, no download)."""
    try:
        from accelerate import init_empty_weights
        from accelerate.commands.estimate import calculate_maximum_sizes, estimate_training_usage
    except ImportError:
        return None
    with init_empty_weights():
        model = zoo.build(name)
    total, _largest = calculate_maximum_sizes(model)
    if mode == "infer":
        return int(total)
    dtype = "float32" if precision == "fp32" else "bfloat16"
    return int(max(estimate_training_usage(total, dtype).values()))


def real_setup(
    name: str, mode: str, precision: str, batch: int, lk: dict[str, Any], device: str
) -> tuple[Any, Any, StepSpec, Any]:
    torch.manual_seed(0)
    spec = StepSpec(
        mode=mode,
        precision=precision,
        autocast_device=device,
        foreach=True if device == "cuda" else None,
    )
    if device == "cuda":
        with torch.device(device):  # built on the GPU: fast even for billions of weights
            model = zoo.build(name)
    else:
        model = zoo.build(name)
    if getattr(getattr(model, "config", None), "layerdrop", 0.0):
        # The estimate describes the step that drops no layer (its worst case, listed in
        # its assumptions); a real step would drop a random few.
        model.config.layerdrop = 0.0
    if spec.param_dtype is not None:
        model.to(spec.param_dtype)
    prepare_model(model, spec)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = spec.make_optimizer(params)
    if opt is not None:
        warm_optimizer(opt, params)
    data = zoo.make_batch(name, batch, labels=mode == "train", **lk)
    for k, v in data.items():
        if v.is_floating_point():
            v = v.normal_().to(spec.param_dtype or v.dtype)
        data[k] = v.to(device)
    return model, data, spec, opt


def measure_cpu(name: str, mode: str, precision: str, batch: int, lk: dict[str, Any]) -> int:
    model, data, spec, opt = real_setup(name, mode, precision, batch, lk, "cpu")
    peak = _common.cpu_step_peak(model, data, spec, opt)
    del model, data, opt
    gc.collect()
    return peak


def measure_cuda(
    name: str, mode: str, precision: str, batch: int, lk: dict[str, Any]
) -> tuple[int, int, int | None]:
    model, data, spec, opt = real_setup(name, mode, precision, batch, lk, "cuda")
    run_step(model, data, spec, opt)  # warm-up: cuBLAS handles, cuDNN plans
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run_step(model, data, spec, opt)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    device = None
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid():
                device = int(p.usedGpuMemory)
    except Exception:
        device = None
    del model, data, opt
    gc.collect()
    torch.cuda.empty_cache()
    return allocated, reserved, device


def pick_calibration(args: argparse.Namespace) -> Calibration | None:
    if args.calibrate:
        cal = calibrate(0)
        print(f"# calibrated: {cal.describe()}; saved to {cal.path}", flush=True)
        return cal
    if args.calibration in (None, "auto"):
        from vramctl.estimator import find_calibration

        return find_calibration(torch.cuda.get_device_name(0), None)
    if args.calibration == "off":
        return None
    return load_calibration(args.calibration)


def main() -> int:
    ap = _common.parser(
        __doc__, quick="a subset that runs in under 60 s", cuda="measure on this machine's GPU"
    )
    ap.add_argument("--models", help="comma-separated model names (default: the zoo)")
    ap.add_argument("--no-real", action="store_true", help="estimate only (coverage check)")
    ap.add_argument(
        "--batches", help="comma-separated batch sizes (default 1,2,4; 1,4 with --quick)"
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="with --cuda: measure the GPU's CUDA constants first (as `vramctl calibrate`)",
    )
    ap.add_argument(
        "--calibration",
        help=(
            "with --cuda: a calibration profile, 'off', or 'auto' (the GPU's saved profile); "
            "with --truth: a profile of the corpus' GPU, or 'off' (default: the corpus' own)"
        ),
    )
    ap.add_argument(
        "--truth",
        metavar="DIR",
        help="estimate a CUDA truth corpus' cases against its recorded peaks (no GPU needed)",
    )
    ap.add_argument(
        "--write-evidence",
        action="store_true",
        help="with --truth: write the device peak's largest shortfall (in percent of the "
        "estimate) over the corpus' steps into its calibration.json, so that estimates with "
        "that profile take their range from this evidence instead of a fixed allowance",
    )
    ap.add_argument(
        "--rows",
        metavar="FILE",
        help="with --truth: write each case's (predicted, measured) bytes, warm and cold, to "
        "FILE as JSON Lines, to find the rows behind a figure",
    )
    args = _common.parse(ap)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(max(1, psutil.cpu_count(logical=False) or 1))
    if args.truth:
        return truth_main(args)

    chosen = ZOO
    if args.models:
        wanted = set(args.models.split(","))
        chosen = [z for z in ZOO if z[0] in wanted]
    elif args.quick:
        chosen = [z for z in ZOO if z[0] in QUICK]
    batches = QUICK_BATCHES if args.quick else BATCHES
    if args.batches:
        try:
            batches = tuple(int(b) for b in args.batches.split(","))
        except ValueError:
            print(f"--batches: expected sizes like 1,4, got {args.batches!r}", file=sys.stderr)
            return 2
    cuda = bool(args.cuda)
    device = "cuda:0" if cuda else "cpu"
    host_budget = psutil.virtual_memory().available * 0.5
    cal = pick_calibration(args) if cuda else None
    gpu_room = torch.cuda.get_device_properties(0).total_memory * 0.95 if cuda else 0.0

    rows: list[Row] = []
    started = time.perf_counter()
    print(
        f"{'model':<14}{'mode':<6}{'precision':<10}{'batch':>5}{'predicted':>13}"
        f"{'measured':>13}{'error':>9}{'accelerate':>13}{'est s':>7}"
    )
    for name, lkey, lval in chosen:
        lk = length_kwargs(lkey, lval)
        for mode in MODES:
            for precision in PRECISIONS:
                acc = accelerate_figure(name, mode, precision)
                for b in batches:
                    row = Row(name, mode, precision, b, accelerate=acc)
                    rows.append(row)
                    try:
                        est = estimate(
                            name,
                            batch_size=b,
                            mode=mode,
                            precision=precision,
                            device=device,
                            calibration=cal if cal is not None else False,
                            **lk,
                        )
                        if cal is not None:
                            builtin = estimate(
                                name,
                                batch_size=b,
                                mode=mode,
                                precision=precision,
                                device=device,
                                calibration=False,
                                **lk,
                            )
                            row.builtin_allocated = builtin.peak_allocated
                            row.builtin_reserved = builtin.peak_reserved
                            row.builtin_device = builtin.peak_device
                    except Exception as exc:
                        row.error = f"{type(exc).__name__}: {exc}"[:300]
                        print(f"{name:<14}{mode:<6}{precision:<10}{b:>5}  FAILED {row.error}")
                        continue
                    row.seconds = est.elapsed
                    row.assumptions = len(est.assumptions)
                    if cuda:
                        row.predicted = est.peak_allocated
                        row.predicted_reserved = est.peak_reserved
                        row.predicted_device = est.peak_device
                    else:
                        row.predicted = est.logical_peak
                    measure = not args.no_real and est.logical_peak < host_budget
                    if cuda:
                        measure = not args.no_real and est.peak_device < gpu_room
                    if args.quick and not cuda and name not in QUICK_MEASURED:
                        measure = False
                    if measure:
                        try:
                            if cuda:
                                a, r, d = measure_cuda(name, mode, precision, b, lk)
                                row.measured, row.measured_reserved, row.measured_device = a, r, d
                            else:
                                row.measured = measure_cpu(name, mode, precision, b, lk)
                        except Exception as exc:
                            row.error = f"measure: {type(exc).__name__}: {exc}"[:300]
                    err = row.error_pct
                    print(
                        f"{name:<14}{mode:<6}{precision:<10}{b:>5}"
                        f"{format_bytes(row.predicted or 0):>13}"
                        f"{format_bytes(row.measured) if row.measured else 'not run':>13}"
                        f"{'' if err is None else f'{err:+.2f}%':>9}"
                        f"{format_bytes(acc) if acc else '-':>13}{est.elapsed:>7.2f}",
                        flush=True,
                    )
    errors = [r.error_pct for r in rows if r.error_pct is not None]
    reserved_errors = [
        100.0 * (r.predicted_reserved - r.measured_reserved) / r.measured_reserved
        for r in rows
        if r.predicted_reserved and r.measured_reserved
    ]
    acc_errors = [
        100.0 * (r.accelerate - r.measured) / r.measured
        for r in rows
        if r.accelerate and r.measured
    ]
    times = [r.seconds for r in rows if r.seconds is not None]
    cuda_figures: dict[str, Any] = {}
    if cuda:
        cuda_figures = {
            "gpu": torch.cuda.get_device_name(0),
            "driver": _common.driver_version(),
            "cuda": torch.version.cuda,
            "calibration": cal.describe() if cal is not None else None,
            "calibrated" if cal is not None else "builtin": {
                "allocated": stats([(r.predicted, r.measured) for r in rows]),
                "reserved": stats([(r.predicted_reserved, r.measured_reserved) for r in rows]),
                "device": stats([(r.predicted_device, r.measured_device) for r in rows]),
            },
            "not_run_too_large": sum(
                1
                for r in rows
                if r.predicted_device is not None and r.predicted_device >= gpu_room and not r.error
            ),
        }
        if cal is not None:
            cuda_figures["builtin"] = {
                "allocated": stats([(r.builtin_allocated, r.measured) for r in rows]),
                "reserved": stats([(r.builtin_reserved, r.measured_reserved) for r in rows]),
                "device": stats([(r.builtin_device, r.measured_device) for r in rows]),
            }
    summary = {
        "benchmark": "estimate_accuracy",
        "side": "cuda" if cuda else "cpu",
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "quick": args.quick,
        "rows": len(rows),
        "measured_rows": len(errors),
        "failed_rows": sum(1 for r in rows if r.predicted is None),
        "rows_with_assumptions": sum(1 for r in rows if r.assumptions),
        "median_error_pct": round(statistics.median(abs(e) for e in errors), 3) if errors else None,
        "max_error_pct": round(max(abs(e) for e in errors), 3) if errors else None,
        "worst_underestimate_pct": round(max([0.0] + [-e for e in errors]), 3) if errors else None,
        "reserved_median_error_pct": (
            round(statistics.median(abs(e) for e in reserved_errors), 3)
            if reserved_errors
            else None
        ),
        "accelerate_median_error_pct": (
            round(statistics.median(abs(e) for e in acc_errors), 3) if acc_errors else None
        ),
        "seconds_per_estimate": round(statistics.mean(times), 3) if times else None,
        "max_seconds_per_estimate": round(max(times), 3) if times else None,
        "wall_s": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
        **cuda_figures,
    }
    for r in rows:
        if r.error:
            print(f"# {r.model} {r.mode} {r.precision} {r.batch}: {r.error}", file=sys.stderr)
    return _common.finish(summary, summary["failed_rows"] == 0)


# -- against a recorded CUDA truth corpus ------------------------------------------------

#: --truth --quick: the cases of these models, at most this many.
TRUTH_QUICK_MODELS = ("gpt2", "lstm", "wav2vec2-base")
TRUTH_QUICK_CASES = 24


def _held_bytes(step: dict[str, Any], cal: Calibration) -> int:
    """Bytes a recorded step's process held from earlier cases beyond what the step makes
    itself: ``held_cublas_workspaces`` cuBLAS workspaces of the profile's size (a summary
    corpus whose harness ran every case in one process says so per step; 0 for any
    other)."""
    return int(step.get("held_cublas_workspaces") or 0) * cal.cublas_split()[0]


def _cold_layout(root: Any, case: dict[str, Any]) -> list[list[Any]] | None:
    """The segments a case's recorded cold step began with, where the corpus traced it."""
    from _truth import corpus

    if not case.get("file"):
        return None
    try:
        cold = corpus.load_traces(root, case).get("cold")
    except corpus.CorpusError:
        return None
    return cold.get("segments_before") if cold else None


def contexts_before(index: dict[str, Any]) -> dict[str, int]:
    """What the capture's process held outside the caching allocator when each case began,
    by case id: the context and the kernel modules and streams earlier cases loaded.

    A capture runs every case in one process, and CUDA unloads nothing, so NVML's reading
    of a later case carries what earlier cases left. The cold step records it
    (``context_before``, captures from 2026-11-29 on); for older corpora it is the last
    earlier case's reading after its warm step (``context_bytes``: NVML's figure less the
    reserved bytes), read before the capture emptied the cache for the next case. The
    first case, and cases of a corpus that measured no context, get none."""
    out: dict[str, int] = {}
    last: int | None = None
    for case in index.get("cases") or []:
        steps = case.get("steps") or {}
        before = (steps.get("cold") or {}).get("context_before", last)
        if isinstance(before, int) and before > 0:
            out[case["id"]] = before
        for step in ("cold", "warm"):
            got = (steps.get(step) or {}).get("context_bytes")
            if isinstance(got, int) and got > 0:
                last = max(last or 0, got)
    return out


def _gpu_seconds(root: Any, case: dict[str, Any]) -> float | None:
    """The warm step's operators' CUDA times summed (None for a case kept without its
    trace, or one recorded untimed)."""
    from _truth import corpus

    if not case.get("file"):
        return None
    try:
        warm = corpus.load_traces(root, case).get("warm") or {}
    except corpus.CorpusError:
        return None
    times = [t for _, t in warm.get("calls") or [] if t is not None]
    return sum(times) / 1e6 if times else None


def time_stats(pairs: list[tuple[float | None, float | None]]) -> dict[str, Any]:
    """Step-time errors: mean and median absolute percent error, the largest, and the
    median ratio of predicted to measured."""
    errs = [100.0 * (p - m) / m for p, m in pairs if p is not None and m]
    if not errs:
        return {"rows": 0, "mape_pct": None, "median_pct": None, "max_pct": None}
    ratios = [p / m for p, m in pairs if p is not None and m]
    return {
        "rows": len(errs),
        "mape_pct": round(statistics.fmean(abs(e) for e in errs), 1),
        "median_pct": round(statistics.median(abs(e) for e in errs), 1),
        "max_pct": round(max(abs(e) for e in errs), 1),
        "median_ratio": round(statistics.median(ratios), 3),
    }


def truth_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _truth import corpus
    from _truth.cases import case_allocator, estimate_case, recorded_per_call
    from _truth.diff import predicted_trace
    from _truth.replay import first_step_from

    try:
        index = corpus.load_index(args.truth)
    except corpus.CorpusError as exc:
        print(f"--truth: {exc}", file=sys.stderr)
        return 2
    env = index["environment"]
    if index["source"] == "simulated":
        print(
            f"--truth: {args.truth} was recorded on a simulated GPU: it holds no GPU truth",
            file=sys.stderr,
        )
        return 2
    if args.calibration not in (None, "auto"):
        # another profile of the corpus' GPU (a later calibration), or the built-in constants
        if args.write_evidence:
            print(
                "--truth: --write-evidence writes into the corpus' own profile; drop --calibration",
                file=sys.stderr,
            )
            return 2
        try:
            cal, cal_from = truth_calibration(args.calibration, index)
        except (OSError, ValueError, VramctlError) as exc:
            print(f"--calibration: {exc}", file=sys.stderr)
            return 2
    else:
        cal, cal_from = corpus.calibration(args.truth, index)
    device = env.get("gpu")
    cases = [c for c in index["cases"] if c.get("status", "ok") == "ok"]
    if args.quick:
        cases = [c for c in cases if c["spec"].get("model") in TRUTH_QUICK_MODELS]
        cases = cases[:TRUTH_QUICK_CASES]
    # Peaks of a plain warm step where the capture took them (from 2026-11-29 on); else the
    # recorded step's, estimated as that step ran (gradient sums out of place).
    plain = bool(cases) and all(
        "plain_max_allocated" in ((c.get("steps") or {}).get("warm") or {}) for c in cases
    )
    recorded = recorded_per_call(index) and not plain
    peak_key = "plain_max_allocated" if plain else "max_allocated"
    reserved_key = "plain_max_reserved" if plain else "max_reserved"
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    not_estimated: dict[str, str] = {}
    print(f"# {args.truth}: {index['source']} corpus of {device}; calibration: {cal_from}")
    print(
        "# peaks: "
        + ("a plain warm step's" if plain else "the recorded warm step's")
        + ("; estimated with gradient sums out of place, as recorded" if recorded else "")
    )
    print(
        f"{'case':<52}{'predicted':>13}{'measured':>13}{'error':>9}{'reserved':>10}"
        f"{'device':>9}{'time':>8}"
    )
    before_case = contexts_before(index)
    cold_from_layout = 0
    for case in cases:
        spec = case["spec"]
        warm = (case.get("steps") or {}).get("warm") or {}
        cold = (case.get("steps") or {}).get("cold") or {}
        try:
            est = estimate_case(spec, device, calibration=cal, recorded=recorded)
        except Exception as exc:
            not_estimated[case["id"]] = f"{type(exc).__name__}: {exc}".split("\n")[0][:200]
            print(f"{case['id']:<52}  not estimated: {not_estimated[case['id']]}")
            continue
        first_allocated = est.first_step_peak_allocated or est.peak_allocated
        # what the capture's process held from earlier cases, beyond the step's own
        held = _held_bytes(warm, cal)
        held_cold = _held_bytes(cold, cal)
        # the first step's reserved peak: begun from the segments the recorded cold step
        # began with, where the corpus holds them, else from a fresh process's
        # and the warm step's: the loop's, begun from the same segments with that first
        # step (a fresh process's loop where they were not traced)
        began = _cold_layout(args.truth, case)
        if began is not None:
            trace = predicted_trace(spec, device, calibration=cal)
            reserved_cold = first_step_from(trace, began, case_allocator(spec))
            reserved_warm = first_step_from(trace, began, case_allocator(spec), loop=True)
            cold_from_layout += 1
        else:
            reserved_cold = (est.first_step_peak_reserved or est.peak_reserved) + held_cold
            reserved_warm = est.peak_reserved + held
        # and outside the allocator: the kernels and streams earlier cases left loaded,
        # beyond the context the estimate gives the step itself
        context = est.breakdown.get("context", 0)
        held_ctx = max(0, (before_case.get(case["id"]) or 0) - context)
        row = {
            "case": case["id"],
            "allocated": (est.peak_allocated + held, warm.get(peak_key)),
            "reserved": (reserved_warm, warm.get(reserved_key)),
            "device": (reserved_warm + context + held_ctx, warm.get("nvml_bytes")),
            # the device peak of a fresh process: no context held from earlier cases
            "device_fresh": (est.peak_device + held, warm.get("nvml_bytes")),
            "device_high": est.peak_device_high + held,
            "held_context": held_ctx,
            # the cold step: the first in a fresh allocator cache (and fresh cuBLAS
            # workspaces), always the recorded one; its allocated peak against the
            # estimate's first step (the cuBLAS workspaces made at their first use)
            "allocated_cold": (first_allocated + held_cold, cold.get("max_allocated")),
            "reserved_cold": (reserved_cold, cold.get("max_reserved")),
            # what the recorded cold step began with, against the segments a fresh
            # process makes the state in (the estimate's first step begins from those)
            "reserved_before_cold": (est.state_reserved, cold.get("reserved_before")),
            # NVML's reading after the cold step: its reserved peak and the context
            "device_cold": (reserved_cold + context + held_ctx, cold.get("nvml_bytes")),
            "device_fresh_cold": (reserved_cold + context, cold.get("nvml_bytes")),
            # the warm step's time: its operators' CUDA times summed (traced cases), and
            # its wall time; both under the capture's per-call recording
            "gpu_time": (est.step_seconds, _gpu_seconds(args.truth, case)),
            "wall_time": (est.step_seconds, warm.get("wall_s")),
            # and the warm step timed with nothing recorded (captures from 2026-11-29 on)
            "step_time": (est.step_seconds, warm.get("step_s")),
        }
        rows.append(row)
        p, m = row["allocated"]
        rp, rm = row["reserved"]
        err = f"{100.0 * (p - m) / m:+.2f}%" if m else "-"
        rerr = f"{100.0 * (rp - rm) / rm:+.1f}%" if rm else "-"
        dp, dm = row["device"]
        derr = f"{100.0 * (dp - dm) / dm:+.1f}%" if dm else "-"
        tp, tm = row["gpu_time"]
        terr = f"{100.0 * (tp - tm) / tm:+.0f}%" if tp is not None and tm else "-"
        print(
            f"{case['id']:<52}{format_bytes(p):>13}"
            f"{format_bytes(m) if m else 'not rec.':>13}{err:>9}{rerr:>10}{derr:>9}{terr:>8}",
            flush=True,
        )
    here = {"torch": torch.__version__, "transformers": _common.version("transformers")}
    differences = {
        k: {"corpus": env.get(k), "here": v}
        for k, v in here.items()
        if env.get(k) and v and str(env.get(k)) != str(v)
    }
    for k, d in differences.items():
        print(f"# {k} differs: the corpus was recorded with {d['corpus']}, this is {d['here']}")
    summary = {
        "benchmark": "estimate_accuracy",
        "side": "truth",
        "corpus": str(args.truth),
        "source": index["source"],
        "gpu": device,
        "quick": args.quick,
        "calibration": cal_from,
        "peaks_from": "a plain warm step" if plain else "the recorded warm step",
        "gradient_sums_out_of_place": recorded,
        "cases": len(cases),
        "estimated": len(rows),
        "not_estimated": not_estimated,
        "allocated": stats([r["allocated"] for r in rows]),
        "reserved": stats([r["reserved"] for r in rows]),
        "device": stats([r["device"] for r in rows]),
        "cold": {m: stats([r[f"{m}_cold"] for r in rows]) for m in TRUTH_GOALS},
        # cold rows whose reserved peak was replayed from the segments the step began with
        "cold_reserved_from_layout": cold_from_layout,
        # the device peak as a fresh process would read it, the context earlier cases left
        # in the capture's process counted against the estimate
        "device_fresh": {
            "warm": stats([r["device_fresh"] for r in rows]),
            "cold": stats([r["device_fresh_cold"] for r in rows]),
        },
        "step_time": time_stats([r["step_time"] for r in rows]),
        "step_time_gpu": time_stats([r["gpu_time"] for r in rows]),
        "step_time_wall": time_stats([r["wall_time"] for r in rows]),
        "step_time_goal_mape_pct": 15.0,
        "version_differences": differences,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    summary["device_range"] = device_range(rows)
    if args.rows:
        with open(args.rows, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    if args.write_evidence:
        summary["evidence_written"] = write_evidence(args.truth, cal_from, rows, summary)
    summary["goals"] = truth_goals(summary)
    summary["goals_met"] = all(
        g["met"] for step in summary["goals"].values() for g in step.values()
    )
    return _common.finish(summary, not not_estimated or len(rows) > 0)


def device_range(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How the estimates' device ranges (point estimate to ``peak_device_high``) cover the
    measured device peaks, and the largest shortfall of the point estimate: as read, with
    the context earlier cases left in the process (``device_fresh``), which a user's
    process that ran other work first may also hold."""
    pairs = [(r["device_fresh"][0], r["device_fresh"][1], r["device_high"]) for r in rows]
    pairs = [(p, m, hi) for p, m, hi in pairs if m]
    if not pairs:
        return {"rows": 0}
    return {
        "rows": len(pairs),
        "covered": sum(1 for p, m, hi in pairs if m <= hi),
        "largest_shortfall_bytes": max(0, max(m - p for p, m, _ in pairs)),
        "largest_shortfall_pct": round(max(0.0, max(100.0 * (m - p) / p for p, m, _ in pairs)), 3),
        "allowance_bytes": {
            "min": min(hi - p for p, _, hi in pairs),
            "max": max(hi - p for p, _, hi in pairs),
        },
    }


def truth_calibration(given: str, index: dict[str, Any]) -> tuple[Calibration, str]:
    """The profile ``--calibration`` names for a corpus (``off``: the built-in constants of
    its GPU), and how the summary names it."""
    from _truth import corpus

    if given == "off":
        return corpus.builtin_calibration(index), "built-in constants (--calibration off)"
    return load_calibration(given), f"the profile {given} (--calibration)"


def write_evidence(
    root: Any, cal_from: str, rows: list[dict[str, Any]], summary: dict[str, Any]
) -> str:
    """Put the device peak's evidence (:class:`~vramctl.estimator.DeviceEvidence`) into the
    corpus' own profile; what was written, or why nothing was."""
    import datetime as dt
    import json
    from pathlib import Path

    from vramctl.estimator._calibration import DeviceEvidence

    path = Path(root) / "calibration.json"
    got = summary["device_range"]
    if not path.is_file() or "calibration.json" not in cal_from:
        return "nothing: the corpus has no calibration.json to carry it"
    if not got.get("rows"):
        return "nothing: no step of the corpus has a device peak"
    evidence = DeviceEvidence(
        source=f"{Path(root).name}, warm steps",
        steps=got["rows"],
        shortfall_pct=got["largest_shortfall_pct"],
        shortfall=got["largest_shortfall_bytes"],
        median_pct=summary["device_fresh"]["warm"]["median_pct"] or 0.0,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )
    doc = json.loads(path.read_text())
    doc["evidence"] = {"device_peak": evidence.to_dict()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return (
        f"{path}: shortfall up to {evidence.shortfall_pct}% "
        f"({format_bytes(evidence.shortfall)}) over {evidence.steps} steps"
    )


#: The CUDA-accuracy goals per metric: (median, max, worst under-estimate) in %, None where
#: none is set; cold and warm steps are held to the same.
TRUTH_GOALS: dict[str, tuple[float, float, float | None]] = {
    "allocated": (2.0, 5.0, 3.0),
    "reserved": (3.0, 8.0, 5.0),
    "device": (3.0, 8.0, None),
}


def truth_goals(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each metric of the warm and the cold step against :data:`TRUTH_GOALS`."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for step in ("warm", "cold"):
        out[step] = {}
        for metric, (median, largest, under) in TRUTH_GOALS.items():
            got = summary[metric] if step == "warm" else summary["cold"][metric]
            if not got.get("rows"):
                out[step][metric] = {"met": False, "why": "no rows"}
                continue
            misses = []
            if got["median_pct"] > median:
                misses.append(f"median {got['median_pct']} > {median}")
            if got["max_pct"] > largest:
                misses.append(f"max {got['max_pct']} > {largest}")
            if under is not None and got["worst_under_pct"] > under:
                misses.append(f"worst under {got['worst_under_pct']} > {under}")
            out[step][metric] = {"met": not misses, "missed": misses}
    return out


if __name__ == "__main__":
    sys.exit(main())
