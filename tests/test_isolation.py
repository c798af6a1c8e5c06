"""The isolation check (tests/_isolation.py): a test that leaves a stand-in behind fails,
and the tests after it run on the real thing, even when a teardown stopped part way."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pynvml
import torch

from tests._isolation import leftovers, restore, snapshot

ROOT = Path(__file__).resolve().parent.parent


def test_leftovers_are_named_and_put_back() -> None:
    snap = snapshot()
    original = pynvml.nvmlInit
    threads = torch.get_num_threads()
    try:
        pynvml.nvmlInit = lambda: None
        torch.set_num_threads(threads + 1)
        found = leftovers(snap)
        assert "pynvml.nvmlInit is replaced" in found
        assert any(line.startswith("torch.get_num_threads()") for line in found)
        restore(snap)
        assert leftovers(snap) == []
        assert pynvml.nvmlInit is original and torch.get_num_threads() == threads
    finally:
        pynvml.nvmlInit = original
        torch.set_num_threads(threads)


INNER = '''
import pynvml
import pytest
import torch

REAL_INIT = pynvml.nvmlInit


class Refuses:
    """An object that refuses to be set back once frozen: monkeypatch's undo raises."""

    frozen = False

    def __setattr__(self, name, value):
        if type(self).frozen:
            raise AttributeError("frozen")
        object.__setattr__(self, name, value)


target = Refuses()
target.x = 1


def test_leaves_a_fake_nvml():
    pynvml.nvmlInit = lambda: None


def test_undo_stops_half_way(monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(target, "x", 2)
    Refuses.frozen = True  # undo raises at ``x`` and never reaches pynvml


def test_leaves_a_mode_and_a_setting():
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode().__enter__()


def test_the_next_test_sees_the_real_thing():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert pynvml.nvmlInit is REAL_INIT
    assert not _get_current_dispatch_mode_stack()
'''


def test_a_test_that_leaves_a_stand_in_fails(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests._isolation", "-p", "no:cacheprovider",
         "-p", "no:randomly", "-q", "-rE", "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "4 passed, 3 errors" in out, out
    assert "test_leaves_a_fake_nvml left behind what it replaced" in out, out
    assert "pynvml.nvmlInit is replaced" in out, out
    assert "left behind (now put back): pynvml.nvmlInit is replaced" in out, out
    assert "torch.backends.cudnn.benchmark is" in out, out
    assert "dispatch modes still active: FakeTensorMode" in out, out
