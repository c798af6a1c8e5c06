"""The bootstrap of a job given as a Python entry point: ``python -m vramctl.jobs._run
module:function [ARG ...]``.

Before the job's own code runs it holds the process to its share: on a simulated device
the function runs inside ``vramctl.simulate(<its reservation>)`` (a real budget with real
out-of-memory errors), and on a CUDA device PyTorch's allocator is capped at the
reservation (``torch.cuda.set_per_process_memory_fraction``), so a job that outgrows its
share gets an out-of-memory error in its own process and never takes a neighbour's memory.
The function is called with no arguments and ``sys.argv`` set to ``[entry_point, *ARGS]``;
an int it returns is the exit status.

When the job's supervisor sets ``$VRAMCTL_PEAK_FILE``, a process held to its share writes
its allocator's peak there when it exits (``$VRAMCTL_PEAK_FILE.<pid>``, in bytes): on a
CUDA device ``torch.cuda.max_memory_reserved``, on a simulated device the simulated
allocator's peak. The supervisor records it as the job's peak.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "ENV_PEAK_FILE",
    "hold_process",
    "load_entry_point",
    "main",
    "mark_held",
    "write_peak",
]

#: Set by the supervisor: where this process writes its allocator's peak (``<it>.<pid>``).
ENV_PEAK_FILE = "VRAMCTL_PEAK_FILE"

#: The simulation a command's process is held in, entered for the rest of its life.
_HELD: list[Any] = []


def load_entry_point(text: str) -> Callable[[], Any]:
    """The function named by ``module:function`` (``function`` may be dotted)."""
    module_name, _, attr = text.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{text} is not callable")
    return obj  # type: ignore[no-any-return]


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
            mark_held(prefix)

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


def mark_held(prefix: str) -> None:
    """Leave ``held.<pid>`` beside ``prefix``: this process is capped by its allocator, so
    the supervisor's NVML watch leaves its stopping to the cap (NVML's figure also counts
    the CUDA context, which the cap does not)."""
    folder = os.path.dirname(prefix) or "."
    with contextlib.suppress(OSError):
        open(os.path.join(folder, f"held.{os.getpid()}"), "w").close()


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
    fn = load_entry_point(args[0])
    sys.argv = [args[0], *args[1:]]
    device = os.environ.get("VRAMCTL_DEVICE", "cpu")
    reserved = int(os.environ.get("VRAMCTL_RESERVED_BYTES", "0") or 0)
    hold_process(device, reserved)
    result = fn()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
