"""Everything vramctl claims, on this machine's NVIDIA GPU, in one command.

Runs, one after another, each in its own process with its own budget (seconds):

- ``capture``: ``benchmarks/cuda_truth.py capture``, the CUDA truth corpus (what the
  GPU's caching allocator did) written to the output folder's ``cuda_truth/``; first,
  because it is the evidence that lasts;
- ``truth-check``: ``benchmarks/cuda_truth.py check`` on that corpus (on the CPU);
- ``tests``: the whole test suite, the ``cuda``-marked tests included
  (``cuda-tests``: those alone); the estimator's and ``fit``'s tests first, and those that
  passed before on the same GPU model (a summary in ``docs/benchmarks/gpu/``) last; each
  test's outcome and seconds go into the step's row;
- ``calibrate``: ``vramctl calibrate``, the profile written to the output folder;
- ``estimate_accuracy``: the zoo on the GPU, each row estimated with that
  profile and with the built-in CUDA constants;
- ``fit_search``, ``oom_chaos`` (a second process takes GPU memory in bursts),
  ``audio_batching``, ``monitor_overhead``, ``leak_detection`` and ``tensor_cache``:
  each benchmark's ``--cuda`` side.

``--quick`` runs capture, cuda-tests, calibrate, fit_search and oom_chaos, each
benchmark with its ``--quick``, within ``--budget``
seconds in all (540 by default: one command on a GPU machine lent for a few minutes).
A step runs only while the time left holds its budget; one that no longer fits is
recorded as skipped (``no time``). Its process is stopped at its budget or at the time
left, whichever comes first. ``capture`` shrinks to what the steps after it leave, down
to 120 s.

The output folder gets ``summary.json`` (the GPU, driver, torch and CUDA
versions, and each step's exit status, time, last JSON line, GPU, git commit and start
time), ``logs.txt`` (each step's output, its last 400 lines), ``calibration.json``,
``junit.xml`` and ``cuda_truth.tar.gz``: the corpus packed in one file, because a GPU
machine lent for a few minutes may send back only a handful of files, none deep in
folders (steps that read the corpus unpack it first, and it is packed again after each
step). ``summary.json`` is rewritten after every step. Run
again with the same output folder, a step that passed there on the same GPU and commit is
not run again: its row is kept, marked ``reused`` (``--force`` runs it again). The last
line printed is the summary as one JSON object. The exit status is 0 when every step that
ran passed; without a usable GPU it is 2.

    python benchmarks/gpu_suite.py --out gpu-results --quick        # the plan for one call
    python benchmarks/gpu_suite.py --out gpu-results                # all but cuda-tests, full runs
    python benchmarks/gpu_suite.py --out r --only cuda-tests,calibrate,estimate_accuracy
    python benchmarks/gpu_suite.py --list --quick                   # the plan and its budgets
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

#: The most one command may take on a GPU machine lent for a few minutes (9 minutes).
CALL_S = 540
#: Seconds of a capture's budget kept back from the ``--budget`` it is given.
CAPTURE_MARGIN_S = 20
#: The quick plan, in the order it runs.
#: ``truth-check`` and ``estimate_accuracy`` are left out: both read what ``capture`` and
#: ``calibrate`` record (``cuda_truth.py check``, ``estimate_accuracy.py --truth``), and run
#: as well on the CPU afterwards, so the GPU's minutes go to what only a GPU can measure.
QUICK_PLAN = (
    "capture",
    "cuda-tests",
    "calibrate",
    "fit_search",
    "oom_chaos",
)
#: The test steps run these folders' tests first, in this order: the estimator's and
#: ``fit``'s claims on a real GPU are what the open work waits on. Tests that passed before
#: on the same GPU model (in a summary under :data:`RECORDED`) run after all the others.
TESTS_FIRST = (
    "tests/estimator/",
    "tests/fit/",
    "tests/benchmarks_truth/",
    "tests/guard/",
    "tests/device/",
)
#: The committed summaries of earlier runs (their test steps' outcomes name the tests).
RECORDED = ROOT / "docs" / "benchmarks" / "gpu"
#: The pytest plugin that puts the tests in that order (``benchmarks/_test_order.py``), and
#: the environment variable that names its order file (the plugin's ``ORDER_ENV``).
ORDER_PLUGIN = "_test_order"
ORDER_ENV = "VRAMCTL_TEST_ORDER"


@dataclass(frozen=True)
class Step:
    """One step: its command, its budget in seconds (full run, quick run), and the
    arguments a full run and a quick run add."""

    name: str
    argv: tuple[str, ...]
    budget: tuple[int, int]
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ("--quick",)
    #: The step takes the time it is given (``--budget``): it shrinks to what the steps after
    #: it leave, down to this many seconds. None: its budget is fixed.
    shrinks_to: int | None = None
    #: A step whose output this one checks: while that one runs again, so does this one.
    checks: str | None = None

    def budget_s(self, quick: bool) -> int:
        """Its budget in seconds for a quick or a full run."""
        return self.budget[1] if quick else self.budget[0]


@dataclass(frozen=True)
class Decision:
    """What the suite does with a step: ``run`` it with ``budget_s`` seconds, ``reuse`` the
    row of an earlier run, or ``skip`` it (``reason`` says why)."""

    name: str
    action: str
    budget_s: int
    reason: str | None = None


def steps(out: Path) -> list[Step]:
    """Every step, in the order the suite runs them."""
    py = sys.executable
    cal = str(out / "calibration.json")
    truth = str(BENCH / "cuda_truth.py")
    junit = f"--junitxml={out / 'junit.xml'}"
    # -v: each test's name, outcome and time as it ends, so a step stopped at its budget (no
    # junit.xml, no summary) still says which tests failed and which took the time.
    pytest = (
        *(py, "-m", "pytest", "-v", "-o", "console_output_style=times", "--tb=short"),
        *("-p", "no:cacheprovider", "-p", ORDER_PLUGIN, "-rs", junit),
    )

    def bench(name: str, *extra: str) -> tuple[str, ...]:
        return (py, str(BENCH / f"{name}.py"), "--cuda", *extra)

    # Quick budgets: the wall times of the H200 runs of 2026-11-25 (docs/benchmarks/gpu/)
    # and a margin; capture takes what the others leave of CALL_S.
    return [
        Step(
            "capture",
            (py, truth, "capture", "--out", str(out / "cuda_truth")),
            (600, 240),
            quick=(),
            shrinks_to=120,
        ),
        Step(
            "truth-check",
            (py, truth, "check", str(out / "cuda_truth")),
            (120, 30),
            quick=(),
            checks="capture",
        ),
        Step("tests", pytest, (900, 900), quick=()),
        Step("cuda-tests", (*pytest, "-m", "cuda"), (600, 105), quick=()),
        Step(
            "calibrate",
            (py, "-m", "vramctl", "calibrate", "--json", "--out", cal),
            (300, 25),
            quick=(),
        ),
        # The whole zoo at one batch size: both precisions and modes, each row estimated twice.
        Step(
            "estimate_accuracy",
            bench("estimate_accuracy", "--calibration", cal),
            (900, 70),
            full=("--batches", "4"),
        ),
        Step("fit_search", bench("fit_search"), (600, 90)),
        Step("oom_chaos", bench("oom_chaos", "--cotenant", "process"), (900, 75)),
        Step("audio_batching", bench("audio_batching"), (900, 60)),
        Step("monitor_overhead", bench("monitor_overhead"), (600, 90)),
        Step("leak_detection", bench("leak_detection"), (600, 45)),
        Step("tensor_cache", bench("tensor_cache"), (600, 90)),
    ]


def choose(all_steps: Sequence[Step], quick: bool, only: Sequence[str] | None) -> list[Step]:
    """The steps of a plan, in the suite's order: ``only`` where given, else the quick plan
    with ``quick``, else every step but ``cuda-tests`` (``tests`` runs those too)."""
    if only:
        return [s for s in all_steps if s.name in only]
    if quick:
        return [s for s in all_steps if s.name in QUICK_PLAN]
    return [s for s in all_steps if s.name != "cuda-tests"]


def reusable(row: Any, quick: bool, gpu: str | None, commit: str | None) -> bool:
    """Whether an earlier run's row stands for this run: it passed on the same GPU and
    commit, and a full run is not asked to stand on a quick one."""
    if not isinstance(row, Mapping) or row.get("exit") != 0 or "gpu" not in row:
        return False
    if row.get("gpu") != gpu or row.get("commit") != commit:
        return False
    return quick or row.get("quick") is False


def plan(
    chosen: Sequence[Step],
    quick: bool,
    budget: float | None,
    previous: Mapping[str, Any] | None,
    gpu: str | None,
    commit: str | None,
    force: bool = False,
    start: int = 0,
) -> list[Decision]:
    """What to do with each step from ``chosen[start]`` on, in order, with ``budget`` seconds
    left in all (None: no limit), when no step finishes before its budget (the worst case).

    A step is reused where ``previous`` (an earlier ``summary.json``) has a row for it that
    :func:`reusable` accepts, unless ``force``, or unless it checks a step that runs again.
    Then each step runs while the time left holds its budget, else it is skipped with
    ``no time``. A step that ``shrinks_to`` gets what the later steps to run leave of the
    time left, between that floor and its own budget.
    """
    rows = (previous or {}).get("steps") or {}
    reuse: set[str] = set()
    for s in chosen:
        if force or not reusable(rows.get(s.name), quick, gpu, commit):
            continue
        # A check of a step that runs again checks new output: it runs again too.
        if any(c.name == s.checks for c in chosen) and s.checks not in reuse:
            continue
        reuse.add(s.name)
    left = math.inf if budget is None else float(budget)
    out: list[Decision] = []
    for i, s in enumerate(chosen[start:], start):
        own = s.budget_s(quick)
        if s.name in reuse:
            out.append(Decision(s.name, "reuse", own, "passed before on this GPU and commit"))
            continue
        want = own
        if s.shrinks_to is not None and budget is not None:
            later = sum(c.budget_s(quick) for c in chosen[i + 1 :] if c.name not in reuse)
            want = max(s.shrinks_to, min(own, math.floor(left - later)))
        if want <= left:
            out.append(Decision(s.name, "run", want))
            left -= want
        else:
            out.append(Decision(s.name, "skip", want, "no time"))
    return out


def listing(
    chosen: Sequence[Step],
    decisions: Sequence[Decision],
    quick: bool,
    budget: float | None,
    rest: Sequence[str],
) -> str:
    """The plan as ``--list`` prints it: each step and its budget, the total, and whether it
    fits in one command of :data:`CALL_S` seconds."""
    kind = "quick" if quick else "full"
    limit = "no limit" if budget is None else f"{budget:g} s in all"
    lines = [f"{kind} plan, in the order it runs ({limit}):"]
    by_name = {s.name: s for s in chosen}
    for d in decisions:
        s = by_name[d.name]
        note = ""
        if d.action == "skip":
            note = f"  skipped: {d.reason}"
        elif s.shrinks_to is not None and d.budget_s != s.budget_s(quick):
            note = f"  (up to {s.budget_s(quick)} s where time allows)"
        lines.append(f"  {d.name:<18} {d.budget_s:>5} s{note}")
    total = sum(d.budget_s for d in decisions if d.action == "run")
    fits = "fits" if total <= CALL_S else "does not fit"
    lines.append(f"total {total} s: {fits} in the {CALL_S} s of one call")
    skipped = [d.name for d in decisions if d.action == "skip"]
    if skipped:
        lines.append(f"skipped for lack of time (--budget): {', '.join(skipped)}")
    if rest:
        lines.append(f"other steps (name them with --only): {', '.join(rest)}")
    return "\n".join(lines)


def git_commit() -> str | None:
    """The checkout's commit (``git rev-parse HEAD``), or None where git cannot tell."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    got = done.stdout.strip()
    return got if done.returncode == 0 and got else None


#: Run in a child process, so that this one never starts CUDA: the GPU's memory is the
#: steps' alone (``capture`` records what NVML sees).
FACTS = """
import json, platform, torch
f = {"python": platform.python_version(), "host": platform.node(),
     "torch": torch.__version__, "cuda": torch.version.cuda}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    f.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
             capability=f"{p.major}.{p.minor}", total_bytes=int(p.total_memory),
             cudnn=torch.backends.cudnn.version())
print(json.dumps(f))
"""


def gpu_facts(env: Mapping[str, str]) -> dict[str, Any]:
    """The GPU (no ``gpu`` key where none is usable), driver, torch, CUDA and cuDNN."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", FACTS],
            cwd=ROOT,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        facts: dict[str, Any] = _common.last_json(done.stdout) or {}
    except (OSError, subprocess.SubprocessError):
        facts = {}
    facts["driver"] = _common.driver_version()
    return facts


def run_step(
    step: Step, argv: list[str], limit: float, env: dict[str, str], log: Any
) -> dict[str, Any]:
    """Run ``argv`` for at most ``limit`` seconds; its row: exit status (124 when stopped
    at the limit), wall time and result (the last JSON line, or pytest's closing line)."""
    print(f"# {step.name}: {' '.join(argv[1:])} (budget {limit:.0f} s)", flush=True)
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
    if step.name in TEST_STEPS:
        tail = [ln for ln in lines[-5:] if " passed" in ln or " failed" in ln or " error" in ln]
        row["result"] = tail[-1] if tail else None
        row["tests"], row["test_s"] = test_outcomes(lines)
    print(f"# {step.name}: exit {rc} in {wall} s", flush=True)
    return row


#: The steps that run pytest.
TEST_STEPS = ("tests", "cuda-tests")

#: A test's line in pytest's ``-v`` output with ``console_output_style=times``:
#: ``tests/a.py::test_b[x] PASSED 1.234s`` (the time in us, ms or s).
_TEST_LINE = re.compile(
    r"^(?P<id>tests/\S+::\S+) (?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b"
    r"(?:\s+(?P<time>[0-9.]+)(?P<unit>us|ms|s)\b)?"
)
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def test_outcomes(lines: Sequence[str]) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Each test's outcome (``passed``, ``failed``, ``skipped``, ``error``, ``xfail``,
    ``xpass``: lists of node ids, in the order they ran) and its seconds, read from pytest's
    ``-v`` lines: also from a step stopped at its budget, which writes no report."""
    outcomes: dict[str, list[str]] = {}
    seconds: dict[str, float] = {}
    for line in lines:
        m = _TEST_LINE.match(line.strip())
        if m is None:
            continue
        node = m["id"]
        kind = m["outcome"].lower()
        # A test whose teardown fails has two lines (PASSED, then ERROR): the last counts.
        for names in outcomes.values():
            if node in names:
                names.remove(node)
        outcomes.setdefault(kind, []).append(node)
        if m["time"]:
            seconds[node] = round(seconds.get(node, 0.0) + float(m["time"]) * _UNIT_S[m["unit"]], 3)
    return outcomes, seconds


def passed_before(gpu: str | None, folder: Path = RECORDED) -> set[str]:
    """The tests that passed in a test step of a recorded run on this GPU model (the
    summaries in ``folder``)."""
    done: set[str] = set()
    if not gpu or not folder.is_dir():
        return done
    for path in sorted(folder.glob("*summary.json")):
        summary = load_summary(path) or {}
        rows = summary.get("steps") or {}
        for name in TEST_STEPS:
            row = rows.get(name)
            if not isinstance(row, Mapping) or (row.get("gpu") or summary.get("gpu")) != gpu:
                continue
            tests = row.get("tests") or {}
            done.update(n for n in tests.get("passed") or [] if isinstance(n, str))
    return done


def write_test_order(out: Path, gpu: str | None, folder: Path = RECORDED) -> Path:
    """The order file for the test steps (``benchmarks/_test_order.py``): :data:`TESTS_FIRST`
    first, the tests that passed before on this GPU model last."""
    path = out / "test_order.json"
    last = sorted(passed_before(gpu, folder))
    path.write_text(json.dumps({"first": list(TESTS_FIRST), "last": last}, indent=1) + "\n")
    return path


def command(step: Step, quick: bool, budget_s: float, out: Path) -> list[str]:
    """The step's command line for a run of at most ``budget_s`` seconds."""
    argv = [*step.argv, *(step.quick if quick else step.full)]
    if step.name == "capture":
        argv += ["--budget", str(max(1, int(budget_s) - CAPTURE_MARGIN_S))]
    if step.name == "estimate_accuracy" and not (out / "calibration.json").is_file():
        # No profile from a calibrate step: the benchmark measures one itself.
        argv = [a for a in argv if a not in ("--calibration", str(out / "calibration.json"))]
        argv.append("--calibrate")
    return argv


def corpus_there(out: Path) -> bool:
    """Whether the output folder holds a corpus, packed or not."""
    return (out / PACKED).is_file() or (out / "cuda_truth" / "index.json").is_file()


def keep_profile(name: str, row: Mapping[str, Any], out: Path) -> None:
    """After ``calibrate`` passed, a copy of its profile beside the corpus: the offline
    accuracy check (``estimate_accuracy.py --truth``) calibrates with it."""
    profile, corpus = out / "calibration.json", out / "cuda_truth"
    if name == "calibrate" and row.get("exit") == 0 and profile.is_file() and corpus.is_dir():
        (corpus / "calibration.json").write_bytes(profile.read_bytes())


#: The corpus as it comes back: one file (see the module's docstring).
PACKED = "cuda_truth.tar.gz"


def unpack_corpus(out: Path) -> None:
    """``cuda_truth/`` from ``cuda_truth.tar.gz``, where only the packed copy is there."""
    packed = out / PACKED
    if packed.is_file() and not (out / "cuda_truth").exists():
        with tarfile.open(packed) as tar:
            if hasattr(tarfile, "data_filter"):  # no links or paths outside ``out``
                tar.extractall(out, filter="data")
            else:  # pragma: no cover - Python before the filters (3.10.11, 3.11.3)
                tar.extractall(out)


def pack_corpus(out: Path) -> None:
    """``cuda_truth/`` packed into ``cuda_truth.tar.gz`` (written whole, then renamed),
    and the folder removed: what comes back from the machine is then a few files."""
    folder = out / "cuda_truth"
    if not folder.is_dir():
        return
    part = out / (PACKED + ".part")
    with tarfile.open(part, "w:gz") as tar:
        tar.add(folder, arcname="cuda_truth")
    part.replace(out / PACKED)
    shutil.rmtree(folder)


def load_summary(path: Path) -> dict[str, Any] | None:
    """An earlier ``summary.json``, or None where there is none that can be read."""
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def now() -> str:
    """The time now, ISO 8601 with the offset, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = _common.parser(__doc__, quick="the quick plan, each benchmark's --quick run")
    ap.add_argument("--out", type=Path, default=Path("gpu-results"), help="output folder")
    ap.add_argument("--only", help="comma-separated step names (default: the plan)")
    ap.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help=f"seconds for all the steps (default {CALL_S} with --quick, else no limit)",
    )
    ap.add_argument(
        "--force", action="store_true", help="run steps that passed before in --out again"
    )
    ap.add_argument("--list", action="store_true", help="print the plan and its budgets and exit")
    args = ap.parse_args(argv)
    if args.budget is None and args.quick:
        args.budget = float(CALL_S)
    if args.budget is not None and args.budget <= 0:
        ap.error("--budget: give a positive number of seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    args = arguments(argv)
    out: Path = args.out
    all_steps = steps(out)
    names = [s.name for s in all_steps]
    only = None
    if args.only:
        only = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in only if n not in names]
        if unknown:
            print(
                f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(names)}", file=sys.stderr
            )
            return 2
    chosen = choose(all_steps, args.quick, only)
    if args.list:
        decisions = plan(chosen, args.quick, args.budget, None, None, None)
        rest = [n for n in names if n not in {s.name for s in chosen}]
        print(listing(chosen, decisions, args.quick, args.budget, rest))
        return 0

    env = dict(os.environ)
    # benchmarks/ last: the test steps' pytest loads the order plugin from it.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", ""), str(BENCH)) if p
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    facts = gpu_facts(env)
    if not facts.get("gpu"):
        print("no usable CUDA device on this machine: this suite runs on a GPU", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"cannot create {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    gpu: str = facts["gpu"]
    commit = git_commit()
    if any(s.name in TEST_STEPS for s in chosen):
        env[ORDER_ENV] = str(write_test_order(out, gpu))
    previous = load_summary(out / "summary.json") or {}
    old_rows: dict[str, Any] = dict(previous.get("steps") or {})
    summary: dict[str, Any] = {
        "benchmark": "gpu_suite",
        "quick": args.quick,
        "budget_s": args.budget,
        "commit": commit,
        **facts,
    }
    results: dict[str, Any] = {}
    ran: list[str] = []

    def save() -> None:
        # This call's rows, then the earlier rows of steps not in this plan, as they were.
        kept = {n: r for n, r in old_rows.items() if n not in results and n not in chosen_names}
        summary["steps"] = {**results, **kept}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    chosen_names = {s.name for s in chosen}
    stamp = {"gpu": gpu, "commit": commit, "quick": args.quick}
    with (out / "logs.txt").open("a", encoding="utf-8") as log:
        for i, step in enumerate(chosen):
            left = None if args.budget is None else args.budget - (time.monotonic() - t0)
            d = plan(chosen, args.quick, left, previous, gpu, commit, args.force, start=i)[0]
            if d.action == "reuse":
                results[step.name] = {**old_rows[step.name], "reused": True}
                print(f"# {step.name}: passed before on this GPU and commit, not run", flush=True)
            elif d.action == "skip":
                results[step.name] = {"skipped": d.reason, "budget_s": d.budget_s, **stamp}
                print(f"# {step.name}: skipped ({d.reason}, needs {d.budget_s} s)", flush=True)
            elif step.name == "truth-check" and not corpus_there(out):
                reason = "no corpus: no cuda_truth/index.json in the output folder"
                results[step.name] = {"skipped": reason, "budget_s": d.budget_s, **stamp}
                print(f"# {step.name}: skipped ({reason})", flush=True)
            else:
                limit = d.budget_s if left is None else min(d.budget_s, left)
                row: dict[str, Any] = {"exit": None, "started": now(), "budget_s": d.budget_s}
                results[step.name] = {**row, **stamp}
                save()  # a call stopped from outside shows which step was running
                argv = command(step, args.quick, limit, out)
                unpack_corpus(out)
                try:
                    results[step.name] = {**row, **run_step(step, argv, limit, env, log), **stamp}
                    ran.append(step.name)
                    keep_profile(step.name, results[step.name], out)
                finally:
                    pack_corpus(out)
            save()
    summary["failed"] = [n for n in ran if results[n]["exit"] != 0]
    summary["skipped"] = [n for n, r in results.items() if "skipped" in r]
    summary["reused"] = [n for n, r in results.items() if r.get("reused")]
    save()
    return _common.finish(summary, not summary["failed"])


if __name__ == "__main__":
    sys.exit(main())
