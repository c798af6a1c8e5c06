"""One rank's estimate against NCCL on a real GPU: DDP and FSDP2 in this process (one rank on
the GPU it has), and two ranks where the machine has two GPUs.

A rank of a larger world holds less (its shards), but the wrappers' buffers, buckets and
gathers are the same code; one rank on NCCL checks the CUDA side of what the CPU runs with gloo
check for 2 and 4 ranks (test_distributed_truth.py).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vramctl.estimator import Parallel, estimate, parallelize
from vramctl.estimator._spec import StepSpec, run_step, warm_optimizer

pytestmark = pytest.mark.cuda


class Blocks(nn.Module):
    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.float().pow(2).mean()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("layout", ["ddp:1", "ddp:1,gradient_as_bucket_view", "fsdp:1"])
def test_one_nccl_rank_matches_its_estimate(layout: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    par = Parallel.parse(layout)
    x = torch.randn(64, 1024)
    est = estimate(Blocks(), x, device="cuda:0", loss_fn=_loss, parallel=par, calibration=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        torch.manual_seed(0)
        model = Blocks().cuda()
        wrapped = parallelize(model, par)
        spec = StepSpec(autocast_device="cuda", foreach=True, loss_fn=_loss)
        params = [p for p in wrapped.parameters() if p.requires_grad]
        opt = spec.make_optimizer(params)
        assert opt is not None
        warm_optimizer(opt, params)
        xc = x.cuda()
        for _ in range(2):
            run_step(wrapped, xc, spec, opt)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run_step(wrapped, xc, spec, opt)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
    finally:
        dist.destroy_process_group()
    assert est.peak_allocated == pytest.approx(measured, rel=0.06)
