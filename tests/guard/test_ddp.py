"""Two ranks: one runs out of memory, both agree on the split, and the update is exact.

On CPU: gloo, each rank on a simulated GPU. On CUDA (``cuda``-marked): NCCL with a GPU per rank,
and gloo with CUDA tensors (both ranks may share one GPU); the squeezed rank's allocator is
capped with ``torch.cuda.set_per_process_memory_fraction``, so its OOM is CUDA's own.
"""

from __future__ import annotations

import copy
import gc
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import vramctl
from tests.guard.models import loss_fn, make
from vramctl.guard import Guard

N = 256  # samples per rank
#: Samples per rank on CUDA: the whole shard's step adds about 200 MB, well above the
#: allocator's rounding (2 MiB pages, 20 MiB segments), so half of it is a clear squeeze.
N_CUDA = 2**18


def _fwd(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])


def _need(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        base = gpu.allocated_bytes
        loss_fn()(model(batch[0]), batch).backward()
        model.zero_grad(set_to_none=True)
        return base, gpu.peak_bytes - base


def _rank(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, (x, y) = make("mlp", N * world)
    shard = (x[rank * N : (rank + 1) * N], y[rank * N : (rank + 1) * N])
    base, need = _need(copy.deepcopy(model), shard)
    # Rank 0 is squeezed: its whole shard does not fit, pieces do. Rank 1 has room.
    budget = base + (need // 2 if rank == 0 else 4 * need)
    record: dict[str, object] = {}
    ddp = nn.parallel.DistributedDataParallel(model)  # its buckets live outside the budget
    with vramctl.simulate(budget) as gpu:
        gpu.adopt(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        guard = Guard(ddp, opt, loss_fn=loss_fn(), forward=_fwd, device=gpu)
        results = [guard.step(shard) for _ in range(2)]
        record["ooms"] = guard.ooms
        record["pieces"] = [r.pieces for r in results]
        record["piece_limit"] = guard.piece_limit
    record["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


def _check(out: Path, n: int, rtol: float, atol: float) -> None:
    """Rank 0 ran out of memory and rank 1 did not; both split alike; the weights are those of
    one process training on both shards as one batch (on CPU)."""
    r0 = json.loads((out / "rank0.json").read_text())
    r1 = json.loads((out / "rank1.json").read_text())
    assert r0["ooms"] >= 1 and r1["ooms"] == 0  # only rank 0 ran out of memory ...
    assert r0["pieces"] == r1["pieces"] and r0["pieces"][0] > 1  # ... both split alike
    assert r0["piece_limit"] == r1["piece_limit"]
    model, batch = make("mlp", n * 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        loss_fn()(model(batch[0]), batch).backward()
        opt.step()
        opt.zero_grad()
    for got0, got1, want in zip(r0["weights"], r1["weights"], model.parameters(), strict=True):
        assert got0 == got1  # ranks stay identical
        torch.testing.assert_close(
            torch.tensor(got0), want.detach().flatten(), rtol=rtol, atol=atol
        )


def test_two_gloo_ranks_agree_on_the_split_and_match_the_whole_batch(tmp_path: Path) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    _check(tmp_path, N, rtol=1e-5, atol=1e-6)


# -- on CUDA ------------------------------------------------------------------------------


def cuda_ddp_skip_reason(backend: str) -> str | None:
    """Why two ranks cannot run on CUDA with ``backend`` here; None where they can.

    NCCL needs a GPU per rank (it refuses two ranks on one GPU); gloo moves CUDA tensors
    through the host, so both ranks may share one GPU.
    """
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; none is usable here"
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "this PyTorch has no NCCL"
        if (count := torch.cuda.device_count()) < 2:
            return f"NCCL needs a GPU per rank: 2 ranks, {count} GPU visible"
    elif not dist.is_gloo_available():
        return "this PyTorch has no gloo"
    return None


@pytest.mark.parametrize(
    ("available", "count", "nccl", "backend", "runs"),
    [
        (False, 0, True, "nccl", False),
        (False, 0, True, "gloo", False),
        (True, 1, True, "nccl", False),
        (True, 2, True, "nccl", True),
        (True, 8, True, "nccl", True),
        (True, 2, False, "nccl", False),
        (True, 1, True, "gloo", True),
        (True, 2, False, "gloo", True),
    ],
)
def test_the_cuda_ddp_test_runs_where_its_backend_can(
    monkeypatch: pytest.MonkeyPatch,
    available: bool,
    count: int,
    nccl: bool,
    backend: str,
    runs: bool,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(dist, "is_gloo_available", lambda: True)
    reason = cuda_ddp_skip_reason(backend)
    assert (reason is None) == runs
    if not available:
        assert reason is not None and "CUDA GPU" in reason
    elif backend == "nccl" and count < 2:
        assert reason is not None and "a GPU per rank" in reason and f"{count} GPU" in reason


def _cuda_rank(rank: int, world: int, backend: str, store: str, out: str) -> None:
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    dev = torch.device("cuda", index)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    torch.backends.cuda.matmul.allow_tf32 = False  # the CPU reference computes in fp32
    model, (x, y) = make("mlp", N_CUDA * world)
    model = model.to(dev)
    lo, hi = rank * N_CUDA, (rank + 1) * N_CUDA
    shard = (x[lo:hi].to(dev), y[lo:hi].to(dev))
    # What the whole shard's step adds on this GPU, measured on the model itself.
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    held = torch.cuda.memory_allocated(dev)
    loss_fn()(model(shard[0]), shard).backward()
    need = torch.cuda.max_memory_allocated(dev) - held
    model.zero_grad(set_to_none=True)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    guard = Guard(ddp, opt, loss_fn=loss_fn(), forward=_fwd)  # on cuda:index, from the weights
    record: dict[str, Any] = {"kind": guard.device.kind, "device": str(shard[0].device)}
    if rank == 0:
        # Rank 0 is squeezed: its allocator may reserve only half of what the whole shard adds.
        gc.collect()
        torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info(dev)[1]
        room = torch.cuda.memory_reserved(dev) + need // 2
        torch.cuda.set_per_process_memory_fraction(room / total, dev)
    results = [guard.step(shard) for _ in range(2)]
    torch.cuda.set_per_process_memory_fraction(1.0, dev)
    record["ooms"] = guard.ooms
    record["pieces"] = [r.pieces for r in results]
    record["piece_limit"] = guard.piece_limit
    record["weights"] = [p.detach().flatten().cpu().tolist() for p in model.parameters()]
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_two_cuda_ranks_agree_on_a_real_oom_and_match_the_whole_batch(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = cuda_ddp_skip_reason(backend)
    if reason is not None:
        pytest.skip(reason)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # one machine: loopback
        if name not in os.environ:
            monkeypatch.setenv(name, "lo")
    args = (2, backend, str(tmp_path / "store"), str(tmp_path))
    mp.spawn(_cuda_rank, args=args, nprocs=2, join=True)
    count = torch.cuda.device_count()
    for r in (0, 1):
        record = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert record["kind"] in ("cuda", "mig") and record["device"] == f"cuda:{r % count}"
    # CUDA's kernels sum in another order than the CPU reference's, over 2**19 samples.
    _check(tmp_path, N_CUDA, rtol=1e-4, atol=1e-5)
