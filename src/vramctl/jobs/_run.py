"""The bootstrap of a job given as a Python entry point: ``python -m vramctl.jobs._run
module:function [ARG ...]``.

Before the job's own code runs it holds the process to its share: on a simulated device
the function runs inside ``vramctl.simulate(<its reservation>)`` (a real budget with real
out-of-memory errors), and on a CUDA device PyTorch's allocator is capped at the
reservation (``torch.cuda.set_per_process_memory_fraction``), so a job that outgrows its
share gets an out-of-memory error in its own process and never takes a neighbour's memory.
The function is called with no arguments and ``sys.argv`` set to ``[entry_point, *ARGS]``;
an int it returns is the exit status.

When the spec asks for a guard (``$VRAMCTL_GUARD``, the spec's ``guard`` table as JSON),
the function it names is replaced, once its module is imported, by one that runs under
:func:`vramctl.guarded` (see :func:`guard_module`): a batch that runs out of memory in
the job's share runs in pieces instead of failing the job.

When the job's supervisor sets ``$VRAMCTL_PEAK_FILE``, a process held to its share writes
its allocator's peak there when it exits (``$VRAMCTL_PEAK_FILE.<pid>``, in bytes): on a
CUDA device ``torch.cuda.max_memory_reserved``, on a simulated device the simulated
allocator's peak. The supervisor records it as the job's peak.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "ENV_GUARD",
    "ENV_PEAK_FILE",
    "guard_module",
    "hold_process",
    "load_entry_point",
    "main",
    "write_peak",
]

#: Set by the supervisor: where this process writes its allocator's peak (``<it>.<pid>``).
ENV_PEAK_FILE = "VRAMCTL_PEAK_FILE"

#: Set by the supervisor when the spec has a guard: its ``guard`` table as JSON.
ENV_GUARD = "VRAMCTL_GUARD"

#: The simulation a command's process is held in, entered for the rest of its life.
_HELD: list[Any] = []


def _attribute(text: str | None) -> Any:
    """The object named by ``module:attribute`` (``attribute`` may be dotted; None for
    None)."""
    if text is None:
        return None
    module_name, _, attr = text.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_entry_point(text: str) -> Callable[[], Any]:
    """The function named by ``module:function`` (``function`` may be dotted)."""
    obj = _attribute(text)
    if not callable(obj):
        raise TypeError(f"{text} is not callable")
    return obj  # type: ignore[no-any-return]


class _JobGuard:
    """The job's function of a batch, run by a guard made at its first call (so that an
    optimizer the job makes after importing the function is there to be found)."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self.guarded: Any = None
        atexit.register(self.report)

    def __call__(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if self.guarded is None:
            import vramctl

            optimizer = _attribute(self.options.get("optimizer"))
            model = _attribute(self.options.get("model"))
            train = optimizer is not None or model is not None
            self.guarded = vramctl.guarded(self.fn, optimizer=optimizer, model=model, train=train)
        return self.guarded(batch, *args, **kwargs)

    def report(self) -> None:
        """One line in the job's log when the guard saved a step from running out."""
        if self.guarded is None or not self.guarded.guard.ooms:
            return
        g = self.guarded.guard
        sys.stderr.write(
            f"vramctl: the guard of {self.options['function']} ran {g.split_steps} of "
            f"{g.steps} steps in pieces after {g.ooms} out-of-memory errors "
            f"(pieces of at most {g.piece_limit} samples now)\n"
        )


def guard_module(module: Any, options: dict[str, Any]) -> None:
    """Replace the function ``options["function"]`` names in ``module`` (its module,
    imported) by one run under :func:`vramctl.guarded`; done once."""
    attr = options["function"].partition(":")[2]
    *parents, name = attr.split(".")
    owner = module
    for part in parents:
        owner = getattr(owner, part)
    fn = getattr(owner, name)
    if not isinstance(fn, _JobGuard):
        setattr(owner, name, _JobGuard(fn, options))


def hold_process(device: str, reserved: int) -> None:
    """Hold the rest of this process's life to ``reserved`` bytes of ``device``: the
    bootstrap of a Python command calls it once ``torch`` is imported.

    On a CUDA device the cap is set when CUDA starts (PyTorch's lazy initialisation), so
    importing torch alone starts no CUDA context; on a simulated device the process enters
    ``vramctl.simulate(reserved)`` and stays in it. With ``$VRAMCTL_PEAK_FILE`` set, the
    process writes its allocator's peak when it exits (see :func:`write_peak`).
    """
    if reserved <= 0 or device == "cpu":
        return
    prefix = os.environ.get(ENV_PEAK_FILE)
    if prefix:
        _mark_out_of_memory(prefix, os.getpid())
    if device.startswith("sim:"):
        import vramctl

        sim = vramctl.simulate(reserved)
        sim.__enter__()
        _HELD.append(sim)
        if prefix:
            atexit.register(write_peak, prefix, lambda: sim.peak_bytes, os.getpid())
        return
    if device.startswith("cuda:"):
        import torch

        def allocator_peak() -> int:
            if not torch.cuda.is_initialized():
                return 0
            count = torch.cuda.device_count()
            return sum(int(torch.cuda.max_memory_reserved(i)) for i in range(count))

        if prefix:
            atexit.register(write_peak, prefix, allocator_peak, os.getpid())

        def cap() -> None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, reserved / total), 0)

        if torch.cuda.is_initialized():
            cap()
            return
        start: Callable[[], None] = torch.cuda._lazy_init
        depth = [0]

        def lazy_init() -> None:
            # Calls queued for CUDA's start run inside it and may call back here: only the
            # outermost call, once CUDA has started, sets the cap (and restores the original).
            depth[0] += 1
            try:
                start()
            finally:
                depth[0] -= 1
            if depth[0] == 0 and torch.cuda.is_initialized():
                torch.cuda._lazy_init = start
                cap()

        torch.cuda._lazy_init = lazy_init


def _mark_out_of_memory(prefix: str, pid: int) -> None:
    """When an out-of-memory error ends this process, write the bytes it asked for to
    ``<prefix>.<pid>.oom``: the supervisor reads the job's failure as an overrun of its
    share (an error the job caught and lived through is not one)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            import torch

            if os.getpid() == pid and isinstance(exc, torch.OutOfMemoryError):
                from vramctl.guard._shared import requested_bytes

                path = f"{prefix}.{pid}.oom"
                with open(f"{path}.tmp", "w") as f:
                    f.write(f"{requested_bytes(exc)}\n")
                os.replace(f"{path}.tmp", path)
        except Exception:  # a lost marker leaves the failure an ordinary one
            pass
        previous(kind, exc, tb)

    sys.excepthook = hook


def write_peak(prefix: str, read: Callable[[], int], pid: int | None = None) -> None:
    """Write ``read()`` (this process's allocator peak, in bytes) to ``<prefix>.<pid>``, for
    the job's supervisor; a reading or a write that fails writes nothing, and so does a
    process forked from ``pid`` (its copy of the reading is its parent's)."""
    if pid is not None and os.getpid() != pid:
        return
    try:
        peak = int(read())
        path = f"{prefix}.{os.getpid()}"
        with open(f"{path}.tmp", "w") as f:
            f.write(f"{peak}\n")
        os.replace(f"{path}.tmp", path)  # whole or not at all
    except Exception:  # at exit: a lost reading must not turn into a failed job
        return


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m vramctl.jobs._run module:function [ARG ...]", file=sys.stderr)
        return 2
    guard = os.environ.get(ENV_GUARD)
    if guard:
        options = json.loads(guard)
        guard_module(importlib.import_module(options["function"].partition(":")[0]), options)
    fn = load_entry_point(args[0])
    sys.argv = [args[0], *args[1:]]
    device = os.environ.get("VRAMCTL_DEVICE", "cpu")
    reserved = int(os.environ.get("VRAMCTL_RESERVED_BYTES", "0") or 0)
    hold_process(device, reserved)
    result = fn()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
