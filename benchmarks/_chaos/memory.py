"""Where a loop runs (a simulated GPU, the real GPU, the plain CPU), and its checkpoints.

A ``Session`` says where tensors live and how the memory is read: the plain CPU (no
budget: the references and the overhead timing), a simulated GPU of a given budget
(``vramctl.simulate``: real allocations, real OOMs, on the CPU), or this machine's GPU
shrunk by a ballast (in chunks, measured). ``Pressure`` is the budget a loop is given
and the most the co-tenant may take of it.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import vramctl
from vramctl.device import SimulatedDevice

from .workload import Data


class Session:
    """The plain CPU: no budget. The reference runs and the overhead timing use it."""

    def __init__(self) -> None:
        self.device: Any = vramctl.get_device("cpu")

    def adopt(self, model: nn.Module) -> None:
        pass

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def grab(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    def host(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def sync(self) -> None:
        pass

    def allocated(self) -> int:
        return 0

    def footprint(self) -> int:
        """What this process holds on the device now: the base a budget starts from."""
        return self.allocated()

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int:
        return 0

    def adopt_optimizer(self, opt: torch.optim.Optimizer) -> None:
        pass


class SimSession(Session):
    """A simulated GPU of ``budget`` bytes: real allocations, real OOMs, on the CPU."""

    def __init__(self, gpu: SimulatedDevice) -> None:
        self.device = gpu
        self.gpu = gpu

    def adopt(self, model: nn.Module) -> None:
        self.gpu.adopt(model)

    def adopt_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self.gpu.adopt(opt)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()  # the copy to the device: counted, and refused when it does not fit

    def grab(self, n: int) -> torch.Tensor:
        block = torch.empty(n, dtype=torch.uint8)
        self.gpu.adopt(block)  # refused (an OOM) when it does not fit
        return block

    def host(self) -> contextlib.AbstractContextManager[Any]:
        return self.gpu.host()

    def allocated(self) -> int:
        return int(self.gpu.allocated_bytes)

    def reset_peak(self) -> None:
        self.gpu.reset_peak()

    def peak(self) -> int:
        return int(self.gpu.peak_bytes)


#: The ballast is taken in chunks of at most this (one block of all the free memory of a
#: large GPU may be refused although ``mem_get_info`` counts it free), ...
BALLAST_CHUNK = 1 << 30
#: ... and of at least this: the caching allocator gives a 1 to 10 MiB request a 20 MiB
#: segment; from 10 MiB on, the request rounded up to 2 MiB.
BALLAST_MIN = 10 << 20
_PAGE = 2 << 20


class CudaSession(Session):
    """The real GPU; a ballast leaves this process ``budget`` bytes in all.

    On the GPU a budget counts what the device gives the process, its caching
    allocator's reserved segments, not the bytes of its live tensors: a 4 MiB
    tensor takes a 20 MiB segment, and every tick of a process co-tenant empties
    the cache. ``footprint`` and ``peak`` read reserved bytes, the cache emptied first.
    """

    def __init__(self) -> None:
        self.device = vramctl.get_device(0)
        self.ballast: list[torch.Tensor] = []
        self.room_error = 0  # free memory after the ballast, less the free memory wanted

    def limit(self, budget: int) -> None:
        """Take the free memory but ``budget`` less this process's reserved bytes.

        In chunks, each allocation measured with ``mem_get_info`` afterwards, so that
        what the driver keeps for itself is counted too; a refused chunk is halved.
        Ends within 2 MiB above the target (``room_error``), in a bounded number of steps.
        """
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        target = budget - int(torch.cuda.memory_reserved())
        chunk = BALLAST_CHUNK
        while chunk >= BALLAST_MIN:
            excess = int(torch.cuda.mem_get_info()[0]) - target
            size = min(chunk, excess) // _PAGE * _PAGE
            if size < BALLAST_MIN:
                break
            try:
                self.ballast.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                chunk = size // 2
        for _ in range(16):  # the last MiBs: 1 MiB blocks, two to a 2 MiB small segment
            if int(torch.cuda.mem_get_info()[0]) - target < _PAGE:
                break
            try:
                self.ballast.append(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
        self.room_error = int(torch.cuda.mem_get_info()[0]) - target
        if abs(self.room_error) > 4 * _PAGE:
            print(
                f"warning: the ballast leaves {vramctl.format_bytes(self.room_error)} more "
                "free than planned",
                file=sys.stderr,
                flush=True,
            )

    def adopt(self, model: nn.Module) -> None:
        model.to("cuda")

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cuda")

    def grab(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, device="cuda")

    def sync(self) -> None:
        torch.cuda.synchronize()

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated())

    def footprint(self) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_reserved())

    def reset_peak(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # cold, as after a process co-tenant's tick
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_reserved())


@contextlib.contextmanager
def session(kind: str, budget: int | None) -> Iterator[Session]:
    """``kind`` is "sim", "cuda" or "cpu"; ``budget=None`` is a device with no pressure."""
    if kind == "cpu":
        yield Session()
    elif kind == "sim":
        with vramctl.simulate(budget if budget is not None else 1 << 40) as gpu:
            yield SimSession(gpu)
    else:
        s = CudaSession()
        try:
            yield s
        finally:
            s.ballast = []
            gc.collect()
            torch.cuda.empty_cache()


@dataclass
class Pressure:
    """The budget of a loop and the co-tenant's ceiling, from the step's measured need."""

    base: int  # parameters, buffers, optimizer state
    need_full: int  # a whole-batch step above the base (the batch's copy included)
    need_quarter: int  # the same batch run in quarters
    room: int
    ceiling: int

    @property
    def budget(self) -> int:
        return self.base + self.room

    @property
    def full_fails_above(self) -> int:
        return self.room - self.need_full


# -- batches and checkpoints -------------------------------------------------------------


def load(s: Session, data: Data, e: int, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
    """Batch ``lo:hi`` of epoch ``e``, copied to the device: inputs, targets, and each
    sample's place in the batch (for the tally)."""
    with s.host():
        idx = data.orders[e % len(data.orders)][lo:hi]
        x, y, place = data.x[idx], data.y[idx], torch.arange(hi - lo)
    return s.put(x), s.put(y), s.put(place)


def load_infer(s: Session, data: Data, lo: int, hi: int) -> torch.Tensor:
    with s.host():
        x = data.x[lo:hi].clone()
    return s.put(x)


def host_copy(s: Session, t: torch.Tensor) -> torch.Tensor:
    with s.host():
        return t.detach().to("cpu", copy=True)


def to_host(tree: Any) -> Any:
    """A copy of every tensor in ``tree`` in host memory (a checkpoint)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_host(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_host(v) for v in tree)
    return tree


@dataclass
class Checkpoint:
    step: int
    model: dict[str, Any]
    optimizer: dict[str, Any]


def checkpoint(s: Session, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Checkpoint:
    with s.host():
        return Checkpoint(step, to_host(model.state_dict()), to_host(opt.state_dict()))


def restore(s: Session, ck: Checkpoint, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load a checkpoint in place: the parameters are copied into, the optimizer state reloaded."""
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.load_state_dict(ck.model)  # copies into the device's parameters
    with s.host():
        fresh = to_host(ck.optimizer)  # the optimizer keeps the tensors it is given
    opt.load_state_dict(fresh)  # on CUDA: moved to the parameters' device
    s.adopt_optimizer(opt)  # on the simulated GPU: counted, as a copy to the GPU is
