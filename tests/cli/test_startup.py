"""The light commands start without importing PyTorch or vramctl's heavy layers.

Each command runs in a fresh interpreter (``python -c``), as ``vramctl`` does, and then
lists which of the heavy modules it imported. How fast they start is a benchmark's
question (``benchmarks/cli_startup.py``); which modules they import is this test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import typer

from vramctl.cli._app import app
from vramctl.jobs import JobSpec, JobStore, MemoryNeed

ROOT = Path(__file__).resolve().parents[2]

#: Third-party packages that take seconds to import, and vramctl's layers above the
#: devices and the job store: imported by the commands that use them, never by these.
HEAVY = (
    "torch",
    "transformers",
    "fastapi",
    "uvicorn",
    "ray",
    "lhotse",
    "matplotlib",
    "vramctl.estimator",
    "vramctl.guard",
    "vramctl.fit",
    "vramctl.batching",
    "vramctl.monitor",
    "vramctl.optimize",
    "vramctl.doctor",
    "vramctl.cache",
    "vramctl.server",
    "vramctl.device._simulate",
    "vramctl.jobs._scheduler",
)

# Runs the command as the ``vramctl`` entry point does, then writes the heavy modules
# it imported to the file named by the first argument. ``--fake-nvml`` first puts the
# NVML stand-in in place of the real binding's functions (three GPUs).
RUN = """
import json, sys
out, fake, args = sys.argv[1], sys.argv[2] == "--fake-nvml", sys.argv[3:]
if fake:
    import pytest
    from tests.fake_nvml import FakeNvml, make_gpus
    FakeNvml(make_gpus()).install(pytest.MonkeyPatch())
sys.argv = ["vramctl", *args]
from vramctl.cli import main
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code
with open(out, "w") as f:
    json.dump({"code": code, "heavy": [m for m in HEAVY if m in sys.modules]}, f)
"""


Run = Callable[..., tuple[object, list[str]]]


@pytest.fixture(scope="module")
def pycache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pycache")


@pytest.fixture
def run(tmp_path: Path, pycache: Path) -> Run:
    """``run(ARGS)`` runs ``vramctl ARGS`` in a fresh interpreter, with its own
    ``VRAMCTL_HOME``: (its exit code, the heavy modules it imported)."""

    def run_(args: list[str], *, fake_nvml: bool = False) -> tuple[object, list[str]]:
        out = tmp_path / "imports.json"
        # The job store and settings come from VRAMCTL_HOME alone (a server named in the
        # caller's environment would take `jobs`). The bytecode is compiled once for all
        # these interpreters, outside the source tree, as an installed vramctl's is.
        skip = {"VRAMCTL_SERVER", "VRAMCTL_JOBS_STORE", "VRAMCTL_SETTINGS", "VRAMCTL_TOKEN"}
        env = {k: v for k, v in os.environ.items() if k not in skip}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.update(VRAMCTL_HOME=str(tmp_path), COLUMNS="100", PYTHONPYCACHEPREFIX=str(pycache))
        flag = "--fake-nvml" if fake_nvml else "-"
        proc = subprocess.run(
            [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{RUN}", str(out), flag, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.exists(), proc.stderr
        found = json.loads(out.read_text())
        return found["code"], found["heavy"]

    return run_


@pytest.fixture
def job(tmp_path: Path) -> str:
    spec = JobSpec(name="sleeper", command=("true",), memory=MemoryNeed.of_size("1GiB"))
    with JobStore(tmp_path / "jobs.db") as store:
        return store.submit(spec).id


LIGHT = [
    ["--help"],
    ["--version"],
    ["catalog"],
    ["catalog", "--json"],
    ["devices"],
    ["devices", "--json"],
    ["status"],
    ["status", "--json"],
    ["jobs"],
    ["jobs", "--json"],
    ["submit", "-m", "1GiB", "--", "true"],
]


@pytest.mark.parametrize("args", LIGHT, ids=" ".join)
def test_light_commands_import_no_heavy_layer(args: list[str], run: Run) -> None:
    code, heavy = run(args)
    assert code in (0, None), args
    assert heavy == [], f"vramctl {' '.join(args)} imported {heavy}"


def test_logs_and_cancel_import_no_heavy_layer(run: Run, job: str) -> None:
    for args in (["logs", job], ["cancel", job], ["jobs", "--state", "cancelled"]):
        code, heavy = run(args)
        assert code in (0, None), args
        assert heavy == [], f"vramctl {' '.join(args)} imported {heavy}"


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["devices"]], ids=" ".join)
def test_status_reads_gpus_through_nvml_without_pytorch(args: list[str], run: Run) -> None:
    code, heavy = run(args, fake_nvml=True)
    assert code in (0, None), args
    assert heavy == [], f"vramctl {' '.join(args)} with NVML imported {heavy}"


def _command_paths() -> list[list[str]]:
    group = typer.main.get_command(app)
    paths: list[list[str]] = []
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        paths.append([name])
        for sub in getattr(cmd, "commands", {}):
            paths.append([name, sub])
    return paths


@pytest.mark.parametrize("path", _command_paths(), ids=" ".join)
def test_every_commands_help_imports_no_heavy_layer(path: list[str], run: Run) -> None:
    code, heavy = run([*path, "--help"])
    assert code in (0, None), path
    assert heavy == [], f"vramctl {' '.join(path)} --help imported {heavy}"


def test_a_heavy_command_still_imports_what_it_needs(run: Run) -> None:
    # The check sees imports: listing calibrations needs the estimator, and PyTorch.
    code, heavy = run(["calibrate", "--list", "--json"])
    assert code in (0, None)
    assert "torch" in heavy and "vramctl.estimator" in heavy


def test_a_command_named_first_is_built_alone_and_the_app_is_left_whole() -> None:
    from vramctl.cli import _command_name, _only_the_command
    from vramctl.cli._app import app

    every = list(app.registered_commands)
    only = _only_the_command(app, ["catalog", "--json"])
    assert [_command_name(c) for c in only.registered_commands] == ["catalog"]
    assert app.registered_commands == every and only.registered_groups == app.registered_groups
    for args in ([], ["--help"], ["--version"], ["ray", "status"], ["statsu"]):
        assert _only_the_command(app, args) is app
