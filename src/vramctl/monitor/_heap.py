"""What the leak detector reads: the memory this process has allocated, from PyTorch's CUDA
caching allocator on a GPU, and on the CPU from glibc's malloc counters (``mallinfo2``) where
they see tensors, else the process's resident set size.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import psutil
import torch

__all__ = ["PROBE_BYTES", "CpuSignal", "cpu_signal", "cuda_reader"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_reader() -> Callable[[], int] | None:
    """glibc's bytes in use by malloc (heap chunks plus mmapped chunks), or None without glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # musl, or glibc older than 2.33
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []

    def read() -> int:
        m = fn()
        return int(m.uordblks + m.hblkhd)

    return read


#: The CPU tensor that checks glibc's counters see tensors (bytes).
PROBE_BYTES = 4 * 2**20


class _ProbeFailed(Exception):
    """The probe could not be allocated: nothing learned, to be tried again later."""


def _malloc_sees_tensors(read: Callable[[], int]) -> bool:
    """True when a 4 MiB CPU tensor shows in ``read``: not so under a preloaded jemalloc or
    tcmalloc, whose allocations glibc's counters never see. :class:`_ProbeFailed` when
    the probe cannot be allocated (a process near its memory limit): the caller's step
    must not fail for a check of the monitor's own."""
    before = read()
    try:
        probe = torch.empty(PROBE_BYTES, dtype=torch.uint8)
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        first = (str(exc).strip().splitlines() or [""])[0]
        raise _ProbeFailed(
            f"glibc's malloc counters unchecked: their {PROBE_BYTES >> 20} MiB probe tensor"
            f" could not be allocated ({type(exc).__name__}: {first}); the next detector"
            " tries again"
        ) from None
    seen = read() - before
    del probe
    return seen >= PROBE_BYTES


def _rss_reader() -> tuple[str, Callable[[], int]]:
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        page = os.sysconf("SC_PAGE_SIZE")
        int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError, AttributeError):
        proc = psutil.Process()

        def read_psutil() -> int:
            return int(proc.memory_info().rss)

        return "process RSS (psutil)", read_psutil

    def read() -> int:  # about 2 us, where psutil takes about 13
        return int(os.pread(fd, 128, 0).split()[1]) * page

    return "process RSS (/proc/self/statm)", read


class CpuSignal(NamedTuple):
    """What the CPU side reads: its name, the reader, and ``note``, why glibc's malloc
    counters (the exact reading) are not read, or None when they are or cannot be
    (without glibc)."""

    name: str
    read: Callable[[], int]
    note: str | None


@functools.lru_cache(maxsize=1)
def _lasting_signal() -> CpuSignal:
    """The CPU's signal, found once (:class:`_ProbeFailed`, not kept, when the probe could
    not be allocated)."""
    malloc = _malloc_reader()
    if malloc is None:
        return CpuSignal(*_rss_reader(), None)
    if _malloc_sees_tensors(malloc):
        return CpuSignal("malloc in use (glibc mallinfo2)", malloc, None)
    return CpuSignal(
        *_rss_reader(),
        "glibc's malloc counters do not see a CPU tensor (a preloaded jemalloc or tcmalloc?)",
    )


def cpu_signal() -> CpuSignal:
    """What the CPU side reads: glibc's malloc counters where they see tensors, else RSS.

    Finding out takes a 4 MiB tensor, once per process. Where it cannot be allocated
    the process's RSS is read (it needs no allocation, and sees tensors once written) and
    ``note`` says why; the probe is tried again the next time (a later detector)."""
    try:
        return _lasting_signal()
    except _ProbeFailed as exc:
        return CpuSignal(*_rss_reader(), str(exc))


def cuda_reader(index: int) -> Callable[[], int]:
    def read() -> int:
        # The nested form skips memory_allocated's flattening of every statistic.
        stats = torch.cuda.memory_stats_as_nested_dict(index)
        try:
            return int(stats["allocated_bytes"]["all"]["current"])
        except (KeyError, TypeError):
            return int(torch.cuda.memory_allocated(index))

    return read
