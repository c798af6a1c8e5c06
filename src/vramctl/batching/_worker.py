"""One device's worker: its model, its guard, and a CPU copy for an item that does not fit.

A worker runs each loaded batch under a :class:`~vramctl.guard.Guard`: a batch that runs
out of memory finishes in pieces, and one whose single items do not fit runs on the CPU,
on a copy of the model made then. Its outputs leave the device at once, each item cut to
its valid frames.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vramctl.batching._adaptive import BatchingError
from vramctl.batching._manifest import Item
from vramctl.batching._outputs import (
    Done,
    Forward,
    frames_per_second,
    time_major,
    valid_frames,
)
from vramctl.device import Device, get_device
from vramctl.guard import Guard, StepDoesNotFitError

__all__ = ["ModelFactory", "Worker", "model_factory"]

log = logging.getLogger("vramctl.batching")

ModelFactory = Callable[[], nn.Module]


class _Rows:
    """Per-item outputs of one piece; the guard hands back a list of them for a split batch."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows

    @staticmethod
    def join(result: _Rows | list[_Rows]) -> list[torch.Tensor]:
        parts = result if isinstance(result, list) else [result]
        return [row for part in parts for row in part.rows]


class Worker:
    """One device: its model, its guard, and a CPU copy made when one item does not fit."""

    def __init__(
        self,
        make_model: Callable[[], nn.Module],
        dev: Device,
        forward: Forward,
        sample_rate: int,
    ) -> None:
        self.dev = dev
        self.sample_rate = sample_rate
        self.user_forward = forward
        #: The forward reads the waveforms on the host (a checkpoint's feature extractor).
        self._host_inputs = bool(getattr(forward, "host_inputs", False))
        self._make_model = make_model
        with dev.uncounted():  # made on the host; counted once, by its own device
            self.model = _place(make_model(), dev)
        self.guard = Guard(self.model, device=dev, forward=self._forward)
        self._cpu: Guard | None = None
        self.cpu_fallbacks = 0
        self.batches = 0
        self.items = 0
        self.peak = 0
        #: Output frames per second of audio: the first batch's, then measured (chunks).
        self.frame_rate: float | None = None
        self._rate_measured = False

    def _forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> _Rows:
        waveforms, lengths = batch["waveforms"], batch["lengths"]
        if model is self.model and not self._host_inputs:  # not the CPU fallback's copy
            waveforms = self.dev.put(waveforms)
        out, frames = time_major(self.user_forward(model, waveforms, lengths))
        del waveforms
        padded, out_len = int(batch["waveforms"].shape[1]), int(out.shape[1])
        if frames is None:
            frames = valid_frames(model, lengths, padded, out_len)
        if self.frame_rate is None:
            self.frame_rate = frames_per_second(model, padded, out_len, self.sample_rate)
        frames = frames.to("cpu")
        with self.dev.uncounted():  # outputs leave the device at once: the next piece has room
            rows = [out[i, : int(frames[i])].detach().to("cpu").clone() for i in range(len(out))]
        return _Rows(rows)

    def _output_length(self, model: nn.Module, samples: int) -> int:
        """The model's output frames for one input of ``samples`` samples (zeros)."""
        waveforms = torch.zeros(1, samples)
        if model is self.model and not self._host_inputs:
            waveforms = self.dev.put(waveforms)
        with torch.no_grad():
            out, _ = time_major(self.user_forward(model, waveforms, torch.tensor([samples])))
        return int(out.shape[1])

    def run(self, loaded: dict[str, Any]) -> Done:
        items: list[Item] = loaded["items"]
        failures = [(item, message) for item, message in loaded["errors"]]
        outputs: list[tuple[Item, torch.Tensor]] = []
        if items:
            batch = {"waveforms": loaded["waveforms"], "lengths": loaded["lengths"]}
            try:
                with self.dev.counting():
                    rows = _Rows.join(self.guard.infer(batch))
            except StepDoesNotFitError as exc:
                log.warning("%s: %s; running this batch on the CPU", self.dev.id, exc)
                rows = self._on_cpu(batch)
            outputs = list(zip(items, rows, strict=True))
            self.batches += 1
            self.items += len(items)
            if not self._rate_measured and any(i.parent is not None for i in items):
                # Chunks are stitched by the frame rate: measure it rather than take the
                # first batch's ratio (once, and only for a run with long recordings).
                self._rate_measured = True
                probe = functools.partial(self._output_length, self.model)
                with self.dev.counting():
                    self.frame_rate = frames_per_second(
                        self.model, 0, 0, self.sample_rate, probe, fallback=self.frame_rate
                    )
        self.peak = max(self.peak, _peak(self.dev))
        durations = [i.duration for i in items]
        return Done(
            outputs,
            failures,
            len(durations) * max(durations, default=0.0),
            sum(durations),
            self.frame_rate,
            list(loaded.get("warnings", ())),
        )

    def _on_cpu(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self.cpu_fallbacks += 1
        with self.dev.uncounted():
            if self._cpu is None:
                cpu = get_device("cpu")
                model = self._make_model().to("cpu").eval()
                self._cpu = Guard(model, device=cpu, forward=self._forward)
            return _Rows.join(self._cpu.infer(batch))

    def summary(self) -> dict[str, Any]:
        mem = self.dev.memory()
        total = mem.total if isinstance(mem.total, int) else None
        return {
            "device": self.dev.id,
            "batches": self.batches,
            "items": self.items,
            "peak_bytes": self.peak,
            "total_bytes": total,
            "ooms": self.guard.ooms,
            "ooms_recovered": self.guard.recovered,
            "cpu_fallbacks": self.cpu_fallbacks,
        }


def _place(model: nn.Module, dev: Device) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise BatchingError(f"the model factory must return an nn.Module, got {type(model)}")
    placed: nn.Module = dev.adopt(model)  # a simulated GPU counts it: its model.to("cuda")
    return placed.eval()


def _peak(dev: Device) -> int:
    mem = dev.memory()
    for value in (mem.peak_reserved, mem.peak_allocated, mem.used):
        if isinstance(value, int):
            return value
    return 0


def model_factory(model: nn.Module | ModelFactory, devices: int) -> Callable[[int], nn.Module]:
    """Model for the k-th device: a given module is used on the first, copies on the rest.

    Each call after the first for a device (the CPU fallback's model) gets a copy of the
    module as given, never the module that device runs (moving it would move that).
    """
    if isinstance(model, nn.Module):
        module = model
        copies = [copy.deepcopy(model) for _ in range(devices - 1)]  # before it moves
        pristine = copy.deepcopy(model)  # for the CPU fallbacks, made before it moves
        given: set[int] = set()

        def make(k: int) -> nn.Module:
            if k in given:
                return copy.deepcopy(pristine)
            given.add(k)
            return module if k == 0 else copies[k - 1]

        return make
    if not callable(model):
        raise BatchingError(f"model must be an nn.Module or a factory, got {type(model)}")
    factory = model

    def seeded(k: int) -> nn.Module:
        # Under a fixed seed: a model with random weights (a built-in architecture, a
        # factory that loads nothing) is the same on every device and in a resumed run.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(0)  # the host's generator only
            return factory()

    return seeded
