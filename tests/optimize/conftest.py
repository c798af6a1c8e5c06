from __future__ import annotations

import pytest
import torch

from vramctl.optimize._settings import ENV


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests set the overrides they test; none comes from the environment."""
    for variable in ENV.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.fixture(autouse=True)
def _global_settings_restored():
    """optimize sets process-wide flags (cuDNN, TF32, threads): each test's are undone."""
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_num_threads(),
    )
    yield
    torch.backends.cudnn.benchmark = saved[0]
    torch.backends.cuda.matmul.allow_tf32 = saved[1]
    torch.backends.cudnn.allow_tf32 = saved[2]
    torch.set_num_threads(saved[3])
