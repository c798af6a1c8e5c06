"""docs/inference.md's commands run as written and print the figures the page shows."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vramctl.cli._app import app

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "inference.md"


def commands_and_outputs() -> list[tuple[list[str], list[str]]]:
    """Each ``vramctl`` command of a bash block, with the lines of the text block after it."""
    text = PAGE.read_text()
    found = []
    for m in re.finditer(r"```bash\n(.*?)```\n(?:\n```text\n(.*?)```)?", text, re.S):
        block = re.sub(r"\\\n\s*", " ", m.group(1))
        shown = (m.group(2) or "").splitlines()
        lines = [line for line in block.splitlines() if line.startswith("vramctl ")]
        for i, line in enumerate(lines):
            # the output shown belongs to the block's last command
            found.append((shlex.split(line)[1:], shown if i == len(lines) - 1 else []))
    return found


CASES = commands_and_outputs()


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("│").split("│")]


def test_the_page_has_its_commands() -> None:
    assert sum(1 for argv, _ in CASES if argv[0] == "serve-plan") >= 4
    assert sum(1 for argv, _ in CASES if "--mode" in argv) == 3


@pytest.mark.parametrize(("argv", "shown"), CASES, ids=[" ".join(a[:4]) for a, _ in CASES])
def test_each_command_prints_what_the_page_shows(
    argv: list[str], shown: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    out = result.output.splitlines()
    out_cells = [cells(line) for line in out if line.lstrip().startswith("│")]
    for line in shown:
        if line.startswith("│"):
            assert cells(line) in out_cells, (line, result.output)
        elif line.startswith(("vllm:", "sglang:")):
            assert line in out, (line, result.output)
    if "--mode" in argv:
        # the figures of the page's table
        device = argv[argv.index("--device") + 1]
        if "offloaded" in argv:
            assert "largest batch that fits: 21 (160.00 MiB per sample" in result.output
            return
        batch, length = {"L4-24GB": ("11", "11500"), "H100-80GB": ("186", "131072")}[device]
        assert f"largest batch that fits: {batch} " in result.output
        assert f"longest seq_len at batch 1: {length}" in result.output
