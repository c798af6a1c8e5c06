"""``fit_batch_size``: the largest batch whose real step fits, found in a few real probes.

The estimator predicts the answer without running anything; real steps then
check it, because what a device really holds differs from any model of it
(the CUDA context, kernels' workspaces, a simulated GPU's CPU kernels). A probe
runs ``step(make_batch(b))`` for real and measures its peak device memory with
:meth:`Device.peak_meter <vramctl.Device.peak_meter>`; ``b`` fits when the peak stays within
``target * total`` and nothing runs out of memory. Peak memory is a convex,
piecewise-affine function of the batch size (fixed weights and optimizer state,
activations per sample), so three probes usually settle it:

1. at the estimator's prediction (without a model: at ``start``);
2. at the first probe's size scaled by the memory left: the bytes the step
   added over what was already held, spread over its samples, is at least the
   true cost of one more sample, so this size fits;
3. where the line through the two real points meets the budget.

A probe that misses narrows a bracket (largest size that fits, smallest that
does not) and the next one interpolates inside it. The answer is the largest
probe that fitted. It is cached on disk (see :mod:`vramctl.fit._cache`).

>>> import torch, vramctl
>>> from vramctl.fit import fit_batch_size
>>> with vramctl.simulate("64MiB") as gpu:
...     model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
...                                 torch.nn.Linear(1024, 10))
...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
...     def step(x):
...         model(x).square().mean().backward()
...         opt.step()
...         opt.zero_grad()
...     fit = fit_batch_size(step, lambda b: torch.randn(b, 256), device=gpu,
...                          model=model, optimizer=opt, cache=False)
>>> fit.source, fit.peak_used <= fit.budget, len(fit.probes) <= 3
('probe', True, True)
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vramctl._units import format_bytes
from vramctl.device import Device, resolve
from vramctl.estimator import Step
from vramctl.fit import _cache
from vramctl.fit._probe import Prober, preserved, rng_kept
from vramctl.fit._result import FitError, FitResult
from vramctl.fit._search import Search, scaled
from vramctl.fit._seed import Reading, Seed, as_called, batch_structure, estimate_request, predict
from vramctl.guard import is_oom

__all__ = ["DEFAULT_START", "MAX_PROBES", "TOLERANCE", "fit_batch_size"]

#: Probes from the first that fits (the search usually needs three in all).
MAX_PROBES = 8
#: Stop when the next probe would add less than this share to the largest size that fits.
TOLERANCE = 0.01
#: Batch size of the first probe when there is no prediction.
DEFAULT_START = 1
#: A probe at the estimate's edge confirms it when its peak allocated bytes are within
#: this share of the estimate's.
EDGE_MATCH = 0.01


# -- resolving the inputs ---------------------------------------------------------------


def _resolve_device(
    device: Device | str | int | None, step: Any, model: torch.nn.Module | None
) -> Device:
    if device is None:
        found = getattr(step, "device", None)  # a Guard used as the step knows its device
        device = found if isinstance(found, Device) else None
    dev = resolve(device, model=model)
    if not dev.active:
        raise FitError(
            f"{dev.id} is not active: call fit_batch_size inside its block "
            f"(with vramctl.simulate(...) as gpu: fit_batch_size(step, make_batch, device=gpu))"
        )
    return dev


# -- the public function ----------------------------------------------------------------


def fit_batch_size(
    step: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    *,
    device: Device | str | int | None = None,
    target: float = 0.9,
    start: int | None = None,
    max: int | None = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    cache: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    steps_per_probe: int = 2,
    max_probes: int = MAX_PROBES,
    tolerance: float = TOLERANCE,
    mode: str | None = None,
    estimate: bool = True,
    estimate_options: Step | Mapping[str, Any] | None = None,
) -> FitResult:
    """The largest batch size ``b`` at which ``step(make_batch(b))`` fits ``target`` of the device.

    ``step`` takes one batch and runs a whole training step (forward, backward,
    optimizer step) or an inference call; ``make_batch(b)`` builds a batch of
    ``b`` samples on the device. ``model`` and ``optimizer`` (taken from
    ``step.model`` and ``step.optimizer`` when not given, as on a
    :class:`vramctl.Guard`) seed the search with the estimator's prediction.

    **Probing runs real steps**, which change the weights, buffers and optimizer
    state: they are copied before probing (to host memory; on a simulated GPU
    inside ``device.uncounted()``, so the copies take none of its budget) and put
    back afterwards, with the train/eval flags and the random number generators.
    Gradients are set to None. Each probe runs ``steps_per_probe`` steps, each on a
    new batch as a training loop takes them (the first step also makes the optimizer's
    state), and fits when its
    peak device-level used bytes stay within ``target * total`` with no
    out-of-memory error (one the step caught itself counts too).

    ``start`` is the first probe's size (default: the prediction, else 1; with
    ``start`` no estimate is made),
    ``max`` an upper limit. The search stops when the next probe would add less
    than ``tolerance`` (a share) to the largest size that fits, or after
    ``max_probes`` probes from the first that fits; it usually takes three in
    all. The answer is cached in
    ``cache_dir`` (else ``$VRAMCTL_CACHE_DIR``, else ``~/.cache/vramctl``) under
    the step's code, the model, the input shapes, the device, its free memory
    (in 1/32 bands) and ``target``; a later call with the same key returns it
    with ``source="cache"`` and runs nothing. ``mode`` (``"train"`` or
    ``"infer"``, default: ``"train"`` with an optimizer or a model in training
    mode) and ``estimate_options`` go to :func:`vramctl.max_batch_size`;
    ``estimate=False`` skips it. ``estimate_options`` is a :class:`vramctl.Step`, or a
    mapping of its fields (``precision``, ``loss_fn`` ...) and of ``max_batch_size``'s
    own arguments (``seq_len`` ...). The fit fills in, where the options say nothing
    (see :meth:`vramctl.Step.of`), the mode and optimizer it found, its step's
    ``loss_fn`` attribute and ``safe=True`` (the safe end of a GPU's range, so that the
    first probe fits and measures); the device and target are always the fit's. A fit
    cannot see whether its step holds the model's output through backward: unless
    ``keep_output`` is given, a training step is estimated both ways, the first probe
    goes to the smaller answer, and what it allocates tells which the step is.

    On a simulated GPU, call it inside the device's ``with`` block.
    """
    t0 = time.perf_counter()
    upper = max
    if not _number(target) or not 0 < target <= 1:
        raise FitError(f"target must be in (0, 1], got {target!r}")
    for name, value in (("start", start), ("max", upper)):
        if value is not None and (not _integer(value) or value < 1):
            raise FitError(f"{name} must be a positive integer, got {value!r}")
    if start is not None and upper is not None and start > upper:
        raise FitError(f"start ({start}) is above max ({upper})")
    for name, value in (("steps_per_probe", steps_per_probe), ("max_probes", max_probes)):
        if not _integer(value) or value < 1:
            raise FitError(f"{name} must be an integer of at least 1, got {value!r}")
    if not _number(tolerance) or not 0 <= tolerance < 1:
        raise FitError(f"tolerance must be in [0, 1), got {tolerance!r}")
    if mode is not None and mode not in ("train", "infer"):
        raise FitError(f"mode must be 'train', 'infer' or None, got {mode!r}")
    if estimate_options is not None and not isinstance(estimate_options, Step | Mapping):
        raise FitError(
            "estimate_options must be a vramctl.Step or a mapping of its fields, "
            f"got {type(estimate_options).__name__}"
        )
    if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
        raise FitError(f"cache_dir must be a path, got {cache_dir!r}")
    if not callable(step) or not callable(make_batch):
        raise FitError("step and make_batch must be callables: step(batch), make_batch(size)")
    if model is None and isinstance(getattr(step, "model", None), torch.nn.Module):
        model = step.model  # type: ignore[attr-defined]
    if optimizer is None and isinstance(getattr(step, "optimizer", None), torch.optim.Optimizer):
        optimizer = step.optimizer  # type: ignore[attr-defined]
    dev = _resolve_device(device, step, model)
    with rng_kept(dev):
        return _fit(
            step,
            make_batch,
            dev,
            target=target,
            start=start,
            upper=upper,
            model=model,
            optimizer=optimizer,
            cache=cache,
            cache_dir=cache_dir,
            steps=steps_per_probe,
            max_probes=max_probes,
            tolerance=tolerance,
            mode=mode,
            estimate=estimate,
            estimate_options=estimate_options,
            t0=t0,
        )


def _fit(
    step: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    dev: Device,
    *,
    target: float,
    start: int | None,
    upper: int | None,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    cache: bool,
    cache_dir: str | os.PathLike[str] | None,
    steps: int,
    max_probes: int,
    tolerance: float,
    mode: str | None,
    estimate: bool,
    estimate_options: Step | Mapping[str, Any] | None,
    t0: float,
) -> FitResult:
    budget = int(target * dev.capacity())
    band = _cache.free_band(dev)  # before make_batch(1) holds anything
    signature, sample_bytes, structure = _sample(make_batch, dev)
    # Every sample's input is on the device: no more samples fit than the room has inputs.
    room = budget - (dev.capacity() - dev.available())
    ceiling = room // sample_bytes if sample_bytes else None
    if upper is not None:
        ceiling = upper if ceiling is None else min(ceiling, upper)
    key: dict[str, Any] | None = None
    root = _cache.cache_root(cache_dir)
    if cache:
        key = _cache_key(step, signature, band, dev, target, upper, model, optimizer)
        hit = _cache.load(root, key)
        if hit is not None and (_int_or_none(hit.get("batch_size")) or 0) >= 1:
            return FitResult(
                batch_size=hit["batch_size"],
                peak_used=_int_or_none(hit.get("peak_used_bytes")),
                budget=budget,
                predicted=_int_or_none(hit.get("predicted")),
                probes=[],
                source="cache",
                elapsed=time.perf_counter() - t0,
                device=dev.id,
                target=target,
                notes=(f"read from {root}",),
            )

    notes: list[str] = []
    seed = Seed()
    if model is not None and estimate and start is None:
        run_mode = mode or (
            "train" if optimizer is not None or (model.training and _trainable(model)) else "infer"
        )
        request, search_args, readings = estimate_request(
            estimate_options, step, run_mode, optimizer
        )
        if ceiling is not None and ceiling >= 1:
            search_args.setdefault("limit", ceiling)
        seed = predict(
            as_called(model, step, structure),
            make_batch,
            dev,
            target,
            request,
            optimizer,
            search_args,
            readings,
        )
        if seed.note:
            notes.append(seed.note)
    predicted = seed.batch_size
    first = start or predicted or DEFAULT_START
    if ceiling is not None:
        first = max(1, min(first, ceiling))

    search = Search(budget, upper, seed.slope, tolerance, ceiling)
    owners = [o for o in (model, optimizer) if o is not None]
    probe = Prober(step, make_batch, dev, budget, steps, owners)
    with preserved(dev, model, optimizer, step):
        for owner in owners:
            owner.zero_grad(set_to_none=True)
        b: int | None = first
        # The sizes the estimate advised: a probe at one is read against it.
        advised = {first} if predicted else set()
        while b is not None:
            search.probes.append(probe(b))
            following: int | None = None
            if b in advised:
                following = _follow(search, seed, notes)
                if following is not None:
                    advised.add(following)
            if search.lo and len(search.probes) - search.misses_before_fit() >= max_probes:
                notes.append(f"stopped after {max_probes} probes from the first that fitted")
                break
            b = following if following is not None else search.next()

    best = search.lo
    if best == 0:
        raise FitError(_nothing_fits(search, dev, budget, target))
    if upper is not None and best >= upper:
        notes.append(f"reached max={upper}")
    result = FitResult(
        batch_size=best,
        peak_used=search.at(best).peak,
        budget=budget,
        predicted=predicted,
        probes=[(p.batch_size, p.peak, p.fits) for p in search.probes],
        source="probe",
        elapsed=time.perf_counter() - t0,
        device=dev.id,
        target=target,
        notes=tuple(notes),
    )
    if key is not None:
        _cache.store(root, key, result.to_dict())
    return result


def _nothing_fits(search: Search, dev: Device, budget: int, target: float) -> str:
    one = next((p for p in search.probes if p.batch_size == 1), None)
    if one is not None and one.peak is not None:
        seen = f"peaked at {format_bytes(one.peak)}"
    elif one is not None and one.floor is not None:
        seen = f"ran out of memory, needing more than {format_bytes(one.floor)}"
    else:
        seen = "ran out of memory"
    return (
        f"not even batch size 1 fits on {dev.id}: its step {seen}, over the budget of "
        f"{format_bytes(budget)} (target {target:g} of {format_bytes(dev.capacity())}). "
        "Free memory held elsewhere, raise target, or make the step smaller "
        "(mixed precision, gradient checkpointing, a smaller model or a larger device)."
    )


def _follow(search: Search, seed: Seed, notes: list[str]) -> int | None:
    """After a probe at a size the estimate advised: the next size it advises, or None.

    A probe that fitted and allocated what one reading of the loop predicted (within
    :data:`EDGE_MATCH`) says the step is that loop. At that reading's answer, where the
    estimate found the edge with no range, it confirms the edge: one more sample does not
    fit, and the search ends. Below it, the reading's answer is next (refitted to the
    probe where the answer was the safe end of a range). A first probe that allocated
    what no reading predicted refits the nearest one to its allocations."""
    probe = search.probes[-1]
    b = probe.batch_size
    if not probe.fits or probe.allocated is None or not seed.readings:
        return None
    reading = seed.matching(b, probe.allocated, EDGE_MATCH)
    if reading is not None:
        if reading.batch_size == b and reading.edge:
            search.edge = b + 1
            notes.append(
                f"the estimate's edge held: batch {b} allocated what it predicted for "
                f"{reading.describe()} (within {EDGE_MATCH:.0%}), and {b + 1} does not fit by it"
            )
            return None
        if reading.batch_size > b and reading.edge:
            got: int | None = reading.batch_size
        else:
            got = reading.refit(b, probe.allocated) if reading.refit is not None else None
        got = _below_ceiling(got, search, b)
        if got is not None:
            notes.append(
                f"batch {b} allocated what the estimate predicted for {reading.describe()}; "
                f"its answer is {got}"
            )
        return got
    if len(search.probes) > 1:
        return None
    allocated = probe.allocated

    def off(r: Reading) -> float:
        predicted = r.allocated_at(b) if r.allocated_at is not None else None
        return abs(predicted - allocated) if predicted else float("inf")

    nearest = min(seed.readings, key=off)
    if nearest.refit is None:
        return None
    got = _below_ceiling(nearest.refit(b, probe.allocated), search, b)
    if got is None:
        return None
    # The refit replays the estimate's requests less the bytes the probe did not
    # allocate; the real step's requests differ in more than those bytes (its loss's
    # tensors come and go at other times), and the caching allocator packs them
    # otherwise. Not confirmed by the probe, it goes no further than the probe's own
    # peak scaled to the budget (a size that fits where the peak is affine and convex).
    scaled_up = scaled(probe, search.budget) if probe.peak is not None else got
    if scaled_up < got:
        notes.append(
            f"refitted the estimate to the first probe's allocations: {got}; probing "
            f"{scaled_up} first, the probe's peak scaled to the budget"
        )
        return _below_ceiling(scaled_up, search, b)
    notes.append(f"refitted the estimate to the first probe's allocations: {got}")
    return got


def _below_ceiling(got: int | None, search: Search, b: int) -> int | None:
    """``got``, no higher than the search's ceiling; None where that is not above ``b``."""
    if got is not None and search.ceiling is not None:
        got = min(got, search.ceiling)
    return got if got is not None and got > b else None


def _trainable(model: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _sample(make_batch: Callable[[int], Any], device: Device) -> tuple[Any, int, str]:
    """The input signature of ``make_batch(1)``, its bytes on ``device``, and its structure."""
    try:
        with device.uncounted():
            sample = make_batch(1)
            signature = _cache.input_signature(sample)
            structure = batch_structure(sample)
            kind = device.torch_device.type
            seen = {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in _tensors(sample)
                if t.device.type == kind
            }
            del sample
    except Exception as exc:
        if is_oom(exc):
            raise FitError(f"make_batch(1) ran out of memory on {device.id}") from exc
        raise FitError(f"make_batch(1) failed: {type(exc).__name__}: {exc}") from exc
    return signature, sum(seen.values()), structure


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):  # also a BatchEncoding, a UserDict
        tree = list(tree.values())
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    if isinstance(tree, list | tuple):
        return [t for item in tree for t in _tensors(item)]
    return []


def _cache_key(
    step: Callable[[Any], Any],
    signature: Any,
    band: int,
    device: Device,
    target: float,
    upper: int | None,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    return {
        "step": _cache.step_identity(step),
        "model": _cache.model_identity(model, optimizer),
        "inputs": signature,
        "device": _cache.device_identity(device),
        "free_band": band,
        "target": round(float(target), 6),
        "max": upper,
        "runtime": _cache.runtime(),
    }
