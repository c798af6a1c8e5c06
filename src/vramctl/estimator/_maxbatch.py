"""``max_batch_size``: the largest batch (and length) that fits, from a few traces.

Peak memory is affine in the batch size for most models (weights and optimizer
state are fixed, activations grow with each sample), and at most quadratic in
the sequence length (attention scores under the math kernel). A few traced
sizes give the curve; the answer it predicts is then traced itself, and moved
until a trace shows that it fits and one of one more sample that it does not.

When the probes' peaks do not tell the sizes apart (the allocator rounds a
small model's per-sample bytes away), the search doubles the batch until memory
binds. If it never does up to the search's ceiling, the result says so
(``limit_found`` False) rather than presenting the ceiling as the answer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vramctl.device import Device
from vramctl.estimator._allocator import AllocatorConfig
from vramctl.estimator._calibration import CalibrationSource
from vramctl.estimator._parallel import Parallel
from vramctl.estimator._rates import RATES
from vramctl.estimator._request import STEP_FIELDS, Step, step_request
from vramctl.estimator._result import Estimate
from vramctl.estimator._session import Session, open_session
from vramctl.estimator._spec import EstimateError, ModelSource
from vramctl.estimator._staircase import Requests
from vramctl.estimator._target import Target
from vramctl.estimator._timing import Throughput
from vramctl.estimator._trace import Trace
from vramctl.estimator._verdict import allocator_of, device_trace

__all__ = ["BATCH_BOUND", "LENGTH_BOUND", "SEARCH_INPUT_BYTES", "MaxBatch", "max_batch_size"]

#: The largest batch the search traces when no ``limit`` is given (about 16.8 million).
BATCH_BOUND = 1 << 24
#: The host memory the largest batch the search builds with a ``batch`` callable may take:
#: each traced size is a real batch from the callable, so the search stops short of one
#: that would take more (the built-in models' float inputs are never touched: no bound).
SEARCH_INPUT_BYTES = 2 * 2**30
#: The first traced guess is at most this many times the largest probe (a slope the
#: allocator's rounding made tiny must not send the first trace to the ceiling).
_FIRST_JUMP = 1024


@dataclass(frozen=True)
class MaxBatch:
    """The largest batch that fits, and the traces that show it."""

    #: Largest batch size that fits (0: not even one sample fits). When ``limit_found``
    #: is False, the largest size traced, all of which fit: larger ones may fit too.
    batch_size: int
    #: The estimate at ``batch_size`` (None when nothing fits).
    estimate: Estimate | None
    #: Every traced point: (batch size, peak device bytes, fits).
    curve: list[tuple[int, int, bool]] = field(default_factory=list)
    #: Bytes per extra sample and fixed bytes of the affine fit through the traces near
    #: the answer (the probes alone can show 0 when the allocator rounds samples away).
    per_sample: float = 0.0
    fixed: float = 0.0
    #: With ``lengths=True``: the largest length that fits at batch 1 (None otherwise).
    max_length: int | float | None = None
    length_arg: str | None = None
    length_curve: list[tuple[float, int, bool]] = field(default_factory=list)
    elapsed: float = 0.0
    #: Whether ``max_length`` is the longest length searched (the model's limit, or
    #: :data:`LENGTH_BOUND` for a model without one): longer inputs may fit too.
    length_at_ceiling: bool = False
    #: Whether traces bracket ``batch_size``: it fits and ``batch_size + 1`` does not (or
    #: could not be traced; ``notes`` say so). False: no limit was found up to
    #: ``search_ceiling``.
    limit_found: bool = True
    #: The largest batch the search could trace: ``limit``, :data:`BATCH_BOUND`, or less
    #: where a larger batch from the callable would take over :data:`SEARCH_INPUT_BYTES`.
    search_ceiling: int = 0
    #: Why a search that found no limit stopped: ``"limit"`` (the ``limit`` given),
    #: ``"bound"`` (:data:`BATCH_BOUND`), ``"input"`` (the callable's next batch would
    #: take over :data:`SEARCH_INPUT_BYTES` of host memory) or ``"traces"`` (the search
    #: used its traces up); None when ``limit_found``.
    stopped_by: str | None = None
    #: Whether fitting was judged at the safe end of each estimate's device range.
    safe: bool = True
    #: What the answer rests on beyond fitting traces (sizes that could not be traced).
    notes: tuple[str, ...] = ()
    #: The step's requests per sample near the answer, the caching allocator's
    #: configuration, the bytes it may hold and the largest size searched: what
    #: :meth:`refit` replays (None without a caching allocator).
    replayable: tuple[Requests, AllocatorConfig, int, int] | None = field(
        default=None, repr=False, compare=False
    )

    def refit(self, batch_size: int, allocated: int) -> int | None:
        """The largest batch, once a real step of ``batch_size`` allocated ``allocated``
        bytes at its peak: each request's per-sample bytes are scaled so that the estimate's
        live peak there is the one measured, and the larger sizes' requests are replayed
        through the caching allocator model. None without a caching allocator, or where no
        larger size fits."""
        if self.replayable is None:
            return None
        requests, config, capacity, ceiling = self.replayable
        return requests.refit(batch_size, allocated, ceiling, capacity, config)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_batch_size": self.batch_size,
            "limit_found": self.limit_found,
            "search_ceiling": self.search_ceiling,
            "stopped_by": self.stopped_by,
            "safe": self.safe,
            "per_sample_bytes": round(self.per_sample),
            "fixed_bytes": round(self.fixed),
            "curve": [
                {"batch_size": b, "peak_device_bytes": p, "fits": f} for b, p, f in self.curve
            ],
            "max_length": self.max_length,
            "length_arg": self.length_arg,
            "length_at_ceiling": self.length_at_ceiling,
            "length_curve": [
                {"length": n, "peak_device_bytes": p, "fits": f} for n, p, f in self.length_curve
            ],
            "estimate": None if self.estimate is None else self.estimate.to_dict(),
            "notes": list(self.notes),
            "elapsed_s": round(self.elapsed, 3),
        }


def _affine(points: Sequence[tuple[float, int]]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def _quadratic_root(points: Sequence[tuple[float, int]], budget: float) -> float | None:
    """Largest x with a*x^2 + b*x + c <= budget, for the parabola through three points."""
    (x0, y0), (x1, y1), (x2, y2) = points[:3]
    d = (x0 - x1) * (x0 - x2) * (x1 - x2)
    if d == 0:
        return None
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / d
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / d
    c = y0 - a * x0 * x0 - b * x0
    if abs(a) < 1e-12:
        return None if b <= 0 else (budget - c) / b
    disc = b * b - 4 * a * (c - budget)
    if disc < 0:
        return None
    return float((-b + disc**0.5) / (2 * a))


def max_batch_size(
    model: ModelSource,
    batch: Callable[[int], Any] | None = None,
    *,
    device: Target | Device | str | int | None = None,
    target_utilization: float = 0.9,
    mode: str = "train",
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = "adamw",
    precision: str = "fp32",
    seq_len: int | None = None,
    seconds: float | None = None,
    checkpointing: bool = False,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    probe: Sequence[int] = (1, 2, 4),
    limit: int | None = None,
    lengths: bool = False,
    allocator_config: AllocatorConfig | None = None,
    calibration: CalibrationSource = None,
    safe: bool = True,
    task: str | None = None,
    image_size: int | tuple[int, int] | None = None,
    trust_remote_code: bool = False,
    offload_activations: bool = False,
    offload_optimizer: bool = False,
    grad_accumulation: bool = False,
    keep_output: bool = True,
    parallel: Parallel | str | None = None,
    tf32: bool | None = None,
    throughput: Throughput | None = None,
    adapter: Any = None,
    quant: Any = None,
    kbit_prep: bool = False,
    max_new_tokens: int | None = None,
    cache: str = "dynamic",
    kv_dtype: str | None = None,
    side_streams: bool = False,
    step: Step | None = None,
) -> MaxBatch:
    """The largest batch size whose step fits ``device`` at ``target_utilization``.

    ``model`` is what :func:`~vramctl.estimator.estimate` takes (``task``,
    ``image_size`` and ``trust_remote_code`` too). ``batch`` is a callable
    ``batch_size -> batch`` (built-in models and models by their config need
    none). The peak is traced at the ``probe`` sizes, an affine fit predicts the
    answer, and traces bracket it: the answer fits and one more sample does not.
    Where the probes cannot tell sizes apart, the batch doubles until memory
    binds. The search goes up to ``limit`` (default :data:`BATCH_BOUND`, and no
    further than a batch from ``batch`` of :data:`SEARCH_INPUT_BYTES`); if every
    size up to there fits, ``limit_found`` is False and ``batch_size`` is the
    largest traced. With ``lengths=True`` (built-in and config text and speech models) the
    largest ``seq_len`` or ``seconds`` at batch 1 is found the same way from a
    quadratic fit. ``step`` gives the step's options at once, as for
    :func:`~vramctl.estimator.estimate`. ``calibration`` and ``safe`` are as for
    :func:`~vramctl.estimator.estimate`: by default a size fits when the safe
    end of its device range does. With ``parallel`` the answer is the largest micro-batch
    per rank. With ``mode="generate"`` (and ``max_new_tokens``) it is the most sequences
    generated at once, and with ``lengths=True`` the longest prompt.
    """
    t0 = time.perf_counter()
    if not probe or any(p < 1 for p in probe) or len(set(probe)) < 2:
        raise EstimateError("probe needs at least two distinct batch sizes of 1 or more")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise EstimateError(f"limit must be a positive integer, got {limit!r}")
    options = {k: v for k, v in locals().items() if k in STEP_FIELDS}
    request = step_request(step, options)
    session = open_session(model, request, RATES)
    try:
        return _search(
            session, t0, model, batch, seq_len, seconds, probe, limit, lengths, request.safe
        )
    finally:
        session.close()


def _search(
    session: Session,
    t0: float,
    model: ModelSource,
    batch: Callable[[int], Any] | None,
    seq_len: int | None,
    seconds: float | None,
    probe: Sequence[int],
    limit: int | None,
    lengths: bool,
    safe: bool,
) -> MaxBatch:
    cache: dict[tuple[int, float | None], Estimate] = {}
    host: dict[int, int] = {}
    # The requests a caching allocator sees at each traced size (none without one).
    allocator = allocator_of(session.target, session.request.allocator_config)
    if session.parallel is not None:
        allocator = None
    requests: dict[int, Trace] = {}

    def at(b: int, n: float | None = None) -> Estimate:
        key = (b, n)
        if key not in cache:
            sl = int(n) if n is not None and length_arg == "seq_len" else seq_len
            sec = float(n) if n is not None and length_arg == "seconds" else seconds
            cache[key] = session.estimate(batch, b, sl, sec)
            if n is None:
                host[b] = session.last_batch_bytes
                if allocator is not None and session.last_traced is not None:
                    requests[b] = device_trace(session.last_traced, session.target)
        return cache[key]

    length_arg = None
    entry = session.entry if batch is None else None
    builtin = entry is not None
    if lengths:
        if entry is None:
            raise EstimateError(
                "lengths=True needs a model that makes its own batches (a built-in name or "
                "a model by its config)"
            )
        length_arg = entry.length_arg
        if length_arg is None:
            raise EstimateError(
                f"{session.name} takes fixed-size inputs; it has no length to search"
            )

    probes = sorted(set(probe))
    points = [(b, at(b).peak_device) for b in probes]
    slope, fixed = _affine(points)
    # The budget the judged peak is held to, in peak_device's terms (less the device
    # range's uncertainty when judging at its safe end).
    budget = at(probes[0]).peak_device + at(probes[0]).headroom
    ceiling = limit if limit is not None else BATCH_BOUND
    stop = "limit" if limit is not None else "bound"
    per_input = max(host[b] / b for b in probes)
    if not builtin and per_input > 0 and SEARCH_INPUT_BYTES // per_input < ceiling:
        ceiling, stop = max(probes[-1], int(SEARCH_INPUT_BYTES // per_input)), "input"
    untraceable: dict[int, str] = {}
    notes: list[str] = []
    if not at(1).fits:
        best, found = 0, True
    else:
        guess = 2 * probes[-1] if slope <= 0 else int((budget - fixed) // slope)
        guess = min(guess, _FIRST_JUMP * probes[-1], ceiling)
        fitting = sorted(b for b, _ in points if at(b).fits and b <= ceiling)
        best, _hi = _confirm(at, max(1, guess), ceiling, slope, fitting, untraceable)
        if allocator is not None and best and _hi == best + 1 and best + 1 in requests:
            best = _past_edge(at, requests, best, budget, ceiling, allocator)
        # Found only where a trace of one more sample does not fit (or could not be made).
        above = cache.get((best + 1, None))
        found = (above is not None and not above.fits) or best + 1 in untraceable
        if not found and best < ceiling:
            stop = "traces"
        if best + 1 in untraceable:
            notes.append(
                f"batch {best + 1} could not be traced, so it counts as not fitting: "
                f"{untraceable[best + 1]}"
            )
    result_est = at(best) if best else None
    replayable = None
    if allocator is not None and result_est is not None and best + 1 in requests:
        between = Requests.between(requests[best], requests[best + 1], best)
        if between is not None:
            outside = result_est.peak_device - result_est.peak_reserved
            replayable = (between, allocator, budget - outside, ceiling)
    curve = sorted((b, e.peak_device, e.fits) for (b, n), e in cache.items() if n is None)
    per, base = _affine_near(curve, best) if best else (slope, fixed)

    max_len: int | float | None = None
    length_curve: list[tuple[float, int, bool]] = []
    at_ceiling = False
    if lengths and length_arg is not None and isinstance(model, str):
        max_len, length_curve, at_ceiling = _search_length(entry, length_arg, at, budget)
    return MaxBatch(
        best,
        result_est,
        curve,
        per,
        base,
        max_len,
        length_arg,
        length_curve,
        time.perf_counter() - t0,
        at_ceiling,
        limit_found=found,
        search_ceiling=ceiling,
        stopped_by=None if found else stop,
        safe=safe,
        notes=tuple(notes),
        replayable=replayable,
    )


def _past_edge(
    at: Callable[[int], Estimate],
    requests: dict[int, Trace],
    best: int,
    budget: int,
    ceiling: int,
    allocator: AllocatorConfig,
) -> int:
    """Above an edge (``best`` fits, one more sample does not), the largest size that fits
    again on the allocator's staircase (see :mod:`._staircase`), once a trace confirms it;
    else ``best``."""
    est = at(best)
    outside = est.peak_device - est.peak_reserved  # the CUDA context: not the allocator's
    between = Requests.between(requests[best], requests[best + 1], best)
    found = None if between is None else between.largest(best, ceiling, budget - outside, allocator)
    if found is None:
        return best
    try:
        if not at(found).fits:
            return best
    except EstimateError:
        return best
    for _ in range(8):  # where the trace and the replay part, the trace is the truth
        try:
            if found >= ceiling or not at(found + 1).fits:
                break
        except EstimateError:
            break
        found += 1
    return found


def _affine_near(curve: Sequence[tuple[int, int, bool]], best: int) -> tuple[float, float]:
    """The affine fit through the traces from a quarter of ``best`` up (all of them when
    fewer than two sizes lie there): the slope near the answer, not the probes'."""
    near = [(b, p) for b, p, _ in curve if b >= best / 4]
    if len({b for b, _ in near}) < 2:
        near = [(b, p) for b, p, _ in curve]
    return _affine(near)


def _confirm(
    at: Callable[[int], Estimate],
    guess: int,
    ceiling: int,
    slope: float,
    fitting: list[int],
    untraceable: dict[int, str] | None = None,
) -> tuple[int, int | None]:
    """From the fitted guess to the largest size whose trace fits (and whose +1 does not).

    Returns (largest fitting size traced, smallest non-fitting size traced or None).
    While nothing above is known to fail, the size grows to where the chord from the
    smallest fitting trace meets the budget, by at least 1/64 and at most doubling, up
    to ``ceiling``. Then the bracket is narrowed where the line through its ends meets
    the budget, every third step at its middle: an interpolation search that ends in a
    few traces when memory is affine, and in logarithmically many when the allocator's
    rounding makes it jumpy. A size that cannot be traced counts as not fitting
    (``untraceable`` gets why).
    """
    lo, hi = 0, None  # lo fits (0: nothing yet), hi does not
    failed = {} if untraceable is None else untraceable
    b = guess
    bracketed = 0
    for _ in range(80):
        try:
            fits = at(b).fits
        except EstimateError as exc:
            # A batch too big to trace (the probes, smaller, traced) does not fit.
            failed[b] = str(exc)
            fits = False
        if fits:
            fitting.append(b)
            fitting.sort()
            lo = max(lo, b)
        else:
            hi = b if hi is None else min(hi, b)
        if lo >= ceiling or (hi is not None and hi <= lo + 1):
            break
        # The line through the traced points predicts the next size.
        if hi is None:
            per = max(slope, 1.0)
            below = [x for x in fitting if x < lo]
            if below and at(lo).peak_device > at(below[0]).peak_device:
                # The chord from the smallest fitting size: peak is convex in the batch,
                # so it is at most the slope at lo, and the step it gives reaches the edge.
                first = at(below[0])
                per = (at(lo).peak_device - first.peak_device) / (lo - below[0])
            step = int(at(lo).headroom // per) if lo else 0
            b = min(ceiling, max(lo + 1, lo + lo // 64, min(lo + step, 2 * lo)))
        else:
            # The line through the bracket's traces, or (every third step, so that peaks
            # the allocator's rounding makes jumpy cannot creep it up one by one) its middle.
            bracketed += 1
            base = at(lo) if lo else None
            top = None if hi in failed else at(hi)
            if (
                bracketed % 3
                and base is not None
                and top is not None
                and top.peak_device > base.peak_device
            ):
                per = (top.peak_device - base.peak_device) / (hi - lo)
                b = lo + int(base.headroom // per)
            else:
                b = (lo + hi) // 2
            if not lo < b < hi:
                b = (lo + hi) // 2 if hi - lo > 1 else lo
            if b == lo and hi - lo > 1:
                b = lo + 1
            if b <= 0:
                return 0, hi
    return lo, hi


#: The longest input a length search tries for a model without a length limit:
#: about four million tokens, or a day of audio.
LENGTH_BOUND: dict[str, float] = {"seq_len": float(1 << 22), "seconds": 86_400.0}


def _search_length(
    entry: Any, length_arg: str, at: Callable[..., Estimate], budget: int
) -> tuple[int | float, list[tuple[float, int, bool]], bool]:
    """The largest length that fits at batch 1, its traces, and whether it is the ceiling.

    The ceiling is the model's ``max_length`` or, for a model without one,
    :data:`LENGTH_BOUND`. Three traces below the default length fit a parabola
    whose root is the first guess; then a bracket (longest fitting, shortest
    not fitting) is kept, doubling while nothing above is known, and narrowed
    until the next step up (5 %, or one unit) does not fit. A length that would
    not fit, or that cannot be traced at all (too long for the model), counts as
    not fitting; only a failure at the shortest probe is an error.
    """
    base = (
        float(entry.default_seq_len or 512)
        if length_arg == "seq_len"
        else float(entry.default_seconds or 10.0)
    )
    ceiling = _round(entry.max_length or LENGTH_BOUND[length_arg], length_arg)
    step_unit = 1.0 if length_arg == "seq_len" else 0.5
    seen: dict[float, tuple[int, bool]] = {}
    smallest = _round(min(base / 4, ceiling), length_arg)

    def fits(n: float) -> bool:
        if n not in seen:
            try:
                e = at(1, n)
            except EstimateError:
                if n <= smallest:
                    raise
                # Too long to trace (say, longer than the model's positions): does not fit.
                seen[n] = (-1, False)
            else:
                seen[n] = (e.peak_device, e.fits)
        return seen[n][1]

    def curve() -> list[tuple[float, int, bool]]:
        # A length that could not be traced has no peak to show.
        return sorted((n, p, f) for n, (p, f) in seen.items() if p >= 0)

    def up(n: float) -> int | float:
        """The next length the answer must not fit at: 5 % more, or one unit more."""
        return _round(n * 1.05 if n * 0.05 > step_unit else n + step_unit, length_arg)

    xs = sorted({_round(min(x, ceiling), length_arg) for x in (base / 4, base / 2, base)})
    if not fits(xs[0]):
        return 0, curve(), False
    lo: int | float = xs[0]
    hi: int | float | None = None
    for x in xs[1:]:
        if not fits(x):
            hi = x
            break
        lo = x
    guess: float | None = None
    traced = [(x, seen[x][0]) for x in xs if seen[x][0] >= 0]
    if hi is None and len(traced) == 3:
        guess = _quadratic_root(traced, budget)
        if guess is not None and not (math.isfinite(guess) and guess > 0):
            guess = None
    bracketed = 0
    for _ in range(60):
        if lo >= ceiling:
            return ceiling, curve(), True
        if hi is not None and hi <= up(lo):
            break
        if hi is None:
            # Nothing above is known to fail: the parabola's guess first, then doubling.
            n = _round(min(guess, ceiling), length_arg) if guess is not None else None
            guess = None
            if n is None or n <= lo:
                n = min(ceiling, _round(2 * lo, length_arg))
        else:
            # The line through the bracket's traces, or (every third step, so that a
            # curved peak cannot stall the search at one end) the bracket's middle.
            bracketed += 1
            n = up(lo)
            if bracketed % 3:
                n = max(n, _round(_interpolate(lo, hi, seen, budget), length_arg))
            if n >= hi or bracketed % 3 == 0:
                n = _round((lo + hi) / 2, length_arg)
                if not lo < n < hi:
                    break
        if fits(n):
            lo = n
        else:
            hi = n if hi is None else min(hi, n)
    return lo, curve(), False


def _interpolate(lo: float, hi: float, seen: dict[float, tuple[int, bool]], budget: int) -> float:
    """The length where the line through the traces at ``lo`` and ``hi`` meets the budget."""
    p_lo, p_hi = seen[lo][0], seen[hi][0]
    if p_hi <= p_lo or p_lo < 0:
        return (lo + hi) / 2
    return lo + (budget - p_lo) * (hi - lo) / (p_hi - p_lo)


def _round(x: float, length_arg: str) -> int | float:
    return max(1, int(x)) if length_arg == "seq_len" else max(0.5, round(x * 2) / 2)
