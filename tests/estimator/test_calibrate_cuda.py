"""``calibrate`` on a real GPU: the measured constants, the profile, and a calibrated estimate."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import vramctl
from tests.estimator.real_steps import cuda_step_peaks
from vramctl.estimator import Calibration, calibrate, load_calibration
from vramctl.estimator._calibrate import CONVOLUTIONS
from vramctl.estimator._target import resolve_target

pytestmark = pytest.mark.cuda
MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def cal(tmp_path_factory: pytest.TempPathFactory) -> Calibration:
    return calibrate(0, path=tmp_path_factory.mktemp("calibration") / "gpu.json")


def test_the_allocator_segments_are_pytorchs_defaults(cal: Calibration) -> None:
    measured = cal.measurements["allocator"]
    if measured["expandable_segments"]:
        pytest.skip("expandable segments are on: the segment sizes differ by design")
    a = cal.allocator
    assert (a.min_block, a.small_size, a.small_buffer) == (512, MiB, 2 * MiB)
    assert (a.large_buffer, a.min_large_alloc, a.round_large) == (20 * MiB, 10 * MiB, 2 * MiB)


def test_context_and_workspaces_are_measured(cal: Calibration) -> None:
    ctx = cal.measurements["context"]
    assert ctx["method"] != "unavailable"
    assert 64 * MiB <= cal.context_bytes <= 4 * GiB
    assert 0 <= cal.cudnn_context_bytes <= 2 * GiB
    assert MiB <= cal.cublas_workspace_bytes <= 256 * MiB
    # The backward measured before any other thread's matrix multiplies (a finished
    # thread's pooled handle would lend autograd's thread its workspace): its own handle.
    assert cal.measurements["cublas"]["backward_first"] is True
    assert cal.measurements["cublas"]["backward_extra"] >= cal.cublas_workspace_bytes
    assert cal.train_handles == 2
    # cuBLASLt's workspace, read apart: PyTorch's default is 1 MiB (CUBLASLT_WORKSPACE_SIZE),
    # or none where a build serves cuBLASLt from the cuBLAS workspace
    assert cal.cublaslt_workspace_bytes is not None
    assert cal.cublaslt_workspace_bytes in (0, MiB) or "CUBLASLT_WORKSPACE_SIZE" in os.environ
    dtypes = 2 if torch.cuda.get_device_capability(0) >= (8, 0) else 1
    assert len(cal.measurements["cudnn"]) == 2 * len(CONVOLUTIONS) * dtypes
    # each measured call is in the profile's table by its key; the depthwise one, which is
    # not channels-last, runs on PyTorch's own kernels and takes no workspace
    for row in cal.measurements["cudnn"]:
        assert cal.cudnn_workspaces[row["key"]] >= row["workspace_bytes"]
        if row["conv"].startswith("convnext depthwise"):
            assert row["workspace_bytes"] == 0, row
    assert {"forward:dense", "backward:dense"} <= set(cal.cudnn_workspace_lines)
    assert math.isfinite(cal.cudnn_workspace_ratio) and cal.cudnn_workspace_ratio >= 0
    assert cal.device == torch.cuda.get_device_name(0)
    assert cal.software["torch"] == torch.__version__


def test_the_profile_is_saved_and_used(cal: Calibration) -> None:
    assert cal.path is not None and Path(cal.path).is_file()
    assert load_calibration(cal.path) == cal
    assert resolve_target("cuda:0", cal.path).calibration == cal


class SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_calibrated_estimate_is_close_to_a_real_step(cal: Calibration) -> None:
    torch.manual_seed(0)
    batch = torch.randn(32, 3, 64, 64)
    real_allocated, real_reserved = cuda_step_peaks(SmallConvNet(), batch, cold_cache=True)
    est = vramctl.estimate(SmallConvNet(), batch, device="cuda:0", calibration=cal)
    assert any("measured on" in n for n in est.notes)
    # The cuDNN workspace is charged on the line over every convolution measured.
    assert 0.95 * real_allocated <= est.peak_allocated <= 1.5 * real_allocated
    assert 0.9 * real_reserved <= est.peak_reserved <= 1.6 * real_reserved


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.head = nn.Linear(64, 1000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(ids).relu())
        return out


def test_a_model_and_batch_on_the_gpu_are_estimated_as_on_the_host() -> None:
    torch.manual_seed(0)
    images, ids = torch.randn(8, 3, 32, 32), torch.randint(0, 1000, (8, 128))
    for model, batch in ((SmallConvNet, images), (Tokens, ids)):
        host = vramctl.estimate(model(), batch, device="cuda:0", calibration=False)
        gpu = vramctl.estimate(model().cuda(), batch.cuda(), device="cuda:0", calibration=False)
        assert gpu.peak_allocated == host.peak_allocated
        assert gpu.breakdown == host.breakdown


_STREAMS_CHILD = """
import json
import torch
from vramctl.device import resolve

dev = resolve("cuda:0")

def outside():
    torch.cuda.synchronize()
    return dev.memory().process_used - torch.cuda.memory_reserved(0)

torch.ones(1, device="cuda").mul_(2)
before = outside()
first = torch.cuda.Stream()
after_first = outside()
second = torch.cuda.Stream()
print(json.dumps([before, after_first, outside()]))
"""


def test_the_stream_pool_is_what_a_fresh_processs_first_side_stream_takes(
    cal: Calibration,
) -> None:
    """PyTorch makes its whole pool of side streams at a process's first
    ``torch.cuda.Stream()`` (32 per priority level), outside the caching allocator; a
    second stream comes from the same pool and adds nothing."""
    import json
    import subprocess
    import sys

    streams = cal.measurements["streams"]
    assert streams["before"] is not None and streams["after"] >= streams["before"]
    assert cal.stream_pool_bytes == streams["after"] - streams["before"]
    done = subprocess.run(
        [sys.executable, "-c", _STREAMS_CHILD], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after_first, after_second = json.loads(done.stdout.splitlines()[-1])
    assert abs((after_first - before) - cal.stream_pool_bytes) <= 4 * MiB
    assert abs(after_second - after_first) <= 2 * MiB
