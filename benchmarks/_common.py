"""What the benchmarks share: their command line, their JSON last line, the peers' set-up.

Each benchmark is run as a script (``python benchmarks/X.py``), so this folder is on
``sys.path`` and ``import _common`` finds this module. torch and the peers (Accelerate,
Lightning, Lhotse) are imported only by the functions that use them, so that
``gpu_suite.py`` and ``estimate_speed.py`` start without them.

    ap = _common.parser(__doc__, quick="two models; under a minute", cuda="on this GPU")
    args = _common.parse(ap, argv)   # --cuda where no GPU is usable: exit status 2
    ...
    return _common.finish(summary, ok)   # the figures as one JSON line; 0 when ok, else 1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import platform
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

EPILOG = "The last line printed is one JSON object with the figures."
THREADS_HELP = "torch CPU threads, fixed for stable timings"


# -- the command line and the summary ------------------------------------------------------


def parser(
    doc: str | None,
    *,
    quick: str,
    cuda: str | None = None,
    seed: str | None = None,
    threads: bool = False,
) -> argparse.ArgumentParser:
    """``--quick``, and ``--cuda``, ``--seed`` and ``--threads`` where asked for.

    The description is the first paragraph of the benchmark's docstring.
    """
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0], epilog=EPILOG)
    ap.add_argument("--quick", action="store_true", help=quick)
    if cuda is not None:
        ap.add_argument("--cuda", action="store_true", help=cuda)
    if seed is not None:
        ap.add_argument("--seed", type=int, default=0, help=seed)
    if threads:
        ap.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments; exits with status 2 on ``--cuda`` where no CUDA device is usable.

    Sets torch's CPU threads to ``--threads`` where the benchmark has that flag.
    """
    args = ap.parse_args(argv)
    if getattr(args, "cuda", False):
        import torch

        if not torch.cuda.is_available():
            print("--cuda: no usable CUDA device on this machine", file=sys.stderr)
            raise SystemExit(2)
    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)
    return args


def machine(cuda: bool) -> dict[str, Any]:
    """``device`` (the GPU's name with ``cuda``, else the CPU's), ``threads`` and ``torch``."""
    import torch

    return {
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def version(module: str) -> str | None:
    """A peer's version (``accelerate``, ``lhotse`` ...), or None when it is not installed."""
    try:
        return str(importlib.import_module(module).__version__)
    except ImportError:
        return None


def driver_version() -> str | None:
    """The NVIDIA driver's version (NVML), or None when it cannot be read."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            got = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return got.decode() if isinstance(got, bytes) else str(got)


def finish(summary: dict[str, Any], ok: bool = True) -> int:
    """Print ``summary`` as the last line (one JSON object); the exit status: 0 if ``ok``."""
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


def last_json(text: str) -> Any:
    """The last line of ``text`` that is a JSON object (a benchmark's figures), or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


# -- the CPU truth of a step ---------------------------------------------------------------


def storages_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a wrapper subclass, such as
    torchao's quantized weights, by the plain tensors it holds)."""
    seen: dict[int, int] = {}
    todo = list(tensors)
    while todo:
        t = todo.pop()
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None:
            names, _ = t.__tensor_flatten__()
            todo += [getattr(t, n) for n in names]
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def held_tensors(model: Any, data: Any, opt: Any) -> list[Any]:
    """What a step holds before it starts: parameters, buffers, inputs, optimizer state."""
    import torch
    from torch.utils._pytree import tree_leaves

    held = list(model.parameters()) + list(model.buffers())
    held += [t for t in tree_leaves(data) if isinstance(t, torch.Tensor)]
    if opt is not None:
        held += [
            v
            for st in opt.state.values()
            for k, v in st.items()
            if isinstance(v, torch.Tensor) and not (k == "step" and v.numel() == 1)
        ]
    return held


def profiled_peak(run: Callable[[], Any]) -> int:
    """The peak of PyTorch's profiler memory timeline (CREATE and DESTROY events) while
    ``run()`` runs on the CPU: what it allocates at most, kernels' scratch included."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        run()
    live = peak = 0
    for _t, action, _key, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def kept_tensors(model: Any) -> dict[int, int]:
    """Bytes by storage of the tensors a model's modules hold outside their parameters and
    buffers: in a plain attribute, or a dict, list or tuple in one (a cache a forward made
    and kept, as LeViT's attention biases in eval mode)."""
    import torch
    from torch.utils._pytree import tree_leaves

    out: dict[int, int] = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules") or name.startswith("__"):
                continue
            if not isinstance(value, (torch.Tensor, dict, list, tuple)):
                continue
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                    st = t.untyped_storage()
                    out[st.data_ptr()] = st.nbytes()
    return out


def cpu_step_peak(model: Any, data: Any, spec: Any, opt: Any) -> int:
    """The real CPU peak of one step: the live bytes before it (parameters, buffers,
    optimizer state, inputs, and the tensors the warm-up step made that a module kept)
    plus the profiler's peak during it, after a warm-up step.

    A forward may make a tensor once and keep it outside the module's buffers (LeViT's
    attention biases, in a plain dict in eval mode): it is live through every later step,
    which does not make it again, so the profiler's peak of the measured step lacks it."""
    from vramctl.estimator._spec import run_step

    kept_before = kept_tensors(model)
    run_step(model, data, spec, opt)  # warm-up: one-off kernel caches, as on CUDA
    held = held_tensors(model, data, opt)
    ptrs = {t.untyped_storage().data_ptr() for t in held}
    made = [n for p, n in kept_tensors(model).items() if p not in kept_before and p not in ptrs]
    return (
        storages_bytes(held) + sum(made) + profiled_peak(lambda: run_step(model, data, spec, opt))
    )


def error_stats(pairs: list[tuple[int | None, int | None]]) -> dict[str, float | int | None]:
    """Median and largest absolute error, and the worst under-estimate, in percent."""
    import statistics

    errs = [100.0 * (p - m) / m for p, m in pairs if p is not None and m]
    if not errs:
        return {"rows": 0, "median_pct": None, "max_pct": None, "worst_under_pct": None}
    return {
        "rows": len(errs),
        "median_pct": round(statistics.median(abs(e) for e in errs), 3),
        "max_pct": round(max(abs(e) for e in errs), 3),
        "worst_under_pct": round(max([0.0] + [-e for e in errs]), 3),
    }


#: The accuracy goals of the estimate benchmarks against real steps, in percent.
ACCURACY_GOALS = {"median_pct": 1.0, "max_pct": 3.0, "worst_under_pct": 2.0}


def accuracy_figures(pairs: list[tuple[int | None, int | None]]) -> tuple[dict[str, Any], bool]:
    """The figures of (estimate, measured) pairs against :data:`ACCURACY_GOALS` (median,
    largest and worst under-estimate in percent, and the goals), and whether they meet them."""
    stats = error_stats(pairs)
    ok = stats["median_pct"] is not None and all(
        (stats[k] or 0) <= goal for k, goal in ACCURACY_GOALS.items()
    )
    figures = {
        "rows": stats["rows"],
        "median_error_pct": stats["median_pct"],
        "max_error_pct": stats["max_pct"],
        "worst_underestimate_pct": stats["worst_under_pct"],
        "goals": dict(ACCURACY_GOALS),
    }
    return figures, ok


# -- out-of-memory errors ----------------------------------------------------------------


def free_failed(exc: BaseException | None) -> None:
    """Free what a failed step held: the tensors of its traceback's frames, then CUDA's cache."""
    while exc is not None:
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
    gc.collect()
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -- the peers -----------------------------------------------------------------------------

_PEER_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The peers' warnings and info lines off: Lightning's tuner prints every trial, and Lhotse
    warns that an eager CutSet gains nothing from lazy reading (true, and beside the point)."""
    levels = {n: logging.getLogger(n).level for n in _PEER_LOGGERS}
    for n in _PEER_LOGGERS:
        logging.getLogger(n).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)


def accelerate_search(start: int, trial: Callable[[int], None]) -> tuple[int, list[int]]:
    """``trial(batch_size)`` inside ``accelerate.utils.find_executable_batch_size``.

    As Accelerate documents it: an out-of-memory error runs the trial again with 0.9
    times the batch size. Returns the batch size the trial finished with (0 when
    Accelerate reached zero) and every size it was given.
    """
    from accelerate.utils import find_executable_batch_size

    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=start)  # type: ignore[misc]
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        trial(batch_size)
        return batch_size

    try:
        return int(run()), tried
    except RuntimeError as exc:  # "No executable batch size found, reached zero."
        if "No executable batch size" not in str(exc):
            raise
        return 0, tried
