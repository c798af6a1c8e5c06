"""A spec's memory need priced on a device, whether any device can take it, and the batch plan.

>>> from vramctl.jobs import JobSpec, batch_plan
>>> from vramctl.jobs._need import job_env
>>> spec = JobSpec.from_dict({"name": "t", "command": ["python", "t.py"], "memory": "4GiB",
...                           "batch_size": 32, "effective_batch": 96})
>>> batch_plan(spec, 20)
(16, 6)
>>> job_env(spec, 16, 6)
{'VRAMCTL_BATCH_SIZE': '16', 'VRAMCTL_GRAD_ACCUM': '6'}
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

from vramctl._units import format_bytes
from vramctl.device import ComputeCapability, Device, gpus
from vramctl.estimator import AllocatorConfig, EstimateError, Step, estimate
from vramctl.jobs._spec import DeviceConstraints, JobSpec, JobSpecError

__all__ = [
    "BATCH_SIZE_ENV",
    "GRAD_ACCUM_ENV",
    "batch_plan",
    "check_placeable",
    "device_capacity",
    "job_env",
    "matching_devices",
    "price",
]

#: Runs an estimate elsewhere than in this process (an :class:`~vramctl.jobs.EstimateWorker`):
#: ``(model, step, batch_size=, seq_len=)``, ``step`` the request (a
#: :class:`~vramctl.Step`: device, mode, precision, the allocator's configuration), to the
#: estimate's judged peak in bytes; an :class:`~vramctl.estimator.EstimateError` says why
#: it cannot.
Estimator = Callable[..., int]

#: The variables that tell a job the batch and gradient accumulation it was admitted with.
BATCH_SIZE_ENV = "VRAMCTL_BATCH_SIZE"
GRAD_ACCUM_ENV = "VRAMCTL_GRAD_ACCUM"


def _allocator_config(spec: JobSpec) -> AllocatorConfig | None:
    """The allocator configuration ``spec``'s job runs under, as :func:`price` prices it.

    Its environment is this process's (the scheduler's, which a supervisor passes on)
    with the spec's ``env`` over it; the supervisor adds no allocator setting of its own.
    None where it sets nothing the allocator model follows.
    """
    return AllocatorConfig.from_env({**os.environ, **spec.env})


def price(
    spec: JobSpec,
    device: Device | str,
    *,
    learned_peak: int | None = None,
    batch_size: int | None = None,
    estimator: Estimator | None = None,
) -> int:
    """The bytes ``spec`` needs on ``device``.

    - a size need: the size;
    - an estimate: :func:`vramctl.estimate` of the model step on the device, at the
      peak its ``fits`` judges by (``Estimate.judged_peak``: on a GPU, what
      ``nvidia-smi`` may show at the safe end, CUDA context included); ``batch_size``
      prices another batch than the spec's (a lowered one). The caching allocator is
      priced as the job will run it: with the ``PYTORCH_CUDA_ALLOC_CONF`` (else
      ``PYTORCH_ALLOC_CONF``) of its environment, the spec's ``env`` over this process's
      (the scheduler's, which the job inherits), as far as the allocator model follows it
      (:meth:`~vramctl.estimator.AllocatorConfig.from_conf`);
    - learned: ``learned_peak × (1 + margin)`` where earlier runs recorded a peak,
      else the declared ``first``.

    ``estimator`` runs the estimate instead of this process (an
    :class:`~vramctl.jobs.EstimateWorker`: the job service's, so that a user's model
    never runs in the service); the other needs are priced here.

    Raises :class:`JobSpecError` when the model cannot be estimated.
    """
    need = spec.memory
    if need.kind == "size":
        assert need.size is not None
        return need.size
    if need.kind == "learned":
        assert need.first is not None
        if learned_peak is None:
            return need.first
        if learned_peak < 0:
            raise ValueError(f"learned_peak cannot be negative, got {learned_peak}")
        return round(learned_peak * (1 + need.margin))
    model = need.estimate
    assert model is not None
    batch = batch_size or model.batch_size or spec.batch_size
    step = Step(
        device=device,
        mode=model.mode,
        precision=model.precision,
        allocator_config=_allocator_config(spec),
        max_new_tokens=model.max_new_tokens,
        cache=model.cache or "dynamic",
        kv_dtype=model.kv_dtype,
    )
    try:
        if estimator is not None:
            return estimator(model.model, step, batch_size=batch, seq_len=model.seq_len)
        est = estimate(model.model, batch_size=batch, seq_len=model.seq_len, step=step)
    except EstimateError as exc:
        raise JobSpecError(
            f"memory.estimate: {exc}", what=f"cannot price job {spec.name!r}"
        ) from exc
    return est.judged_peak


def device_capacity(device: Device) -> int:
    """The device's total memory from its reading (NVML on a GPU: no CUDA context made in
    the asking process), else what a process sees (``capacity()``)."""
    total = device.memory().total
    return total if isinstance(total, int) else device.capacity()


def _label(device: Device) -> str:
    return device.id if device.name in device.id else f"{device.id} ({device.name})"


def _excluded_by(constraints: DeviceConstraints, device: Device) -> str | None:
    """Why ``device`` does not meet ``constraints``, or None when it does."""
    if constraints.model is not None:
        wanted = constraints.model.lower()
        names = [device.name] + ([device.spec.name] if device.spec is not None else [])
        if not any(wanted in n.lower() for n in names):
            return f"model {constraints.model!r}"
    if constraints.min_capability is not None:
        cc = device.capability
        if not isinstance(cc, ComputeCapability):
            return f"min_capability {constraints.min_capability} (its capability is unknown)"
        if cc < constraints.min_capability:
            return f"min_capability {constraints.min_capability} (it has {cc})"
    return None


def matching_devices(spec: JobSpec, devices: Sequence[Device]) -> list[Device]:
    """The devices of ``devices`` that meet the spec's device constraints, in order."""
    return [d for d in devices if _excluded_by(spec.devices, d) is None]


def check_placeable(
    spec: JobSpec,
    devices: Sequence[Device] | None = None,
    *,
    learned_peak: int | None = None,
    margin: float = 0.0,
    estimator: Estimator | None = None,
) -> None:
    """Raise :class:`JobSpecError` unless some ``devices`` (default: the GPUs) could take
    ``spec`` when empty: enough devices meet its constraints, and enough of them have
    the capacity for its need (:func:`price` on each) plus the scheduler's safety
    ``margin`` (a share of the need, as :class:`~vramctl.jobs.Ledger` adds it).

    The error says which constraint excluded which device, or how the need compares
    with the largest device. ``estimator``: as for :func:`price`.
    """
    pool = list(gpus() if devices is None else devices)
    what = f"job {spec.name!r} cannot be placed"
    count = spec.devices.count
    if not pool:
        raise JobSpecError("devices: there are no devices to run it on", what=what)
    excluded = [(d, _excluded_by(spec.devices, d)) for d in pool]
    matching = [d for d, why in excluded if why is None]
    if len(matching) < count:
        reasons = "; ".join(f"{_label(d)} excluded by {why}" for d, why in excluded if why)
        have = "no device meets" if not matching else f"only {len(matching)} of them meet"
        raise JobSpecError(
            f"devices: needs {count} device{'s' if count > 1 else ''} but {have} the "
            f"constraints: {reasons}",
            what=what,
        )
    priced = [
        (d, _with_margin(price(spec, d, learned_peak=learned_peak, estimator=estimator), margin))
        for d in matching
    ]
    fitting = [(d, need) for d, need in priced if need <= device_capacity(d)]
    if len(fitting) >= count:
        return
    largest, need = max(priced, key=lambda p: device_capacity(p[0]))
    each = f" on each of {count} devices" if count > 1 else ""
    also = f" with the {margin * 100:g}% margin" if margin > 0 else ""
    tail = f"; only {len(fitting)} device{'s' if len(fitting) != 1 else ''} can" if fitting else ""
    raise JobSpecError(
        f"memory: needs {format_bytes(need)}{also}{each} but the largest device, "
        f"{_label(largest)}, has {format_bytes(device_capacity(largest))}{tail}",
        what=what,
    )


def _with_margin(need: int, margin: float) -> int:
    """``need`` plus the safety margin the scheduler's ledger adds to it (a share of it,
    rounded up).

    >>> _with_margin(1000, 0.1)
    1100
    """
    return need + math.ceil(need * margin)


def batch_plan(spec: JobSpec, fitted_batch: int) -> tuple[int, int]:
    """``(batch_size, grad_accum)`` with ``batch_size × grad_accum`` the spec's effective
    batch and ``batch_size`` at most ``fitted_batch`` (the largest that fits the free
    memory) and at most the spec's ``batch_size``: the largest divisor of the effective
    batch under both.

    A spec with ``batch_size`` but no ``effective_batch`` keeps ``batch_size`` as its
    effective batch.
    """
    if spec.batch_size is None:
        raise JobSpecError(
            "batch_size: the spec declares no batch, so its batch cannot be lowered",
            what=f"job {spec.name!r}",
        )
    if isinstance(fitted_batch, bool) or not isinstance(fitted_batch, int) or fitted_batch < 1:
        raise JobSpecError(
            f"batch_size: not even a batch of 1 fits (fitted batch {fitted_batch!r})",
            what=f"job {spec.name!r}",
        )
    effective = spec.target_batch
    assert effective is not None
    cap = min(fitted_batch, spec.batch_size)
    batch = max(d for d in range(1, cap + 1) if effective % d == 0)
    return batch, effective // batch


def job_env(spec: JobSpec, batch: int, accum: int) -> dict[str, str]:
    """The spec's environment plus ``VRAMCTL_BATCH_SIZE`` and ``VRAMCTL_GRAD_ACCUM``."""
    for label, n in (("batch", batch), ("accum", accum)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{label} must be a positive integer, got {n!r}")
    env = dict(spec.env)
    env[BATCH_SIZE_ENV] = str(batch)
    env[GRAD_ACCUM_ENV] = str(accum)
    return env
