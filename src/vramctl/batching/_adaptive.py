"""``AdaptiveBatcher``: batches whose size follows the memory that is free.

Each batch's size is the room for it divided by a per-sample cost, read when
the batch is drawn: the room is what the device has available above the
``target`` utilization (or a fixed ``budget``), the per-sample cost is given or
comes from the estimator's fit (bytes per extra sample). Sizes shrink at once
when the room falls, and grow back only after ``grow_after`` draws in a row
that allowed more, by at most ``grow_factor`` at a time. ``state_dict()``
records how far an epoch got, so a restarted job resumes after the last batch
it consumed, with no sample lost or repeated.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset, default_collate

from vramctl._errors import VramctlError
from vramctl._tensors import tensors
from vramctl._units import format_bytes, parse_size
from vramctl.device import Device, resolve
from vramctl.estimator import Step, max_batch_size
from vramctl.estimator._shared import run_allocator

__all__ = ["AdaptiveBatcher", "BatchingError", "MapDataset"]

_STATE_VERSION = 1
#: Per draw without an OOM, the correction factor recovers by this much (up to 1).
_RECOVER = 1.1
#: The correction factor never falls below this.
_MIN_CORRECTION = 2.0**-10
#: With model= and no max_batch, sizes up to this are traced and drawn (real batches are built).
_ESTIMATE_LIMIT = 1024
#: Estimate categories that stay allocated between steps (already held when a batch is drawn).
_RESIDENT = ("parameters", "optimizer", "context", "workspaces")


class BatchingError(VramctlError, ValueError):
    """Bad input to a batcher, or a saved state that does not belong to it."""


class MapDataset(Protocol):
    """A map-style dataset: ``len(dataset)`` and ``dataset[i]`` for ``0 <= i < len``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class AdaptiveBatcher:
    """Batches from a map-style dataset, sized to the memory free when each is drawn.

    Give the memory state as ``device=`` (room = available bytes minus
    ``(1 - target)`` of the total, minus ``reserve``) or ``budget=`` (a fixed
    room), or both (the smaller room). Give the per-sample cost as
    ``per_sample_bytes=``, or pass ``model=`` to have the estimator measure it.
    Each ``iter()`` yields the rest of the current epoch; a batch counts as
    consumed once it is yielded, so take :meth:`state_dict` after processing it.

    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> from vramctl.batching import AdaptiveBatcher
    >>> data = TensorDataset(torch.arange(10))
    >>> batcher = AdaptiveBatcher(data, budget="4KiB", per_sample_bytes=1024)
    >>> [ids.tolist() for (ids,) in batcher]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    >>> batcher.state_dict()["epoch"], batcher.state_dict()["position"]
    (1, 0)
    """

    def __init__(
        self,
        dataset: MapDataset,
        *,
        device: Device | str | int | None = None,
        budget: int | str | None = None,
        target: float = 0.9,
        reserve: int | str = 0,
        per_sample_bytes: int | float | str | None = None,
        model: torch.nn.Module | None = None,
        mode: str = "train",
        optimizer: str | Callable[..., torch.optim.Optimizer] | None = "adamw",
        model_input: Callable[[Any], Any] | None = None,
        estimate_options: Step | Mapping[str, Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        min_batch: int = 1,
        max_batch: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        grow_after: int = 3,
        grow_factor: float = 2.0,
        drop_last: bool = False,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
        ):
            raise BatchingError(
                f"{type(dataset).__name__} is not a map-style dataset: it needs __len__ and "
                "__getitem__ (an IterableDataset has no positions to resume from)"
            )
        if device is None and budget is None:
            raise BatchingError("give device= (a Device, e.g. vramctl.simulate(...)) or budget=")
        if not 0.0 < target <= 1.0:
            raise BatchingError(f"target must be in (0, 1], got {target!r}")
        if isinstance(min_batch, bool) or not isinstance(min_batch, int) or min_batch < 1:
            raise BatchingError(f"min_batch must be an int of 1 or more, got {min_batch!r}")
        if max_batch is not None and (
            isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < min_batch
        ):
            raise BatchingError(f"max_batch must be an int >= min_batch, got {max_batch!r}")
        if isinstance(grow_after, bool) or not isinstance(grow_after, int) or grow_after < 1:
            raise BatchingError(f"grow_after must be an int of 1 or more, got {grow_after!r}")
        if not grow_factor > 1.0:
            raise BatchingError(f"grow_factor must be more than 1, got {grow_factor!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise BatchingError(f"seed must be an int, got {seed!r}")
        self.dataset = dataset
        self.length = len(dataset)
        self.device = _resolve_device(device)
        self.budget = None if budget is None else _size("budget", budget)
        self.target = float(target)
        self.reserve = _size("reserve", reserve)
        self.collate_fn: Callable[[list[Any]], Any] = collate_fn or default_collate
        self.min_batch = min_batch
        self.max_batch = max_batch
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.grow_after = grow_after
        self.grow_factor = float(grow_factor)
        self.drop_last = bool(drop_last)
        #: Batch size of every batch drawn by this object, in order.
        self.sizes: list[int] = []
        #: The estimator's answer when ``model=`` gave the per-sample cost.
        self.estimated_max_batch: int | None = None
        #: Bytes a step needs beyond its samples that are not held between steps (from
        #: the estimator with ``model=``; 0 otherwise): held back from the room like ``reserve``.
        self.overhead_bytes = 0
        self.epoch = 0
        self.position = 0
        self.correction = 1.0
        self.last_room: int | None = None
        self.shrinks = self.grows = self.ooms = self.starved = 0
        self._size: int | None = None  # the current adaptive size (before the epoch's tail)
        self._streak = 0  # consecutive draws whose room allowed more than _size
        self._oom_since_draw = False
        self._generation = 0
        self.per_sample_bytes = self._per_sample(
            per_sample_bytes, model, mode, optimizer, model_input, estimate_options
        )

    # -- per-sample cost and room --------------------------------------------------

    def _per_sample(
        self,
        given: int | float | str | None,
        model: torch.nn.Module | None,
        mode: str,
        optimizer: str | Callable[..., torch.optim.Optimizer] | None,
        model_input: Callable[[Any], Any] | None,
        options: Step | Mapping[str, Any] | None,
    ) -> int:
        if given is not None:
            if model is not None:
                raise BatchingError("give per_sample_bytes= or model=, not both")
            value = _size("per_sample_bytes", given)
            if value <= 0:
                raise BatchingError(f"per_sample_bytes must be positive, got {given!r}")
            return value
        if model is None:
            raise BatchingError(
                "give per_sample_bytes= (bytes one sample adds to a step) or model= "
                "(to have the estimator measure it)"
            )
        if self.length == 0:
            raise BatchingError("the estimator needs at least one sample; the dataset is empty")
        n, collate = self.length, self.collate_fn
        to_input = model_input or (lambda batch: batch)

        def make_batch(b: int) -> Any:
            return to_input(collate([self.dataset[i % n] for i in range(b)]))

        limit = self.max_batch or min(max(n, 4), _ESTIMATE_LIMIT)
        search: dict[str, Any] = {}
        if isinstance(options, Mapping):
            options, search = Step.split(options)
        kwargs: dict[str, Any] = {"limit": limit, **search}
        try:
            # On the device itself, whose context is already made and whose free memory
            # the batcher follows: the point estimate, not the safe end of the context's range.
            request = Step.of(options, mode=mode, optimizer=optimizer, safe=False)
            found = max_batch_size(
                model,
                make_batch,
                step=request.replace(
                    device=self.device,
                    target_utilization=self.target,
                    allocator_config=run_allocator(self.device, request.allocator_config),
                ),
                **kwargs,
            )
        except VramctlError as exc:
            raise BatchingError(f"the estimator could not size a sample: {exc}") from exc
        self.estimated_max_batch = found.batch_size
        # The cost below is safe only up to the largest size traced: never draw more.
        traced = max((b for b, _, _ in found.curve), default=1)
        self.max_batch = max(self.min_batch, min(int(kwargs["limit"]), traced))
        # Peak memory is convex in the batch size (a max of affine phases), so the chord
        # from 1 to the largest size that fits lies above the curve between them: a safe
        # cost per sample. The probes' own slope can be 0 under the allocator's rounding.
        curve = {b: peak for b, peak, _ in found.curve}
        top = max((b for b, _, fits in found.curve if fits), default=max(curve))
        slope = found.per_sample
        if top > 1 and 1 in curve:
            slope = max(slope, (curve[top] - curve[1]) / (top - 1))
        # A sample takes at least its own input's bytes.
        per_sample = max(1, math.ceil(slope), sum(t.nbytes for t in tensors(make_batch(1))))
        # What the step holds beyond its samples but not between steps (gradients,
        # temporaries): the peak at one sample less what stays allocated.
        if found.estimate is not None and 1 in curve:
            parts = found.estimate.breakdown
            resident = sum(parts.get(k, 0) for k in _RESIDENT)
            self.overhead_bytes = max(0, curve[1] - per_sample - resident)
        return per_sample

    def room(self) -> int:
        """Bytes available for the next batch's per-sample memory, read now."""
        rooms: list[int] = []
        if self.device is not None:
            dev = self.device
            rooms.append(int(dev.available() - (1.0 - self.target) * dev.capacity()))
        if self.budget is not None:
            rooms.append(self.budget)
        return max(0, min(rooms) - self.reserve - self.overhead_bytes)

    # -- sizing ------------------------------------------------------------------

    def _next_size(self, left: int) -> int:
        if self._oom_since_draw:
            self._oom_since_draw = False
        else:
            self.correction = min(1.0, self.correction * _RECOVER)
        room = self.room()
        self.last_room = room
        want = int(room // self.per_sample_bytes * self.correction)
        if want < self.min_batch:
            self.starved += 1
            want = self.min_batch
        if self.max_batch is not None:
            want = min(want, self.max_batch)
        size = self._size
        if size is None or want == size:
            self._streak = 0
            size = want
        elif want < size:
            self._streak = 0
            self.shrinks += 1
            size = want
        else:
            self._streak += 1
            if self._streak >= self.grow_after:
                self._streak = 0
                self.grows += 1
                size = min(want, max(size + 1, math.ceil(size * self.grow_factor)))
        self._size = size
        return min(size, left)

    def on_guard_event(self, event: Any) -> None:
        """Pass as ``Guard(..., on_event=batcher.on_guard_event)``.

        An OOM the guard survived (an event of kind ``"oom"``) makes the next
        batches smaller, through :meth:`notify_oom` with that batch's size.
        """
        if getattr(event, "kind", None) == "oom":
            self.notify_oom(getattr(event, "batch_size", None))

    def notify_oom(self, batch_size: int | None = None) -> None:
        """A batch ran out of memory anyway: halve the sizes, then recover slowly.

        ``batch_size`` is the size that failed (default: the last one drawn).
        The correction factor applied to every computed size is halved, and
        grows back by 10% per later draw without an OOM.
        """
        self.ooms += 1
        self.correction = max(_MIN_CORRECTION, self.correction / 2)
        self._oom_since_draw = True
        self._streak = 0
        failed = batch_size if batch_size is not None else self._size
        if failed is not None:
            self._size = max(self.min_batch, failed // 2)

    def shrink(self, factor: float = 0.5) -> None:
        """Draw smaller batches from now on, before an OOM forces it (an alert action).

        Like :meth:`notify_oom` with ``factor`` instead of a half, and not
        counted as an OOM; sizes grow back by 10% per draw.
        """
        if not 0.0 < factor < 1.0:
            raise ValueError(f"factor must be between 0 and 1, got {factor}")
        self.correction = max(_MIN_CORRECTION, self.correction * factor)
        self._oom_since_draw = True
        self._streak = 0
        if self._size is not None:
            self._size = max(self.min_batch, int(self._size * factor))

    # -- iteration ---------------------------------------------------------------

    def order(self, epoch: int | None = None) -> list[int]:
        """The sample indices of an epoch in the order they are drawn (rebuilt from the seed)."""
        indices = list(range(self.length))
        if self.shuffle:
            ep = self.epoch if epoch is None else epoch
            # A str seed is hashed with SHA-512: the same order in every process.
            random.Random(f"vramctl.batching:{self.seed}:{ep}").shuffle(indices)
        return indices

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        return self._epoch(self._generation)

    def _epoch(self, generation: int) -> Iterator[Any]:
        order = self.order()
        while True:
            if generation != self._generation:
                raise BatchingError(
                    "this iterator is stale: the batcher was iterated again or reloaded since"
                )
            left = self.length - self.position
            if left <= 0 or (self.drop_last and left < self.min_batch):
                self._end_epoch()
                return
            size = self._next_size(left)
            start = self.position
            batch = self.collate_fn([self.dataset[i] for i in order[start : start + size]])
            self.sizes.append(size)
            self.position = start + size
            left = self.length - self.position
            if left <= 0 or (self.drop_last and left < self.min_batch):
                self._end_epoch()
                yield batch
                return
            yield batch

    def _end_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    @property
    def remaining(self) -> int:
        """Samples left in the current epoch (how many batches depends on memory)."""
        return self.length - self.position

    # -- state -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A small JSON-able record of how far the batcher got (batches yielded so far)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "length": self.length,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "correction": self.correction,
            "batch_size": self._size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the last batch the saved state counted, in the same order.

        Refuses a state from a dataset of another length or another shuffle or seed.
        """
        try:
            version, epoch, position = state["version"], state["epoch"], state["position"]
            length, seed, shuffle = state["length"], state["seed"], state["shuffle"]
            correction, size = float(state["correction"]), state["batch_size"]
        except (KeyError, TypeError, ValueError) as exc:
            raise BatchingError(f"not an AdaptiveBatcher state: {exc!r}") from exc
        if version != _STATE_VERSION:
            raise BatchingError(f"state version {version!r} is not {_STATE_VERSION}")
        if length != self.length:
            raise BatchingError(
                f"the state is for a dataset of {length!r} samples; this one has {self.length}"
            )
        if seed != self.seed or shuffle != self.shuffle:
            raise BatchingError(
                f"the state was saved with shuffle={shuffle!r}, seed={seed!r}; this batcher has "
                f"shuffle={self.shuffle!r}, seed={self.seed!r}: the order would differ"
            )
        ints = (epoch, position) + (() if size is None else (size,))
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints):
            raise BatchingError("epoch, position and batch_size in a state must be ints")
        if epoch < 0 or not 0 <= position <= self.length or not 0 < correction <= 1:
            raise BatchingError(f"state out of range: {dict(state)!r}")
        if position == self.length and self.length > 0:
            epoch, position = epoch + 1, 0
        self.epoch, self.position, self.correction = epoch, position, correction
        if size is not None:
            size = max(self.min_batch, min(size, self.max_batch or size))
        self._size = size
        self._streak = 0
        self._oom_since_draw = False
        self._generation += 1  # iterators made before the load stop

    def summary(self) -> dict[str, Any]:
        """What the batcher did: sizes drawn, shrinks, grows, OOMs and starved draws."""
        sizes = self.sizes
        return {
            "epoch": self.epoch,
            "position": self.position,
            "length": self.length,
            "batches": len(sizes),
            "samples": sum(sizes),
            "min_size": min(sizes) if sizes else None,
            "max_size": max(sizes) if sizes else None,
            "mean_size": sum(sizes) / len(sizes) if sizes else None,
            "last_size": sizes[-1] if sizes else None,
            "per_sample_bytes": self.per_sample_bytes,
            "last_room_bytes": self.last_room,
            "shrinks": self.shrinks,
            "grows": self.grows,
            "ooms": self.ooms,
            "starved": self.starved,
            "correction": self.correction,
        }

    def __repr__(self) -> str:
        return (
            f"AdaptiveBatcher(length={self.length}, epoch={self.epoch}, "
            f"position={self.position}, per_sample={format_bytes(self.per_sample_bytes)})"
        )


def _size(name: str, value: int | float | str) -> int:
    try:
        return parse_size(value)
    except VramctlError as exc:
        raise BatchingError(f"{name}: {exc}") from exc


def _resolve_device(device: Device | str | int | None) -> Device | None:
    if device is None:
        return None  # no device: the budget alone bounds the batch
    try:
        return resolve(device)
    except VramctlError as exc:
        raise BatchingError(f"device: {exc}") from exc
