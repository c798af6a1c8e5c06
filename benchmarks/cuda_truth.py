"""CUDA truth that outlives the GPU: record what a real GPU's allocator does, and check against it.

    python benchmarks/cuda_truth.py capture --out DIR [--budget 240]   # on a GPU machine
    python benchmarks/cuda_truth.py capture --out DIR --simulate --quick
    python benchmarks/cuda_truth.py check DIR          # the allocator model on each trace
    python benchmarks/cuda_truth.py diff DIR CASE      # the estimator's stream against it
    python benchmarks/cuda_truth.py workspaces DIR [--write] [--into DIR2]  # cuDNN workspaces
    python benchmarks/cuda_truth.py cases              # the cases a capture runs, in order

``capture`` runs each case (benchmarks/_truth/cases.py: the zoo, RNNs, the SDPA backends,
fp16 with a scaler, checkpointing, expandable segments, a second stream, a Llama's
``generate`` with the dynamic, static and offloaded caches, transformers classes,
torchvision and timm CNNs) on the machine's GPU, a cold and a warm step each, and
writes the corpus (benchmarks/data/cuda_truth/README.md says what is in it). Cases that a
committed corpus already holds traces of for the same GPU model run last, so that a GPU's
few minutes record what no corpus has yet (``--keep-order`` runs them in order). It stops
cleanly at ``--budget`` seconds and keeps every case it finished; the index is rewritten
after each case. Without a usable GPU it says so in one line and exits with status 2;
``--simulate`` records the same cases on the CPU through the allocator model instead (the
same format, to test the tools; its figures are the model's).

``check`` replays every traced case's real request stream through
``CachingAllocatorModel`` and compares the segments it makes and its reserved peak with the
recorded ones: single-stream steps must match; the others are reported. ``--quick`` checks
the first 10 traced cases. A damaged file, an unknown format version or a truncated trace
fails the check with a line that names it.

``diff`` sets the estimator's predicted request stream for one case against the recorded
one: the first divergence and the bytes each operator allocates in each; ``--at-peak`` also
what was live at each side's own peak, by operator. The estimate is of the step as it was
recorded: under the recorder's dispatch mode, where autograd sums gradients out of place.

``workspaces`` reads the cuDNN workspace each recorded convolution call held and pairs it
with the estimator's key for that call (its shapes and arguments, ``conv_key``); with
``--write`` the table goes into the corpus' calibration.json (``constants.cudnn_workspaces``),
where estimates with that profile take a recorded call's workspace in place of the
calibrated line (the upper envelope over all convolutions measured); ``--into DIR`` also
into another corpus' profile, where that corpus was recorded on the same GPU with the same
driver, torch, CUDA and cuDNN (a capture whose traces did not come back).

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from _truth import corpus

import _common

QUICK_SIMULATED = (
    "rnn/lstm/train/fp32/b1",
    "rnn/gru/infer/fp32/b16",
    "zoo/lstm/train/fp32/b1",
    "zoo/lstm/infer/fp32/b4",
)


def _usable_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def environment(cuda: bool) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _common.version("transformers"),
        "allocator_settings": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        or os.environ.get("PYTORCH_ALLOC_CONF"),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            capability=f"{props.major}.{props.minor}",
            total_bytes=int(props.total_memory),
            driver=_common.driver_version(),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            cudnn_benchmark=torch.backends.cudnn.benchmark,
        )
    else:
        env.update(gpu="simulated", device=platform.processor() or platform.machine())
    return env


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


# -- capture -------------------------------------------------------------------------------


def capture(args: argparse.Namespace) -> int:
    from _truth.cases import all_cases

    cuda = not args.simulate
    if cuda and not _usable_gpu():
        print(
            "capture: no usable CUDA device on this machine (--simulate records on the CPU)",
            file=sys.stderr,
        )
        return 2
    import torch

    torch.manual_seed(0)
    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"capture: cannot create {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    cases = all_cases(cuda=cuda)
    if args.only:
        wanted = [p.strip() for p in args.only.split(",") if p.strip()]
        ids = {c["id"] for c in cases}
        # A whole case id names that case alone; anything else matches as a substring.
        cases = [
            c for c in cases if any(p == c["id"] or (p not in ids and p in c["id"]) for p in wanted)
        ]
    elif args.quick and not cuda:
        cases = [c for c in cases if c["id"] in QUICK_SIMULATED]
    env = environment(cuda)
    if cuda and not args.keep_order:
        traced = traced_before(env.get("gpu"), args.corpora)
        cases, moved = untraced_first(cases, traced)
        if moved:
            print(
                f"capture: {moved} of the cases were traced on this GPU model before "
                f"(in {args.corpora}): they run last (--keep-order runs them in order)",
                flush=True,
            )
    if args.limit:
        cases = cases[: args.limit]
    index = corpus.new_index(
        "cuda" if cuda else "simulated",
        env,
        captured=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        budget_s=args.budget,
        # each step's figures are read around the step recorded call by call
        recorded_per_call=True,
    )
    started = time.perf_counter()
    durations: list[float] = []
    not_reached = 0
    for n, spec in enumerate(cases):
        elapsed = time.perf_counter() - started
        longest = max(durations, default=min(5.0, args.budget / 4))
        if elapsed + 1.5 * longest > args.budget:
            not_reached = len(cases) - n
            index["stopped"] = f"the budget of {args.budget:g} s"
            break
        if sum(c.get("bytes", 0) for c in index["cases"]) > args.max_mib * 2**20:
            not_reached = len(cases) - n
            index["stopped"] = f"the corpus reached {args.max_mib} MiB"
            break
        t0 = time.perf_counter()
        entry = _capture_case(out, spec, cuda)
        durations.append(time.perf_counter() - t0)
        index["cases"].append(entry)
        index["wall_s"] = round(time.perf_counter() - started, 1)
        index["not_reached"] = len(cases) - n - 1
        corpus.save_index(out, index)
        status = entry["status"]
        cold = (entry.get("steps") or {}).get("cold") or {}
        print(
            f"{spec['id']:<58} {status:<6} {durations[-1]:6.2f} s"
            + (f"  reserved {cold.get('max_reserved')}" if status == "ok" else "")
            + (f"  {entry.get('error', '')[:120]}" if status != "ok" else ""),
            flush=True,
        )
    index["not_reached"] = not_reached
    corpus.save_index(out, index)
    ok = [c for c in index["cases"] if c["status"] == "ok"]
    summary = {
        "benchmark": "cuda_truth",
        "command": "capture",
        "source": index["source"],
        "gpu": env.get("gpu"),
        "cases": len(index["cases"]),
        "ok": len(ok),
        "errors": len(index["cases"]) - len(ok),
        "not_reached": not_reached,
        "stopped_by": index.get("stopped"),
        "corpus_bytes": sum(c.get("bytes", 0) for c in index["cases"]),
        "wall_s": round(time.perf_counter() - started, 1),
        "out": str(out),
    }
    return _common.finish(summary, bool(ok) or not cases)


def traced_before(gpu: str | None, root: Path) -> set[str]:
    """Ids of the cases that a committed corpus under ``root`` holds traces of, recorded on
    a GPU of this name."""
    out: set[str] = set()
    if not gpu or not root.is_dir():
        return out
    for folder in sorted(p for p in root.iterdir() if (p / "index.json").is_file()):
        try:
            index = corpus.load_index(folder)
        except corpus.CorpusError:
            continue
        if index.get("source") == "cuda" and index["environment"].get("gpu") == gpu:
            out.update(c["id"] for c in index["cases"] if c.get("file"))
    return out


def untraced_first(
    cases: list[dict[str, Any]], traced: set[str]
) -> tuple[list[dict[str, Any]], int]:
    """The cases with those not traced before first, each group in its own order, and how
    many went last: a GPU's few minutes go to what no corpus holds yet."""
    fresh = [c for c in cases if c["id"] not in traced]
    return fresh + [c for c in cases if c["id"] in traced], len(cases) - len(fresh)


def _capture_case(out: Path, spec: dict[str, Any], cuda: bool) -> dict[str, Any]:
    import torch
    from _truth import record

    entry: dict[str, Any] = {"id": spec["id"], "spec": spec, "status": "ok"}
    try:
        if cuda:
            traces, figures = _capture_cuda(spec)
        else:
            traces, figures = record.record_simulated(spec)
        entry["steps"] = figures
        entry.update(corpus.write_trace_file(out, spec["id"], traces))
    except Exception as exc:  # one case's failure is recorded; the capture goes on
        entry["status"] = "oom" if isinstance(exc, torch.OutOfMemoryError) else "error"
        entry["error"] = f"{type(exc).__name__}: {exc}".split("\n")[0][:300]
        # Where it failed: the GPU machine is gone when the corpus is read.
        frames = traceback.extract_tb(exc.__traceback__)[-12:]
        entry["where"] = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]
        _common.free_failed(exc)
    finally:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return entry


def _capture_cuda(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch
    from _truth import record
    from _truth.cases import options_applied

    device = "cuda:0"
    gc.collect()
    torch.cuda.empty_cache()
    # What the process held outside the allocator before this case: the context and the
    # kernels earlier cases loaded (one process runs every case, so NVML's reading of a
    # later case carries what earlier ones left; this is the part of it that is theirs).
    nvml = record.nvml_process_bytes(0)
    context_before = None if nvml is None else nvml - torch.cuda.memory_reserved(0)
    with options_applied(spec, device):
        built, step = record.prepare(spec, device)
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        cold, cold_fig = record.record_cuda_step(step, 0, timed=False)
        cold_fig["context_before"] = context_before
        warm, warm_fig = record.record_cuda_step(step, 0, timed=True)
        warm_fig.update(record.plain_step_peaks(step, 0))
        warm_fig["step_s"] = record.clean_step_seconds(step, 0)
        del built, step
    return {"cold": cold, "warm": warm}, {"cold": cold_fig, "warm": warm_fig}


# -- check -----------------------------------------------------------------------------------


def check(args: argparse.Namespace) -> int:
    from _truth.cases import case_allocator
    from _truth.replay import replay

    try:
        index = corpus.load_index(args.corpus)
    except corpus.CorpusError as exc:
        print(f"check: {exc}", file=sys.stderr)
        return 2
    traced = [c for c in index["cases"] if c.get("file") and c.get("status", "ok") == "ok"]
    if args.quick:
        traced = traced[:10]
    rows: list[dict[str, Any]] = []
    damaged: list[str] = []
    for case in traced:
        try:
            steps = corpus.load_traces(args.corpus, case)
        except corpus.CorpusError as exc:
            damaged.append(str(exc))
            print(f"DAMAGED {exc}", flush=True)
            continue
        config = case_allocator(case.get("spec") or {})
        for step, trace in steps.items():
            r = replay(trace, config)
            row = {"case": case["id"], "step": step, **r.to_dict()}
            rows.append(row)
            verdict = {True: "match", False: "DIFFERS", None: "report"}[r.match]
            print(
                f"{case['id']:<58} {step:<5} {verdict:<8} segments real {len(r.real_segments)}"
                f" model {len(r.model_segments)}; reserved peak real {r.real_peak_reserved}"
                f" model {r.model_peak_reserved}"
                + (f"; {r.first_difference}" if r.first_difference else ""),
                flush=True,
            )
    judged = [r for r in rows if r["match"] is not None]
    differs = [f"{r['case']} {r['step']}" for r in rows if r["match"] is False]
    summary = {
        "benchmark": "cuda_truth",
        "command": "check",
        "corpus": str(args.corpus),
        "source": index["source"],
        "gpu": index["environment"].get("gpu"),
        "cases": len(index["cases"]),
        "traced_cases": len(traced),
        "summary_only_cases": sum(
            1 for c in index["cases"] if not c.get("file") and c.get("status", "ok") == "ok"
        ),
        "failed_cases": sum(1 for c in index["cases"] if c.get("status", "ok") != "ok"),
        "steps_replayed": len(rows),
        "single_stream_steps": len(judged),
        "matched": sum(1 for r in judged if r["match"]),
        "differs": differs[:20],
        "reported_not_judged": len(rows) - len(judged),
        "damaged": damaged,
    }
    return _common.finish(summary, not damaged and not differs)


# -- workspaces ------------------------------------------------------------------------------


def workspaces(args: argparse.Namespace) -> int:
    import json

    from _truth import workspaces as ws
    from _truth.diff import predicted_trace

    from vramctl.estimator._conv_workspace import probe_table, unbiased, workspace_lines

    try:
        index = corpus.load_index(args.corpus)
    except corpus.CorpusError as exc:
        print(f"workspaces: {exc}", file=sys.stderr)
        return 2
    gpu = index["environment"].get("gpu")
    table: dict[str, int] = {}
    paired, skipped = 0, {}
    for case in index["cases"]:
        if not case.get("file") or (args.only and args.only not in case["id"]):
            continue
        steps = corpus.load_traces(args.corpus, case)
        calls = {name: ws.recorded(trace) for name, trace in steps.items()}
        if not any(calls.values()):
            continue
        try:
            keys = predicted_trace(case["spec"], gpu).workspace_keys
        except Exception as exc:  # a case the estimator cannot trace is reported, not fatal
            skipped[case["id"]] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        for name, recorded in calls.items():
            got = ws.pair(keys, recorded)
            if isinstance(got, str):
                skipped[f"{case['id']} ({name})"] = got
                continue
            paired += 1
            for key, n in got.items():
                table[key] = max(table.get(key, 0), n)
    for what, why in skipped.items():
        print(f"  skipped {what}: {why}")
    print(
        f"{len(table)} convolution calls from {paired} recorded steps on {gpu}; "
        f"{sum(1 for n in table.values() if n == 0)} ran without a workspace, the largest "
        f"held {max(table.values(), default=0) / 2**20:.1f} MiB"
    )
    # the calls the profile's calibration measured, where no recorded step ran them
    source = Path(args.corpus) / "calibration.json"
    if source.is_file():
        doc = json.loads(source.read_text())
        probed = probe_table(doc.get("measurements", {}).get("cudnn") or [])
        ran = {unbiased(k) for k in table}
        added = {k: n for k, n in probed.items() if unbiased(k) not in ran}
        table = {**added, **table}
        print(f"and {len(added)} calls the corpus' calibration measured that no recorded step ran")
    lines = workspace_lines(table)
    for kind, (fixed, per_act, per_weight) in lines.items():
        print(
            f"  {kind:<28} {fixed / 2**20:6.2f} MiB + {per_act:.3f} x activation "
            f"+ {per_weight:.3f} x weight"
        )
    summary: dict[str, Any] = {
        "benchmark": "cuda_truth",
        "command": "workspaces",
        "corpus": str(args.corpus),
        "gpu": gpu,
        "steps_paired": paired,
        "keys": len(table),
        "lines": {k: list(v) for k, v in lines.items()},
        "skipped": skipped,
    }
    for target in ([args.corpus] if args.write else []) + list(args.into or []):
        path = Path(target) / "calibration.json"
        if not path.is_file():
            print(f"workspaces: {target} has no calibration.json to carry the table")
            return 2
        if Path(target) != Path(args.corpus):
            differs = _software_differs(index, corpus.load_index(target))
            if differs:
                print(f"workspaces: {target} was recorded with other {differs}", file=sys.stderr)
                return 2
        doc = json.loads(path.read_text())
        consts = doc.setdefault("constants", {})
        consts["cudnn_workspaces"] = dict(sorted(table.items()))
        consts["cudnn_workspace_lines"] = {k: list(v) for k, v in lines.items()}
        path.write_text(json.dumps(doc, indent=2) + "\n")
        summary.setdefault("written", []).append(str(path))
        print(f"written to {path}")
    return _common.finish(summary, True)


#: What a convolution's cuDNN workspace depends on besides the call: the GPU and the
#: software that picks the algorithm.
_WORKSPACE_SOFTWARE = ("gpu", "capability", "driver", "torch", "cuda", "cudnn", "cudnn_benchmark")


def _software_differs(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The environment fields (GPU and software) two corpora were recorded with that
    differ, comma-separated; empty where they match."""
    ea, eb = a["environment"], b["environment"]
    return ", ".join(k for k in _WORKSPACE_SOFTWARE if ea.get(k) != eb.get(k))


# -- diff ------------------------------------------------------------------------------------


def diff_case(args: argparse.Namespace) -> int:
    from _truth.diff import (
        allocations,
        diff,
        predicted_peak,
        predicted_trace,
        real_peak,
        real_stream,
    )

    from vramctl.estimator._cuda_kernels import first_step

    try:
        index = corpus.load_index(args.corpus)
        case = next((c for c in index["cases"] if c["id"] == args.case), None)
        if case is None:
            close = [c["id"] for c in index["cases"] if args.case in c["id"]][:5]
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            print(f"diff: no case {args.case!r} in {args.corpus}{hint}", file=sys.stderr)
            return 2
        steps = corpus.load_traces(args.corpus, case)
    except corpus.CorpusError as exc:
        print(f"diff: {exc}", file=sys.stderr)
        return 2
    if args.step not in steps:
        print(f"diff: {args.case} has no {args.step} step", file=sys.stderr)
        return 2
    device = args.device or (
        "cpu" if index["source"] == "simulated" else index["environment"].get("gpu")
    )
    real = real_stream(steps[args.step])
    cal = corpus.calibration(args.corpus, index)[0] if args.calibration == "corpus" else False
    loop = predicted_trace(case["spec"], device, calibration=cal)
    # a cold step is a process's first: its cuBLAS workspaces made at their first product
    trace = first_step(loop) if args.step == "cold" else loop
    predicted = allocations(trace)
    d = diff(real, predicted)
    print(f"{args.case} ({args.step} step) on {device}:")
    print(f"  allocations: real {len(real)}, predicted {len(predicted)}")
    if d.first is None:
        print("  the streams agree allocation for allocation")
    else:
        print(f"  first divergence at real #{d.first[0]}, predicted #{d.first[1]}: {d.first[2]}")
    print(f"  {'operator':<36}{'real':>14}{'predicted':>14}{'difference':>14}")
    for op, r, p in d.by_op[: args.top]:
        print(f"  {op:<36}{r:>14,}{p:>14,}{p - r:>+14,}")
    summary = {
        "benchmark": "cuda_truth",
        "command": "diff",
        "case": args.case,
        "step": args.step,
        "device": device,
        "calibration": args.calibration,
        **d.to_dict(args.top),
        "reserved": _reserved_peaks(case, steps, args.step, loop),
    }
    if args.at_peak:
        summary["at_peak"] = _at_peak(real_peak(steps[args.step]), predicted_peak(trace), args.top)
    return _common.finish(summary, True)


def _reserved_peaks(
    case: dict[str, Any], steps: dict[str, Any], name: str, loop: Any
) -> dict[str, int]:
    """The step's reserved peak, real and predicted (printed too): the estimate's (a fresh
    process's first step, or its loop: that first step and the steps after it), and the
    same begun from the segments the recorded cold step began with, which a capture's
    earlier cases shaped. Where that one agrees and the fresh one does not, the gap is the
    process's history, not the step."""
    from _truth.cases import case_allocator
    from _truth.replay import first_step_from

    from vramctl.estimator._cuda_kernels import first_step
    from vramctl.estimator._verdict import replay

    config = case_allocator(case["spec"])
    real = int((case.get("steps") or {}).get(name, {}).get("max_reserved") or 0)
    warm = name != "cold"
    out = {
        "real": real,
        "fresh_process": replay(first_step(loop), None, config, steady=warm).peak_reserved,
    }
    began = (steps.get("cold") or {}).get("segments_before")
    if began is not None:
        out["from_recorded_segments"] = first_step_from(loop, began, config, loop=warm)
    print("  reserved peak: " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in out.items()))
    return out


def _at_peak(real: tuple[int, Any], predicted: tuple[int, Any], top: int) -> dict[str, Any]:
    """What was live at each step's own peak, by operator, side by side (printed too)."""
    (rp, r), (pp, p) = real, predicted
    print(f"  at the peak (over what the step began with): real {rp:,}, predicted {pp:,}")
    print(f"  {'live at the peak, by operator':<36}{'real':>14}{'predicted':>14}{'difference':>14}")
    ops = sorted(set(r) | set(p), key=lambda op: -abs(p[op] - r[op]))[:top]
    for op in ops:
        print(f"  {op[:36]:<36}{r[op]:>14,}{p[op]:>14,}{p[op] - r[op]:>+14,}")
    return {
        "real_bytes": rp,
        "predicted_bytes": pp,
        "by_op": [
            {"op": op, "real_bytes": r[op], "predicted_bytes": p[op], "difference": p[op] - r[op]}
            for op in ops
        ],
    }


def list_cases(args: argparse.Namespace) -> int:
    from _truth.cases import all_cases

    cases = all_cases(cuda=not args.simulate)
    for c in cases:
        print(c["id"])
    kinds: dict[str, int] = {}
    for c in cases:
        kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
    return _common.finish(
        {"benchmark": "cuda_truth", "command": "cases", "cases": len(cases), "by_kind": kinds}, True
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog=_common.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture", help="record real CUDA steps on this machine's GPU")
    cap.add_argument("--out", type=Path, required=True, help="the corpus folder to write")
    cap.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds to spend; the capture stops cleanly before it (default 240)",
    )
    cap.add_argument(
        "--max-mib",
        type=float,
        default=30.0,
        help="stop once the trace files pass this many MiB (default 30)",
    )
    cap.add_argument(
        "--simulate",
        action="store_true",
        help="record on the CPU through the allocator model (no GPU needed)",
    )
    cap.add_argument(
        "--quick", action="store_true", help="with --simulate: four small cases, in seconds"
    )
    cap.add_argument("--only", help="comma-separated case ids, or parts of them, to record")
    cap.add_argument("--limit", type=int, help="record at most this many cases")
    cap.add_argument(
        "--corpora",
        type=Path,
        default=Path(__file__).parent / "data" / "cuda_truth",
        help="committed corpora: cases traced there on this GPU model run last "
        "(default: benchmarks/data/cuda_truth)",
    )
    cap.add_argument(
        "--keep-order",
        action="store_true",
        help="run the cases in their own order, those traced before included",
    )
    chk = sub.add_parser("check", help="replay each trace through the allocator model")
    chk.add_argument("corpus", type=Path)
    chk.add_argument("--quick", action="store_true", help="the first 10 traced cases")
    dif = sub.add_parser("diff", help="the estimator's request stream against a recorded one")
    dif.add_argument("corpus", type=Path)
    dif.add_argument("case", help="a case id, as `check` prints it")
    dif.add_argument("--step", choices=corpus.STEPS, default="warm")
    dif.add_argument("--device", help="the target to estimate for (default: the corpus' GPU)")
    dif.add_argument("--top", type=int, default=15, help="operators to show")
    dif.add_argument(
        "--at-peak",
        action="store_true",
        help="also what was live at each side's own peak, by operator (where a peak's gap is)",
    )
    dif.add_argument(
        "--calibration",
        choices=("corpus", "off"),
        default="corpus",
        help="estimate with the corpus' profile (its recorded workspaces; the default), or "
        "with the built-in constants",
    )
    wsp = sub.add_parser("workspaces", help="each recorded convolution's cuDNN workspace")
    wsp.add_argument("corpus", type=Path)
    wsp.add_argument("--only", help="cases whose id contains this")
    wsp.add_argument(
        "--write",
        action="store_true",
        help="put the table into the corpus' calibration.json (constants.cudnn_workspaces)",
    )
    wsp.add_argument(
        "--into",
        type=Path,
        action="append",
        metavar="DIR",
        help="also put it into DIR's calibration.json: a corpus of the same GPU and software "
        "whose traces did not come back (refused where they differ); may be repeated",
    )
    lst = sub.add_parser("cases", help="the cases a capture runs, in order")
    lst.add_argument("--simulate", action="store_true", help="those a simulated capture runs")
    args = ap.parse_args(argv)
    return {
        "capture": capture,
        "check": check,
        "diff": diff_case,
        "workspaces": workspaces,
        "cases": list_cases,
    }[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
