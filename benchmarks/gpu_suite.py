"""Everything vramctl claims, on this machine's NVIDIA GPU, in one command.

Runs, one after another, each in its own process with its own time limit:

- ``tests``: the whole test suite, the ``cuda``-marked tests included
  (``cuda-tests``: those alone);
- ``calibrate``: ``vramctl calibrate``, the profile written to the output folder;
- ``estimate_accuracy``: the zoo on the GPU, each row estimated with that
  profile and with the built-in CUDA constants;
- ``oom_chaos`` (a second process takes GPU memory in bursts), ``fit_search``,
  ``audio_batching``, ``monitor_overhead``, ``leak_detection`` and
  ``tensor_cache``: each benchmark's ``--cuda`` side.

The output folder gets ``summary.json`` (the GPU, driver, torch and CUDA
versions, and each step's exit status, time and last JSON line),
``logs.txt`` (each step's output, its last 400 lines), ``calibration.json``
and ``junit.xml``. The last line printed is the summary as one JSON object.
The exit status is 0 when every step that ran passed.

    python benchmarks/gpu_suite.py --out gpu-results                # everything, full runs
    python benchmarks/gpu_suite.py --out gpu-results --quick        # each benchmark's --quick
    python benchmarks/gpu_suite.py --out r --only cuda-tests,calibrate,estimate_accuracy
    python benchmarks/gpu_suite.py --list                           # the steps and their limits
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import _common

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    #: Time limit in seconds (full, quick).
    limit: tuple[int, int]
    #: Extra arguments for a full run and for --quick.
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ("--quick",)


def steps(out: Path) -> list[Step]:
    py = sys.executable
    cal = str(out / "calibration.json")
    junit = f"--junitxml={out / 'junit.xml'}"
    pytest = (py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", junit)

    def bench(name: str, *extra: str) -> tuple[str, ...]:
        return (py, str(BENCH / f"{name}.py"), "--cuda", *extra)

    return [
        Step("tests", pytest, (900, 900), quick=()),
        Step("cuda-tests", (*pytest, "-m", "cuda"), (600, 600), quick=()),
        Step(
            "calibrate",
            (py, "-m", "vramctl", "calibrate", "--json", "--out", cal),
            (300, 300),
            quick=(),
        ),
        # The whole zoo at one batch size: both precisions and modes, each row estimated twice.
        Step(
            "estimate_accuracy",
            bench("estimate_accuracy", "--calibration", cal),
            (900, 300),
            full=("--batches", "4"),
        ),
        Step("oom_chaos", bench("oom_chaos", "--cotenant", "process"), (900, 300)),
        Step("fit_search", bench("fit_search"), (600, 300)),
        Step("audio_batching", bench("audio_batching"), (900, 300)),
        Step("monitor_overhead", bench("monitor_overhead"), (600, 300)),
        Step("leak_detection", bench("leak_detection"), (600, 300)),
        Step("tensor_cache", bench("tensor_cache"), (600, 300)),
    ]


def gpu_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["gpus"] = torch.cuda.device_count()
            props = torch.cuda.get_device_properties(0)
            facts["capability"] = f"{props.major}.{props.minor}"
            facts["total_bytes"] = int(props.total_memory)
            facts["cudnn"] = torch.backends.cudnn.version()
    except ImportError:
        facts["torch"] = None
    facts["driver"] = _common.driver_version()
    return facts


def run_step(step: Step, quick: bool, env: dict[str, str], log: Any) -> dict[str, Any]:
    argv = [*step.argv, *(step.quick if quick else step.full)]
    limit = step.limit[1] if quick else step.limit[0]
    print(f"# {step.name}: {' '.join(argv[1:])} (limit {limit} s)", flush=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit, check=False
        )
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        parts = [exc.stdout, exc.stderr]
        output = "".join(p.decode() if isinstance(p, bytes) else (p or "") for p in parts)
    wall = round(time.perf_counter() - t0, 1)
    lines = output.splitlines()
    log.write(f"===== {step.name} (exit {rc}, {wall} s): {' '.join(argv[1:])}\n")
    log.write("\n".join(lines[-400:]) + "\n")
    log.flush()
    row: dict[str, Any] = {"exit": rc, "wall_s": wall, "result": _common.last_json(output)}
    if step.name in ("tests", "cuda-tests"):
        tail = [ln for ln in lines[-5:] if " passed" in ln or " failed" in ln or " error" in ln]
        row["result"] = tail[-1] if tail else None
    print(f"# {step.name}: exit {rc} in {wall} s", flush=True)
    return row


def main() -> int:
    ap = _common.parser(__doc__, quick="each benchmark's --quick run")
    ap.add_argument("--out", type=Path, default=Path("gpu-results"), help="output folder")
    ap.add_argument("--only", help="comma-separated step names (default: all but cuda-tests)")
    ap.add_argument("--list", action="store_true", help="list the steps and exit")
    args = ap.parse_args()
    out: Path = args.out
    all_steps = steps(out)
    names = [s.name for s in all_steps]
    if args.list:
        for s in all_steps:
            print(f"{s.name:<18} limit {s.limit[0]} s full, {s.limit[1]} s quick")
        return 0
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            print(
                f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(names)}", file=sys.stderr
            )
            return 2
        chosen = [s for s in all_steps if s.name in wanted]
    else:
        chosen = [s for s in all_steps if s.name != "cuda-tests"]
    try:
        import torch

        usable = torch.cuda.is_available()
    except ImportError:
        usable = False
    if not usable:
        print("no usable CUDA device on this machine: this suite runs on a GPU", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"cannot create {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    summary: dict[str, Any] = {"benchmark": "gpu_suite", "quick": args.quick, **gpu_facts()}
    results: dict[str, Any] = {}
    summary["steps"] = results
    with (out / "logs.txt").open("a", encoding="utf-8") as log:
        for step in chosen:
            if step.name == "estimate_accuracy" and not (out / "calibration.json").is_file():
                # No profile from a calibrate step: the benchmark measures one itself.
                argv = tuple(a for a in step.argv if a != str(out / "calibration.json"))
                step = replace(step, argv=(*argv[:-1], "--calibrate"))
            results[step.name] = run_step(step, args.quick, env, log)
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["failed"] = [n for n, r in results.items() if r["exit"] != 0]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return _common.finish(summary, not summary["failed"])


if __name__ == "__main__":
    sys.exit(main())
