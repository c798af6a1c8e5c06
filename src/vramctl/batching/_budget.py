"""Batch budgets: how many items of a given length a batch may hold.

A budget is a small policy behind the :class:`Budget` protocol:
``max_count(longest)`` is the largest number of items, none longer than
``longest``, that a batch may hold (0 when one such item alone is over), and
``cost(count, longest)`` is the budget's measure of such a batch, at most
``limit`` for a batch within it. Samplers treat budgets as **hard**: an item
that would take a batch over closes the batch first.

- :class:`PaddedDuration`: total seconds including padding (``count * longest``),
  fairseq's ``max_tokens`` and Lhotse's ``max_duration`` on padded batches;
- :class:`QuadraticDuration`: the same with attention's quadratic cost added,
  ``count * (longest + longest**2 / quadratic_duration)`` (Lhotse's
  ``quadratic_duration``);
- :class:`MemoryBudget`: bytes, from the estimator's peak for your model on your
  device at a few lengths (see :meth:`MemoryBudget.for_model`).

>>> b = PaddedDuration(600)
>>> b.max_count(14.5), b.cost(41, 14.5) <= b.limit
(41, True)
>>> QuadraticDuration(600, quadratic_duration=30).max_count(30.0)
10
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from vramctl._errors import VramctlError
from vramctl._units import format_bytes
from vramctl.batching._adaptive import BatchingError
from vramctl.device import Device, resolve
from vramctl.estimator import Step, estimate
from vramctl.estimator._shared import Target, run_allocator, run_target

__all__ = ["Budget", "MemoryBudget", "PaddedDuration", "QuadraticDuration"]


@runtime_checkable
class Budget(Protocol):
    """How much a batch may hold, by its item count and its longest item."""

    @property
    def limit(self) -> float:
        """The most :meth:`cost` a batch may have."""
        ...

    def max_count(self, longest: float) -> int:
        """The most items no longer than ``longest`` a batch may hold (0: not even one)."""
        ...

    def cost(self, count: int, longest: float) -> float:
        """This budget's measure of a batch of ``count`` items padded to ``longest``."""
        ...


def _positive(name: str, value: float) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise BatchingError(f"{name} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PaddedDuration:
    """At most ``max_duration`` seconds per batch, padding included."""

    max_duration: float
    #: At most this many items per batch, whatever their length (None: no cap).
    max_items: int | None = None

    def __post_init__(self) -> None:
        _positive("max_duration", self.max_duration)
        if self.max_items is not None and self.max_items < 1:
            raise BatchingError(f"max_items must be at least 1, got {self.max_items}")

    @property
    def limit(self) -> float:
        return self.max_duration

    def max_count(self, longest: float) -> int:
        n = int(self.max_duration // longest) if longest > 0 else 0
        return n if self.max_items is None else min(n, self.max_items)

    def cost(self, count: int, longest: float) -> float:
        return count * longest


@dataclass(frozen=True)
class QuadraticDuration:
    """Padded seconds plus attention's quadratic term, at most ``max_duration`` per batch.

    An item of ``d`` seconds costs ``d + d**2 / quadratic_duration``: at
    ``d == quadratic_duration`` the attention term equals the linear one.
    """

    max_duration: float
    quadratic_duration: float = 30.0
    max_items: int | None = None

    def __post_init__(self) -> None:
        _positive("max_duration", self.max_duration)
        _positive("quadratic_duration", self.quadratic_duration)
        if self.max_items is not None and self.max_items < 1:
            raise BatchingError(f"max_items must be at least 1, got {self.max_items}")

    @property
    def limit(self) -> float:
        return self.max_duration

    def _item(self, longest: float) -> float:
        return longest + longest * longest / self.quadratic_duration

    def max_count(self, longest: float) -> int:
        # The float quotient can land a hair under an exact integer: check the product.
        per = self._item(longest)
        n = int(self.max_duration // per) if per > 0 else 0
        while (n + 1) * per <= self.max_duration:
            n += 1
        return n if self.max_items is None else min(n, self.max_items)

    def cost(self, count: int, longest: float) -> float:
        return count * self._item(longest)


#: make_batch(count, seconds) -> a batch as the model takes it.
MakeBatch = Callable[[int, float], Any]


@dataclass(frozen=True)
class _Anchor:
    seconds: float
    #: Predicted peak bytes at batch 1 and the bytes each further sample adds.
    fixed: float
    per_item: float


class MemoryBudget:
    """At most ``budget_bytes`` of predicted peak memory per batch.

    The peak of a step at batch ``n`` and padded length ``L`` is about
    ``fixed(L) + n * per_item(L)``; both parts grow with ``L`` (linearly, and
    quadratically under attention). :meth:`for_model` reads them from the
    estimator at a few anchor lengths; between anchors they are interpolated
    linearly, which for a convex cost lies above it (a safe side), and
    ``max_count(L)`` is how many items fit the budget by that line.
    Beyond the last anchor nothing fits: give ``max_duration`` as the longest
    item a batch may hold (chunk longer ones).

    >>> mb = MemoryBudget(1000, [(10.0, 100.0, 50.0), (20.0, 150.0, 100.0)])
    >>> mb.max_count(10.0), mb.max_count(15.0), mb.max_count(20.0), mb.max_count(25.0)
    (19, 12, 9, 0)
    """

    def __init__(
        self,
        budget_bytes: int,
        anchors: Sequence[tuple[float, float, float]],
        *,
        max_items: int | None = None,
        notes: Sequence[str] = (),
    ) -> None:
        if budget_bytes <= 0:
            raise BatchingError(f"budget_bytes must be positive, got {budget_bytes}")
        if not anchors:
            raise BatchingError("a memory budget needs at least one anchor length")
        if max_items is not None and max_items < 1:
            raise BatchingError(f"max_items must be at least 1, got {max_items}")
        self.budget_bytes = int(budget_bytes)
        # A longer item never costs less: each anchor takes at least the cost of every
        # shorter one (a measured dip, e.g. from the allocator's rounding, is not trusted),
        # and anchors at the same length merge into the larger.
        merged: list[_Anchor] = []
        for s, f, p in sorted((float(s), float(f), max(float(p), 1.0)) for s, f, p in anchors):
            if merged:
                f, p = max(f, merged[-1].fixed), max(p, merged[-1].per_item)
                if merged[-1].seconds == s:
                    merged.pop()
            merged.append(_Anchor(s, f, p))
        self.anchors = merged
        self._seconds = [a.seconds for a in self.anchors]
        self.max_items = max_items
        self.notes = tuple(notes)
        self._cache: dict[float, int] = {}

    def __repr__(self) -> str:
        return (
            f"MemoryBudget({format_bytes(self.budget_bytes)}, anchors at "
            f"{', '.join(f'{s:g}s' for s in self._seconds)})"
        )

    @property
    def limit(self) -> float:
        return float(self.budget_bytes)

    @property
    def max_duration(self) -> float:
        """The longest item this budget has a prediction for."""
        return self._seconds[-1]

    def peak(self, count: int, longest: float) -> float:
        """The predicted peak bytes of a batch (conservative between anchors)."""
        i = bisect.bisect_left(self._seconds, longest)
        if i >= len(self.anchors):
            return math.inf
        hi = self.anchors[i]
        if i == 0 or hi.seconds == longest:
            return hi.fixed + (count - 1) * hi.per_item
        lo = self.anchors[i - 1]
        w = (longest - lo.seconds) / (hi.seconds - lo.seconds)
        fixed = lo.fixed + w * (hi.fixed - lo.fixed)
        per = lo.per_item + w * (hi.per_item - lo.per_item)
        return fixed + (count - 1) * per

    def max_count(self, longest: float) -> int:
        hit = self._cache.get(longest)
        if hit is not None:
            return hit
        i = bisect.bisect_left(self._seconds, longest)
        if i >= len(self.anchors):
            n = 0
        else:
            base = self.peak(1, longest)
            if base > self.budget_bytes:
                n = 0
            else:
                per = self.peak(2, longest) - base
                n = 1 + int((self.budget_bytes - base) // per)
        if self.max_items is not None:
            n = min(n, self.max_items)
        if len(self._cache) < 100_000:
            self._cache[longest] = n
        return n

    def cost(self, count: int, longest: float) -> float:
        return self.peak(count, longest)

    def table(self, edges: Sequence[float]) -> list[tuple[float, int]]:
        """``(longest, max_count)`` at each length: the per-bucket batch sizes."""
        return [(e, self.max_count(e)) for e in edges]

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        make_batch: MakeBatch,
        *,
        max_duration: float,
        device: Device | str | None = None,
        target: float = 0.9,
        budget_bytes: int | None = None,
        mode: str = "infer",
        anchors: int = 4,
        min_duration: float | None = None,
        max_items: int | None = None,
        step: Step | None = None,
        **estimate_options: Any,
    ) -> MemoryBudget:
        """The memory budget of ``model`` on ``device``, predicted by the estimator.

        ``make_batch(count, seconds)`` builds a batch of ``count`` items padded
        to ``seconds``; tensors on the meta device cost no memory and are traced
        as real ones (integer tensors the model reads, such as lengths, must be
        real). The step is traced on fake tensors (no memory used) at
        ``anchors`` lengths up to ``max_duration``, at two batch sizes each,
        then once more at the predicted count to correct for the allocator's
        rounding: no real step runs. The budget is ``target`` of what the
        device has free now (``budget_bytes`` overrides it), less what the
        model already holds there, which the estimate counts itself. The estimate's
        other options are ``step`` (a :class:`vramctl.Step`) or keyword arguments (its
        fields), not both; ``mode`` fills in where they leave it at the default, and the
        device is the budget's.
        """
        if step is not None and estimate_options:
            raise BatchingError(
                "give the estimate's options in step= or as keyword arguments, not both: "
                + ", ".join(sorted(estimate_options))
            )
        try:
            request = Step.of(step if step is not None else estimate_options, mode=mode)
        except VramctlError as exc:
            raise BatchingError(str(exc)) from None
        if max_duration <= 0:
            raise BatchingError(f"max_duration must be positive, got {max_duration}")
        if anchors < 1:
            raise BatchingError(f"anchors must be at least 1, got {anchors}")
        where: Target | Device | str
        if budget_bytes is None:
            dev = resolve(device)
            budget_bytes = _room(dev, target, model)
            where = run_target(dev)
        else:
            where = Target("budget", int(budget_bytes), None, cuda=False)
            if device is not None:
                where = run_target(resolve(device))
        if budget_bytes <= 0:
            raise BatchingError("no memory is left on the device for a batch")
        allocator = run_allocator(resolve(device), request.allocator_config)
        lo = min_duration if min_duration is not None else max_duration / 8
        lengths = _anchor_lengths(lo, max_duration, anchors)
        rows: list[tuple[float, float, float]] = []
        notes: list[str] = []
        # The estimator's own probes (CPU kernels on real tensors) are host memory, not a
        # batch's: on an active simulated GPU they would count against it.
        with resolve(device).uncounted():
            for seconds in lengths:

                def peak(n: int, seconds: float = seconds) -> float:
                    est = estimate(
                        model,
                        lambda b, s=seconds: make_batch(b, s),
                        batch_size=n,
                        step=request.replace(device=where, allocator_config=allocator),
                    )
                    return float(est.peak_reserved)

                one, m = peak(1), 4
                at_m = peak(m)
                # The allocator rounds to blocks of up to 20 MiB: for small items, grow the
                # second anchor until the line through the two spans more than that.
                while at_m - one < _SPAN and at_m <= budget_bytes and m < _MAX_ANCHOR:
                    m *= 4
                    at_m = peak(m)
                per = max((at_m - one) / (m - 1), 1.0)
                n = 1 + int((budget_bytes - one) // per) if one <= budget_bytes else 0
                # The line misses the allocator's rounding at n: refit through the peak
                # there, and check the count the new line gives once more.
                for _ in range(2):
                    if n <= m:
                        break
                    at_n = peak(n)
                    if at_n <= budget_bytes:
                        break
                    per = (at_n - one) / (n - 1) * (1 + 1e-9)
                    n = 1 + int((budget_bytes - one) // per)
                rows.append((seconds, one, per))
                if one > budget_bytes:
                    notes.append(f"one item of {seconds:g} s alone is over the budget")
        return cls(int(budget_bytes), rows, max_items=max_items, notes=notes)


#: The least rise between the two anchors' peaks that the line through them is fitted on.
_SPAN = 64 * 2**20
#: The largest second anchor (items): the batch make_batch builds for it is real.
_MAX_ANCHOR = 4**7


def _anchor_lengths(lo: float, hi: float, k: int) -> list[float]:
    if k == 1 or lo >= hi:
        return [hi]
    ratio = (hi / lo) ** (1 / (k - 1))
    return [*(lo * ratio**i for i in range(k - 1)), hi]


def _room(dev: Device, target: float, model: torch.nn.Module) -> int:
    if not 0 < target <= 1:
        raise BatchingError(f"target must be in (0, 1], got {target!r}")
    total = dev.capacity()
    used = total - dev.available()
    # Only what the device holds counts (a model made outside a simulated GPU is host memory).
    held = {
        t.untyped_storage().data_ptr() or id(t): t.untyped_storage().nbytes()
        for t in (*model.parameters(), *model.buffers())
        if dev.owns(t)
    }
    held_bytes = sum(held.values())
    # The estimate counts the model's own weights: leave them in the budget.
    return int(target * total) - (used - held_bytes)
