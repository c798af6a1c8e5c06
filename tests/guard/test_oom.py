"""Recognising OOMs, and splitting batches without losing or repeating a sample."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

import vramctl
from vramctl.guard import is_oom
from vramctl.guard._oom import OomCounters
from vramctl.guard._split import merge_outputs, piece_sizes, split_batch


def test_types_and_messages_are_recognised() -> None:
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(MemoryError())
    for text in (
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory",
        "CUDA error: out of memory",
    ):
        assert is_oom(RuntimeError(text)), text
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom(ValueError("out of range"))


def test_a_real_cpu_allocator_failure_is_recognised() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_oom(info.value)


def test_a_wrapped_oom_is_recognised_through_its_cause() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("worker failed") from inner
    except RuntimeError as outer:
        assert is_oom(outer)


def test_the_allocator_counter_tells_an_oom_whatever_the_message() -> None:
    with vramctl.simulate("1MiB") as gpu:
        counters = OomCounters.read(gpu)
        with contextlib.suppress(torch.OutOfMemoryError):
            torch.zeros(1 << 20)  # 4 MiB: refused
        # A library that re-raises the failure as its own error, with its own words:
        assert is_oom(RuntimeError("kernel launch failed"), device=gpu, counters=counters)
        assert not is_oom(
            RuntimeError("kernel launch failed"), device=gpu, counters=OomCounters.read(gpu)
        )


def test_counters_are_read_only_where_an_allocator_keeps_them() -> None:
    assert not OomCounters.kept(vramctl.get_device("cpu"))  # the host's read zero: skipped
    assert not OomCounters.kept(None)
    with vramctl.simulate("1MiB") as gpu:
        assert OomCounters.kept(gpu)


@dataclass
class Sample:
    x: torch.Tensor
    names: list[str]


Pair = namedtuple("Pair", ["x", "y"])


@pytest.mark.parametrize("n", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 64])
def test_every_sample_is_in_exactly_one_piece_in_order(n: int, k: int) -> None:
    ids = torch.arange(n)
    batch = {
        "pair": Pair(ids.clone(), ids * 2),
        "sample": Sample(ids.view(n, 1).float(), [f"s{i}" for i in range(n)]),
        "shared": torch.ones(3),  # not batch-shaped: every piece gets it whole
        "flag": True,
    }
    pieces = split_batch(batch, k)
    assert [len(p["pair"].x) for p in pieces] == piece_sizes(n, k)
    assert torch.cat([p["pair"].x for p in pieces]).tolist() == list(range(n))
    assert [s for p in pieces for s in p["sample"].names] == [f"s{i}" for i in range(n)]
    assert all(p["shared"].shape == (3,) and p["flag"] is True for p in pieces)
    assert all(isinstance(p["pair"], Pair) for p in pieces)
    merged = merge_outputs([p["sample"] for p in pieces], [len(p["pair"].x) for p in pieces])
    assert merged.names == batch["sample"].names
    torch.testing.assert_close(merged.x, batch["sample"].x)


def test_a_batch_without_tensors_is_refused_clearly() -> None:
    with pytest.raises(vramctl.VramctlError, match="no tensor"):
        split_batch({"a": [1, 2]}, 2)


CHILD = textwrap.dedent(
    """
    import resource, sys, torch, vramctl
    torch.set_num_threads(1)
    n, width = 64, 1 << 17          # the whole batch's intermediate: 64 x 128 Ki x 4 B = 32 MiB
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(0))
    w = torch.randn(16, width, generator=torch.Generator().manual_seed(1))

    def score(batch):
        return (batch @ w).relu().sum(dim=1)

    want = torch.cat([score(x[i : i + 1]) for i in range(n)])
    # Everything the guard imports loads before the limit, so only the batch's
    # intermediates compete for the address space left.
    guarded = vramctl.guarded(score, device="cpu")
    guarded(x[:1])
    is_oom = vramctl.is_oom
    vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1])
    limit = vm * 1024 + (12 << 20)  # 12 MiB of address space to spare
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        score(x)
        print("WHOLE-FITS")
    except RuntimeError as exc:
        print("WHOLE-FAILS", is_oom(exc))
    got = guarded(x)
    print("MATCH", torch.allclose(got, want, rtol=1e-5), guarded.summary()["ooms"])
    """
)


def test_a_child_under_an_address_space_limit_finishes_in_pieces() -> None:
    # glibc otherwise raises its mmap threshold as large blocks are freed, and serves them
    # from a heap that grows by about a MiB a step: the address space left under the limit
    # then depends on the allocation history, and a piece of one sample can fail. A fixed
    # threshold maps every block of 64 KiB or more and gives it back when it is freed.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    assert "WHOLE-FAILS True" in lines
    match = next(line for line in lines if line.startswith("MATCH"))
    assert match.split()[1] == "True" and int(match.split()[2]) >= 1
