"""The examples in the README, the docs and the docstrings run as written (the command lines
of the shell blocks are parsed by tests/cli/test_doc_commands.py)."""

from __future__ import annotations

import doctest
import importlib
import json
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import vramctl

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
            out.append((f"{path.name}#{i}", block))
    return out


@pytest.mark.parametrize(("where", "code"), python_blocks(), ids=[w for w, _ in python_blocks()])
def test_doc_example_runs(
    where: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if code.startswith("# needs a GPU") and not torch.cuda.is_available():
        pytest.skip("the example measures a GPU; none is usable here")
    # Examples that write files (exports, outputs) write them in a scratch directory; those
    # that read the docs' example configs run from the project's root, as the docs say.
    monkeypatch.chdir(ROOT if "docs/examples/" in code else tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__doc_example__"})


def modules() -> list[str]:
    names = ["vramctl"]
    for info in pkgutil.walk_packages(vramctl.__path__, "vramctl."):
        if info.name.startswith(("vramctl.cli", "vramctl.__main__")):
            continue
        names.append(info.name)
    return names


@pytest.mark.parametrize("name", modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_readme_states_the_monitor_overhead_the_benchmark_measured() -> None:
    """The README's figure for the monitor's cost is the benchmark page's full run's, linked."""
    page = (ROOT / "docs" / "benchmarks" / "monitor_overhead.md").read_text()
    full = json.loads(
        next(
            line
            for line in page.splitlines()
            if line.startswith('{"benchmark": "monitor_') and '"quick": false' in line
        )
    )
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `Monitor`"))
    assert f"{full['overhead_pct_1hz']}%" in row, row
    assert "(docs/benchmarks/monitor_overhead.md)" in row
    assert "no measurable" not in row
