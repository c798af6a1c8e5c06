"""How long the light ``vramctl`` commands take to start and answer (goal: 0.5 s each).

Each command runs as a user runs it: a fresh ``vramctl`` process, against a job store of
its own (``VRAMCTL_HOME`` in a scratch directory, one queued job for ``logs`` and
``cancel``), with vramctl's bytecode compiled once beforehand as an installed package's
is (``PYTHONPYCACHEPREFIX`` in the scratch directory). The time is the whole process's,
from its start to its exit, measured from outside (wall clock), and its CPU time
(user + system, the operating system's account of the finished child).

The light commands: ``--help``, ``--version``, ``catalog``, ``devices``, ``status``,
``jobs``, ``submit``, ``logs``, ``cancel``, and the ``--help`` of each of those. They
import neither PyTorch nor vramctl's heavy layers (``tests/cli/test_startup.py`` checks
that); for scale, ``python -c pass`` and ``python -c "import typer, rich.console"``
(the interpreter, and the command line's own libraries) are timed the same way.
``import_ms`` is ``python -X importtime``'s total for ``vramctl.cli._app`` (every
command module), the figure least moved by other work on the machine.

    python benchmarks/cli_startup.py --quick    # 3 runs per command: under a minute
    python benchmarks/cli_startup.py            # 10 runs per command, every --help too

The last line is one JSON object: each command's median wall time (``median_s``) against
the goal (``goal_s``), and ``all_met``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

GOAL_S = 0.5
QUICK_HELP = ("submit", "jobs", "status")
ALL_HELP = ("submit", "jobs", "logs", "cancel", "status", "devices", "catalog")


def _vramctl() -> list[str]:
    """The ``vramctl`` command of this interpreter's environment (else ``python -m vramctl``)."""
    found = Path(sys.executable).with_name("vramctl")
    return [str(found)] if found.exists() else [sys.executable, "-m", "vramctl"]


def _time(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """One run: (wall seconds, CPU seconds, exit status)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def _figures(argv: list[str], env: dict[str, str], runs: int) -> dict[str, Any]:
    _time(argv, env)  # compiles what it imports (once), warms the file cache
    walls, cpus, codes = [], [], set()
    for _ in range(runs):
        wall, cpu, code = _time(argv, env)
        walls.append(wall)
        cpus.append(cpu)
        codes.add(code)
    return {
        "median_s": round(statistics.median(walls), 3),
        "min_s": round(min(walls), 3),
        "max_s": round(max(walls), 3),
        "cpu_s": round(statistics.median(cpus), 3),
        "exit": sorted(codes),
    }


def _import_ms(env: dict[str, str], runs: int) -> float:
    """``-X importtime``'s cumulative microseconds for ``vramctl.cli._app``, in ms (median)."""
    totals = []
    for _ in range(runs + 1):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import vramctl.cli._app"],
            env=env,
            capture_output=True,
            text=True,
        )
        found = re.findall(r"\|\s*(\d+) \| vramctl\.cli\._app\s*$", proc.stderr, re.M)
        totals.append(int(found[-1]) / 1000)
    return round(statistics.median(totals[1:]), 1)


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(__doc__, quick="3 runs per command, fewer --help pages; under a minute")
    args = _common.parse(ap, argv)
    runs = 3 if args.quick else 10
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="vramctl-startup-"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMCTL_")}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.update(
            VRAMCTL_HOME=str(scratch / "home"),
            PYTHONPYCACHEPREFIX=str(scratch / "pycache"),
            COLUMNS="100",
        )
        vramctl = _vramctl()
        queued = subprocess.run(
            [*vramctl, "submit", "-m", "1GiB", "--name", "bench", "--json", "--", "true"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        job = json.loads(queued.stdout)["id"]
        commands: dict[str, list[str]] = {
            "--help": ["--help"],
            "--version": ["--version"],
            "catalog": ["catalog"],
            "devices": ["devices"],
            "status": ["status"],
            "jobs": ["jobs"],
            "submit": ["submit", "-m", "1GiB", "--", "true"],
            "logs": ["logs", job],
            "cancel": ["cancel", job],
        }
        for name in QUICK_HELP if args.quick else ALL_HELP:
            commands[f"{name} --help"] = [name, "--help"]
        results: dict[str, Any] = {}
        for name, words in commands.items():
            results[name] = _figures([*vramctl, *words], env, runs)
            print(f"vramctl {name:<16} {results[name]}", file=sys.stderr, flush=True)
        reference = {
            "python -c pass": _figures([sys.executable, "-c", "pass"], env, runs),
            "import typer, rich.console": _figures(
                [sys.executable, "-c", "import typer, rich.console"], env, runs
            ),
        }
        import_ms = _import_ms(env, runs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    failed = [n for n, r in results.items() if r["exit"] != [0]]
    summary = {
        "benchmark": "cli_startup",
        "quick": args.quick,
        "runs": runs,
        "goal_s": GOAL_S,
        "median_s": {n: r["median_s"] for n, r in results.items()},
        "cpu_s": {n: r["cpu_s"] for n, r in results.items()},
        "min_s": {n: r["min_s"] for n, r in results.items()},
        "max_s": {n: r["max_s"] for n, r in results.items()},
        "met": {n: r["median_s"] <= GOAL_S for n, r in results.items()},
        "all_met": all(r["median_s"] <= GOAL_S for r in results.values()),
        "slowest": max(results, key=lambda n: results[n]["median_s"]),
        "failed": failed,
        "reference_median_s": {n: r["median_s"] for n, r in reference.items()},
        "import_ms": import_ms,
        "bytecode": "compiled beforehand (PYTHONPYCACHEPREFIX)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return _common.finish(summary, ok=not failed)


if __name__ == "__main__":
    raise SystemExit(main())
