"""Running one real probe, and keeping the model's state safe while probes run.

A probe runs ``step`` a few times, each on a batch of its own, under a
:meth:`Device.peak_meter <vramctl.Device.peak_meter>`, and reports the peak device-level used bytes,
or an out-of-memory error. What a failed probe held is freed outside the
``except`` block (its frames are cleared first), so nothing it made is alive
when the next probe starts.

>>> import torch, vramctl
>>> from vramctl.fit._probe import Prober
>>> with vramctl.simulate("16MiB") as gpu:
...     model = torch.nn.Linear(256, 256)
...     probe = Prober(lambda x: model(x).sum().backward(), lambda b: torch.randn(b, 256),
...                    gpu, budget=8 * 2**20, steps=1, owners=[model])
...     small, big = probe(64), probe(100_000)
>>> small.fits, small.peak is not None, big.fits, big.peak
(True, True, False, None)
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from vramctl.device import Device
from vramctl.fit._result import FitError
from vramctl.fit._search import Probe
from vramctl.guard import is_oom, release
from vramctl.guard._shared import OomCounters, requested_bytes

__all__ = ["Prober", "preserved", "rng_kept", "to_host"]


_MISSING = object()


class _BatchError(Exception):
    pass


def _run(step: Callable[[Any], Any], make_batch: Callable[[int], Any], b: int, n: int) -> None:
    """One probe's work in its own frame, so that nothing it made outlives it: ``n`` steps,
    each on a batch of its own made after the last one was let go, as a training loop
    takes them. (Steps on one batch can fit where a loop's do not: the caching allocator
    serves each new batch from the blocks the steps before it left cached and split.)"""
    for _ in range(n):
        try:
            batch = make_batch(b)
        except Exception as exc:
            if is_oom(exc):
                raise
            raise _BatchError(f"make_batch({b}) failed: {type(exc).__name__}: {exc}") from exc
        step(batch)
        del batch


def _settle(device: Device) -> None:
    """Before a probe: collect young cycles, and on CUDA give back the allocator's cache.

    A probe's peak is measured from what is held when it starts: blocks a larger
    probe left cached would count in a smaller one's reserved peak. (A full
    collection, slow in a large process, is made only after an OOM: ``release``.)
    """
    gc.collect(1)
    device.release_cache()


class Prober:
    """Runs real probes of ``step`` on ``device`` and measures them."""

    def __init__(
        self,
        step: Callable[[Any], Any],
        make_batch: Callable[[int], Any],
        device: Device,
        budget: int,
        steps: int,
        owners: Sequence[torch.nn.Module | torch.optim.Optimizer],
    ) -> None:
        self.step = step
        self.make_batch = make_batch
        self.device = device
        self.budget = budget
        self.steps = steps
        #: Their gradients are set to None after each probe.
        self.owners = list(owners)
        # A Guard used as the step learns a piece size from an OOM (and to offload
        # activations); every probe starts from what it had, so that no probe runs split,
        # or offloaded, because an earlier one failed.
        self.pieces = _pieces_of(step)

    def __call__(self, b: int) -> Probe:
        dev = self.device
        _set_pieces(self.step, self.pieces)
        _settle(dev)
        base = dev.capacity() - dev.available()
        held = dev.memory().allocated
        counters = OomCounters.read(dev)
        meter = dev.peak_meter()
        failure: BaseException | None = None
        try:
            # under the budget as an allocator cap: a step that fits only once the cache is
            # given back fits (as the answer is later run), not a miss
            with dev.capped(self.budget), meter:
                _run(self.step, self.make_batch, b, self.steps)
        except _BatchError as exc:
            raise FitError(str(exc)) from exc.__cause__
        except Exception as exc:
            if not is_oom(exc, device=dev, counters=counters):
                raise FitError(
                    f"the step failed at batch size {b}: {type(exc).__name__}: {exc}"
                ) from exc
            failure = exc
        oom = failure is not None or counters.rose(dev)  # a step may catch its own OOM
        floor: int | None = None
        if failure is not None:
            floor = meter.peak_used + requested_bytes(failure)
            release(failure, dev)  # outside the except block, so its frames let go
            failure = None
        for owner in self.owners:
            owner.zero_grad(set_to_none=True)
        if oom:
            return Probe(b, None, False, base, floor)
        allocated = held + meter.peak_allocated if isinstance(held, int) else None
        return Probe(b, meter.peak_used, meter.peak_used <= self.budget, base, None, allocated)


# -- state kept safe while probing ------------------------------------------------------


def to_host(obj: Any) -> Any:
    """A deep copy with every tensor copied to host memory (dict subclasses and metadata kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = {} if type(obj) is dict else type(obj)()
        for k, v in obj.items():
            out[k] = to_host(v)
        meta = getattr(obj, "_metadata", None)  # a state_dict's version records
        if meta is not None:
            out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_host(v) for v in obj)
    return copy.deepcopy(obj)


@contextlib.contextmanager
def rng_kept(device: Device) -> Iterator[None]:
    """Put the CPU (and the device's CUDA) random number generator back afterwards."""
    cpu = torch.get_rng_state()
    where = device.torch_device
    gpu = torch.cuda.get_rng_state(where) if device.is_cuda else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, where)


@contextlib.contextmanager
def preserved(
    device: Device,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    step: Any,
) -> Iterator[None]:
    """Copy the trained weights, the buffers and the optimizer state to the host; put them
    back afterwards.

    Frozen weights (a LoRA model's base, a quantized model's packed layers) are not
    copied: no step changes them, and a 4-bit layer's state would not load back through
    ``load_state_dict``. Train/eval flags come back too, gradients are set to None, and a
    :class:`vramctl.Guard` used as the step gets back the piece size it had.
    """
    with device.uncounted():
        model_state = _changing(model) if model is not None else None
        opt_state = to_host(optimizer.state_dict()) if optimizer is not None else None
    modes = [(m, m.training) for m in model.modules()] if model is not None else []
    pieces = _pieces_of(step)
    try:
        yield
    finally:
        if model is not None and model_state is not None:
            with torch.no_grad():
                for tensor, saved in model_state:
                    tensor.copy_(saved)
            model.zero_grad(set_to_none=True)
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(opt_state)
            optimizer.zero_grad(set_to_none=True)
            device.adopt(optimizer)  # a simulated GPU: the state was restored outside its count
        for m, training in modes:
            m.training = training
        _set_pieces(step, pieces)


def _changing(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a step may change of ``model`` (its trained parameters and its buffers), each
    with a copy in host memory."""
    seen: set[int] = set()
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    tensors = [*(p for p in model.parameters() if p.requires_grad), *model.buffers()]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((t, to_host(t)))
    return out


#: What a :class:`vramctl.Guard` learns from an OOM about how to run a step.
_PIECE_STATE = ("piece_limit", "_offloading")


def _pieces_of(step: Any) -> dict[str, Any]:
    return {name: getattr(step, name, _MISSING) for name in _PIECE_STATE}


def _set_pieces(step: Any, pieces: dict[str, Any]) -> None:
    for name, value in pieces.items():
        if value is not _MISSING:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(step, name, value)
