"""Values of every kind the cache takes, their digests, and a tree of checks on a cache."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from vramctl.cache import TIERS, TensorCache
from vramctl.device._simulate import active_simulation

KiB = 2**10
MiB = 2**20

KINDS = ("float", "int", "bool", "bf16", "nested", "sparse", "empty", "scalar")


def host() -> contextlib.AbstractContextManager[Any]:
    """Host memory: outside the active simulated GPU's count (if there is one)."""
    sim = active_simulation()
    return sim.uncounted() if sim is not None else contextlib.nullcontext()


def _feed(h: Any, t: torch.Tensor) -> None:
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    with host():
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        h.update(raw.numpy().tobytes())


def digest(value: Any) -> str:
    """SHA-256 of a value: its structure, constant leaves, and every tensor's dtype, shape
    and bytes (a sparse COO tensor's indices and values)."""
    h = hashlib.sha256()
    leaves, spec = pytree.tree_flatten(value)
    h.update(str(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.sparse_coo:
            h.update(f"sparse{tuple(leaf.shape)}{leaf.is_coalesced()}".encode())
            _feed(h, leaf._indices())
            _feed(h, leaf._values())
        elif isinstance(leaf, torch.Tensor):
            _feed(h, leaf)
        else:
            h.update(repr((type(leaf).__name__, leaf)).encode())
    return h.hexdigest()


def make(kind: str, seed: int, nbytes: int = 16 * KiB) -> Any:
    """A value of ``kind``, its content fixed by ``seed``, of about ``nbytes`` (host memory)."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // 4)
    with host():
        if kind == "float":
            return torch.randn(n, generator=g)
        if kind == "int":  # small values: zstd shrinks them a lot
            return torch.randint(0, 4, (max(1, nbytes // 8),), generator=g)
        if kind == "bool":
            return torch.rand(nbytes, generator=g) < 0.5
        if kind == "bf16":
            return torch.randn(max(1, nbytes // 2), generator=g).to(torch.bfloat16)
        if kind == "nested":
            return {
                "x": torch.randn(n // 2, generator=g),
                "ids": [torch.randint(0, 9, (n // 4,), generator=g), seed, "name-" + str(seed)],
                "pair": (torch.rand(16, generator=g) < 0.5, 7, None),
            }
        if kind == "sparse":
            nnz = max(1, nbytes // 32)
            idx = torch.randint(0, 64, (2, nnz), generator=g)
            vals = torch.randn(nnz, generator=g)
            return torch.sparse_coo_tensor(idx, vals, (64, 64), check_invariants=True)
        if kind == "empty":
            return torch.empty(0, 5)
        if kind == "scalar":
            return torch.tensor(float(seed) + 0.25)
    raise ValueError(kind)


def tensor_bytes(value: Any) -> int:
    """Bytes of a value's tensors (a sparse tensor's indices and values)."""
    total = 0
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.sparse_coo:
            total += leaf._indices().nbytes + leaf._values().nbytes
        elif isinstance(leaf, torch.Tensor):
            total += leaf.nbytes
    return total


def held_on(gpu: Any, *values: Any) -> int:
    """Bytes of ``values``' tensors (and of sparse tensors' indices and values) that the
    simulated ``gpu`` counts: what the test itself holds there."""
    with gpu.uncounted():
        parts: list[torch.Tensor] = []
        for leaf in pytree.tree_leaves(list(values)):
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.sparse_coo:
                parts += [leaf._indices(), leaf._values()]
            elif isinstance(leaf, torch.Tensor):
                parts.append(leaf)
        return int(gpu.holds(parts))


def disk_bytes(directory: Path) -> int:
    """Bytes of every file in ``directory`` (temporary files too)."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def check_budgets(
    cache: TensorCache,
    *,
    gpu: Any = None,
    held: int = 0,
    disk_dir: Path | None = None,
    limits: bool = False,
) -> None:
    """Every tier within its budget (``limits``: within its limit), by the cache's count and
    by what it really takes: the host pool's segments, the simulated ``gpu``'s live
    storages (less the ``held`` bytes the test itself holds there), the files in
    ``disk_dir``."""
    bound = cache.limit if limits else cache.budget
    for t in TIERS:
        assert cache.used[t] <= bound[t], (t, cache.used[t], bound[t])
    assert cache.pool.held <= cache.budget["host"], (cache.pool.held, cache.budget["host"])
    if gpu is not None:
        on_gpu = gpu.allocated_bytes - held
        assert on_gpu <= bound["gpu"], (on_gpu, bound["gpu"])
    if disk_dir is not None:
        on_disk = disk_bytes(disk_dir)
        assert on_disk <= bound["disk"], (on_disk, bound["disk"])
    assert cache.stats()["budget_violations"] == 0
