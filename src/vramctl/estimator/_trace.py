"""Tracing a step on fake tensors: every storage's birth and death, in order.

A :class:`Tracer` is a ``TorchDispatchMode`` that sits above a
``FakeTensorMode``. Every operator runs on fake tensors (shapes, dtypes and
strides, no data, no memory); the tracer notes each new storage an operator
returns, with its size, the operator, the module and the phase, and a weakref
finalizer notes when the storage dies. The result is the sequence of
allocations and frees the real step would make, which the allocator model
replays.

Data-dependent operators (``.item()``, ``nonzero``, boolean masks,
``masked_select``, ``unique``) cannot run on tensors without data. The tracer
keeps real values beside the fake tensors that are derived only from the inputs
(token ids, labels, masks, positions) and computes such operators on them, so
they get their real results. Where an operator's inputs depend on the model's
weights, their values are unknown: the tracer then takes the largest output
the operator could have (every element selected, every value distinct) and
records that assumption, so an estimate errs high, never low.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from vramctl._tensors import storage, tensors
from vramctl.estimator._opcost import OpCost, op_cost
from vramctl.estimator._patch import patched

__all__ = [
    "EagerLinear",
    "StorageRecord",
    "Trace",
    "Tracer",
    "no_op_module_to",
    "storage_resizes",
]

#: Outputs up to this many elements get real values when their inputs have them.
KNOWN_NUMEL_LIMIT = 1 << 22
#: Largest stand-in (in elements) the tracer builds to bound an unknown data-dependent op.
BOUND_NUMEL_LIMIT = 1 << 26

_aten = torch.ops.aten
#: Random and uninitialised factories: their real values are meaningless, so never known.
#: Operators whose output *shape* follows their input *values*: unknown values there
#: are an assumption. Other operators that refuse fake tensors (no fake kernel, like
#: ``_ctc_loss``) only need values of the right shape, and the result is exact.
_VALUE_SHAPED = {
    "_local_scalar_dense",
    "is_nonzero",
    "equal",
    "nonzero",
    "nonzero_static",
    "argwhere",
    "masked_select",
    "index",
    "index_put",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
    "bincount",
    "histc",
    "segment_reduce",
}
#: Uniform [0, 1) random factories: their values are taken at the top of the range, so a
#: random skip such as layer drop (``if torch.rand([]) < p: skip``) is not taken. Only
#: small draws (up to ``RANDOM_NUMEL_LIMIT``) get values; in-place fills (weight init) none.
_UNIFORM = {
    _aten.rand.default,
    _aten.rand.generator,
    _aten.rand_like.default,
}
RANDOM_NUMEL_LIMIT = 1 << 12
#: Unknown truth values read as true at one place before a loop on them is cut.
LOOP_LIMIT = 1000
_NOT_KNOWN = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.bernoulli_.float,
    _aten.bernoulli.default,
    _aten.native_dropout.default,
}


#: Whether autograd's gradient sums are modelled in place where eager autograd makes them
#: so (the default). Under any ``TorchDispatchMode`` (a recorder, a debugging mode) ATen
#: treats every tensor as a subclass and sums out of place; :func:`sums_out_of_place`
#: models such a step.
_INPLACE_SUMS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "vramctl_inplace_sums", default=True
)


@contextlib.contextmanager
def sums_out_of_place() -> Iterator[None]:
    """Trace steps as they run under a ``TorchDispatchMode``: every gradient sum out of
    place (``InputBuffer::accumulate`` takes every tensor for a subclass while a mode is
    active). A step recorded operator by operator ran so."""
    token = _INPLACE_SUMS.set(False)
    try:
        yield
    finally:
        _INPLACE_SUMS.reset(token)


@dataclass
class StorageRecord:
    """One storage the step holds: its size and where it came from."""

    nbytes: int
    op: str
    module: str
    phase: str
    #: Set after the trace: parameters, gradients, optimizer, inputs, activations, temporaries.
    category: str = ""
    freed_phase: str | None = None
    #: The autograd node (its sequence number) whose backward made it; -1: none.
    node: int = -1


@dataclass
class Trace:
    """The allocations and frees of one traced step, in order."""

    #: Storage ids: ``sid >= 0`` is an allocation of ``records[sid]``, ``~sid`` its free.
    events: list[int] = field(default_factory=list)
    records: list[StorageRecord] = field(default_factory=list)
    #: Assumptions made where values were unknown (data-dependent operators).
    assumptions: list[str] = field(default_factory=list)
    ops: int = 0
    #: Each operator's FLOPs and bytes, in order (the step-time model's input).
    costs: list[OpCost] = field(default_factory=list)
    #: Each convolution's workspace key, in order (a CUDA target's; see ``conv_key``).
    workspace_keys: list[str] = field(default_factory=list)

    def live_bytes(self) -> Iterator[int]:
        """Live bytes after each event."""
        live = 0
        for e in self.events:
            live += self.records[e].nbytes if e >= 0 else -self.records[~e].nbytes
            yield live

    def peak(self) -> tuple[int, int]:
        """The peak of live bytes and the index of the event that reached it."""
        best, at = 0, -1
        for i, live in enumerate(self.live_bytes()):
            if live > best:
                best, at = live, i
        return best, at

    def loop(self) -> Trace:
        """This step as a loop takes it: its events, then again those of the storages it
        makes and frees, as the next step makes and frees them anew. A storage the step
        makes and keeps (a cache its forward makes once and a module holds, as LeViT's
        attention biases in eval mode) is live from the second step's start and not made
        again: where the first step made it after its peak, the second step's peak holds
        it. As the caching allocator's replay of a loop takes it (``steady``), a storage
        that existed before the step and that the step frees (the batch) is made again;
        state the step replaces (a step counter: the old one freed, the new one kept) is
        then counted twice in the second step, a few bytes. The records are shared."""
        freed = {~e for e in self.events if e < 0}
        again = [e for e in self.events if (e if e >= 0 else ~e) in freed]
        return dataclasses.replace(self, events=[*self.events, *again])

    def live_at(self, index: int) -> list[int]:
        """Storage ids alive just after event ``index``."""
        live: dict[int, None] = {}
        for e in self.events[: index + 1]:
            if e >= 0:
                live[e] = None
            else:
                live.pop(~e, None)
        return list(live)


class Tracer(TorchDispatchMode):
    """Records storage allocations and frees of the operators run under it.

    Use it above a ``FakeTensorMode``::

        with fake_mode, Tracer(fake_mode) as tracer:
            step()
    """

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.fake_mode = fake_mode
        self.trace = Trace()
        self.phase = "setup"
        self.module = ""
        self.last_op = ""
        #: The operator that raised, when the last one to run raised (None: it returned).
        self.failed_op: str | None = None
        #: False: only handle data-dependent operators (building a model), record nothing.
        self.record = True
        #: True once the step's trace is finished (:meth:`close`): a storage that dies
        #: later (the model's, when its session closes) is no event of the step.
        self.closed = False
        #: True: the operators run in host memory (an offloaded optimizer's step): their
        #: storages are not the device's, and their costs are the host's (phase "host").
        self.host = False
        self._sid: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: storage -> [its live record's id, or None while resized to nothing]
        self._cells: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: The category of the storages made now ("" for one decided after the trace).
        self.category = ""
        #: fake tensor -> real tensor with its values, for input-derived tensors.
        self.known: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._assumed: set[tuple[str, str]] = set()
        self._reads: dict[tuple[str, str], int] = {}
        #: fake tensors whose known values come from random numbers (see ``_UNIFORM``).
        self._random: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: Bytes of a modelled kernel workspace for an operator and its outputs (None: none).
        self.workspace: (
            Callable[[Any, tuple[Any, ...], dict[str, Any], list[torch.Tensor]], int] | None
        ) = None
        #: The workspace is made after the operator's outputs (CUDA: a structured kernel's
        #: outputs exist before its implementation asks for scratch), else before them.
        self.scratch_after_outputs = False
        #: Bytes of each intermediate a kernel makes after its outputs and frees before it
        #: returns, in order (empty: none): composite kernels', a CUDA kernel's own.
        self.intermediates: (
            Callable[[Any, tuple[Any, ...], dict[str, Any], list[torch.Tensor]], tuple[int, ...]]
            | None
        ) = None
        #: The real bytes of an operator's outputs where its fake outputs understate them.
        self.output_bytes: (
            Callable[[Any, tuple[Any, ...], dict[str, Any], list[torch.Tensor]], list[int] | None]
            | None
        ) = None
        #: autograd node sequence number -> module that made it (for backward attribution).
        self.node_module: dict[int, str] = {}
        #: The autograd node running the current operator in backward (-1: none).
        self._node = -1
        #: A gradient sum that eager autograd would do in place, until its operand's free
        #: is seen: (event index of the sum's output, the operands' storage ids).
        self._pending_sum: tuple[int, tuple[int, ...]] | None = None

    # -- storages -----------------------------------------------------------------

    def register(
        self, t: torch.Tensor, op: str = "preexisting", nbytes: int | None = None
    ) -> int | None:
        """Count the storage of ``t`` (once) as allocated now; returns its id.

        ``nbytes`` overrides the size of a storage whose fake size is not the real one.
        """
        if not self.record or self.host:
            return None
        st = storage(t)
        if st is None:
            return None
        sid: int | None = self._sid.get(st)
        if sid is not None:
            return sid
        nbytes = max(st.nbytes(), nbytes or 0)
        if nbytes == 0:
            return None
        sid = self._allocated(nbytes, op)
        self._sid[st] = sid
        cell: list[int | None] = [sid]
        self._cells[st] = cell
        weakref.finalize(st, self._freed_cell, cell)
        return sid

    def _scratch_made(self, nbytes: int, op: str, category: str) -> int:
        """A record of a kernel's scratch or intermediate made now, and its allocation
        event; :meth:`_scratch_freed` frees it before the operator returns."""
        sid = len(self.trace.records)
        self.trace.records.append(StorageRecord(nbytes, op, self.module, self.phase, category))
        self.trace.events.append(sid)
        return sid

    def _scratch_freed(self, sid: int) -> None:
        self.trace.events.append(~sid)
        self.trace.records[sid].freed_phase = self.phase

    def _allocated(self, nbytes: int, op: str) -> int:
        """A new record of ``nbytes`` made now by ``op``, and its allocation event."""
        sid = len(self.trace.records)
        record = StorageRecord(nbytes, op, self.module, self.phase, category=self.category)
        if self.phase == "backward":
            record.node = self._node
        self.trace.records.append(record)
        self.trace.events.append(sid)
        return sid

    def sid_of(self, t: torch.Tensor) -> int | None:
        st = storage(t)
        return None if st is None else self._sid.get(st)

    def _freed(self, sid: int) -> None:
        self.trace.events.append(~sid)
        self.trace.records[sid].freed_phase = self.phase

    def close(self, dying: Iterable[int] = ()) -> None:
        """The step's trace is finished: the storages of ``dying`` still live die now (a
        step's batch, which the loop's next batch replaces); storages that die later (the
        model's, when its session closes) are not recorded."""
        freed = {~e for e in self.trace.events if e < 0}
        for sid in sorted(set(dying) - freed):
            self._freed(sid)
        self.closed = True

    def _freed_cell(self, cell: list[int | None]) -> None:
        if cell[0] is not None and not self.closed:
            self._freed(cell[0])
            cell[0] = None

    def resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """A storage resized in place (``UntypedStorage.resize_``, as FSDP2 frees and
        re-allocates its unsharded parameters): its old bytes are freed and ``nbytes`` are
        allocated, a new record."""
        if not self.record or self.host:
            return
        cell = self._cells.get(st)
        if cell is not None and cell[0] is not None:
            self._freed(cell[0])
            cell[0] = None
        if nbytes <= 0:
            return
        sid = self._allocated(nbytes, "resize_")
        self._sid[st] = sid
        if cell is None:
            cell = [sid]
            self._cells[st] = cell
            weakref.finalize(st, self._freed_cell, cell)
        else:
            cell[0] = sid

    # -- dispatch -----------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(t is not torch.Tensor and not issubclass(t, FakeTensor) for t in types):
            # A tensor subclass (a DTensor): it runs its own operators on its local
            # tensors, which come back here.
            return NotImplemented
        kwargs = _on_host(kwargs or {})
        self.settle()
        self.trace.ops += 1
        self.last_op = _op_name(func)
        self.failed_op = self.last_op
        self._node = -1
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:
                self._node = node._sequence_nr()
                self.module = self.node_module.get(self._node, self.module)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = self._data_dependent(func, args, kwargs)
        except RuntimeError:
            rule = _FAKE_RULES.get(func)
            if rule is None:
                raise
            out = rule(*args, **kwargs)
        else:
            self._propagate_known(func, args, kwargs, out)
        layout = _EAGER_LAYOUT.get(func)
        if layout is not None:
            out = layout(out)
        name = _op_name(func)
        outs = list(tensors(out))
        ws = self.workspace(func, args, kwargs, outs) if self.workspace and not self.host else 0
        if ws > 0 and not self.scratch_after_outputs:
            sid = self._scratch_made(ws, name, "workspaces")
        real = self.output_bytes(func, args, kwargs, outs) if self.output_bytes else None
        first_event = len(self.trace.events)
        for i, t in enumerate(outs):
            self.register(t, name, real[i] if real is not None else None)
        if func is _aten.add.Tensor and self.phase == "backward":
            self._gradient_sum(args, kwargs, outs, first_event)
        if ws > 0:
            if self.scratch_after_outputs:
                sid = self._scratch_made(ws, name, "workspaces")
            self._scratch_freed(sid)
        if self.intermediates is not None and not self.host and self.record:
            made = [
                self._scratch_made(n, name, "temporaries")
                for n in self.intermediates(func, args, kwargs, outs)
            ]
            for sid in made:
                self._scratch_freed(sid)
        if self.record:
            phase = "host" if self.host else self.phase
            self.trace.costs.append(
                op_cost(func, name, phase, args, kwargs, out, dispatch=self._through_mode())
            )
        self.failed_op = None
        return out

    def _through_mode(self) -> bool:
        """Whether the operator being traced came through a Python dispatch mode of the
        step's own (selective checkpointing's caching modes): its handler is a few frames
        up, beyond torch's wrappers of this one."""
        frame: FrameType | None = sys._getframe(2)
        for _ in range(5):
            if frame is None:
                return False
            if frame.f_code.co_name == "__torch_dispatch__":
                owner = frame.f_locals.get("self")
                return (
                    isinstance(owner, TorchDispatchMode)
                    and owner is not self
                    and not isinstance(owner, (FakeTensorMode, Tracer))
                )
            frame = frame.f_back
        return False

    # -- gradient sums -------------------------------------------------------------

    def _gradient_sum(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor], at: int
    ) -> None:
        """Note a sum that autograd's engine makes of two gradients for one input.

        Eager autograd adds the new gradient into the one its buffer holds, in place,
        when that one is a plain dense tensor referenced nowhere else
        (``InputBuffer::accumulate``), but never for a tensor subclass such as a fake
        tensor, which it sums out of place: one gradient more at that moment (a tied
        embedding's, an activation's with two consumers). The sum is the engine's when
        its first operand (the buffer's) was made by another node and its second by the
        node now running. It would have been in place when the first is not a view (a
        view's base holds its storage too) and is freed right after the sum, which
        :meth:`settle` sees and models.
        """
        if not _INPLACE_SUMS.get():
            return
        if len(args) < 2 or kwargs.get("alpha", 1) != 1 or len(outs) != 1:
            return
        old, new, out = args[0], args[1], outs[0]
        if not all(
            isinstance(t, torch.Tensor) and t.shape == out.shape and t.dtype == out.dtype
            for t in (old, new)
        ):
            return
        if old._is_view() or not is_non_overlapping_and_dense_or_false(old):
            return
        sid_old, sid_new = self.sid_of(old), self.sid_of(new)
        if sid_old is None or sid_new is None or self._node < 0:
            return
        made_by = self.trace.records[sid_old].node
        if made_by in (-1, self._node) or self.trace.records[sid_new].node != self._node:
            return
        if at >= len(self.trace.events) or self.trace.events[at] != self.sid_of(out):
            return
        self._pending_sum = (at, (sid_old,))

    def settle(self) -> None:
        """Model the last gradient sum in place if an operand was freed right after it:
        its free moves to before the sum's output (the output takes its memory)."""
        pending, self._pending_sum = self._pending_sum, None
        if pending is None:
            return
        at, sids = pending
        events = self.trace.events
        for i in range(at + 1, len(events)):
            e = events[i]
            if e < 0 and ~e in sids:
                del events[i]
                events.insert(at, e)
                return

    # -- values -------------------------------------------------------------------

    def _real_args(self, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        missing = False

        def real(x: Any) -> Any:
            nonlocal missing
            if isinstance(x, torch.Tensor):
                r = self.known.get(x)
                if r is None and _plain(x):
                    return x  # a real tensor (a wrapped Python number): its own value
                if r is None:
                    missing = True
                return r
            return x

        ra, rk = tree_map(real, (args, kwargs))
        return None if missing else (ra, rk)

    def _propagate_known(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        outs = list(tensors(out))
        if not outs or func in _NOT_KNOWN:
            return
        inputs = list(tensors((args, kwargs)))
        if _seeded(func):
            for t in inputs:  # an in-place random fill
                self.known.pop(t, None)
            if func in _UNIFORM and outs[0].numel() <= RANDOM_NUMEL_LIMIT:
                with unset_fake_temporarily():
                    top = 1.0 - torch.finfo(outs[0].dtype).eps / 2
                    self.known[outs[0]] = torch.full(outs[0].shape, top, dtype=outs[0].dtype)
                self._random[outs[0]] = True
            return
        if not all(t in self.known or _plain(t) for t in inputs):  # the common case
            if _is_inplace(func):  # an in-place write makes values unknown
                for t in inputs:
                    self.known.pop(t, None)
            elif func is _aten.topk.default and self.record:
                self._balanced_topk(args, kwargs, outs)
            return
        if sum(t.numel() for t in outs) > KNOWN_NUMEL_LIMIT:
            for t in inputs:  # an in-place write makes values unknown
                self.known.pop(t, None)
            return
        real = self._real_args(args, kwargs)
        if real is None:
            return
        with unset_fake_temporarily():
            try:
                real_out = func(*real[0], **real[1])
            except Exception:
                return
        random = any(t in self._random for t in inputs)
        for f, r in zip(outs, tensors(real_out), strict=False):
            if f.shape == r.shape:
                self.known[f] = r
                if random:
                    self._random[f] = True

    def _balanced_topk(self, args: Any, kwargs: Any, outs: list[torch.Tensor]) -> None:
        """Known stand-in indices for a ``topk`` of unknown values: spread evenly.

        A mixture-of-experts router picks its experts with ``topk`` of scores the trace
        cannot know; what follows (tokens per expert, ``split`` sizes, loops over the
        experts) needs values that agree with each other. Row ``r`` takes the ``k``
        entries after ``r * k`` (wrapping), so every expert gets an equal share of the
        tokens: the load of a trained, balanced router.
        """
        if len(outs) != 2 or outs[1].numel() > KNOWN_NUMEL_LIMIT:
            return
        x = args[0]
        k = int(args[1] if len(args) > 1 else kwargs["k"])
        dim = int(args[2] if len(args) > 2 else kwargs.get("dim", -1)) % max(1, x.dim())
        n = x.shape[dim] if x.dim() else 1
        idx = outs[1]
        with unset_fake_temporarily():
            moved = list(idx.shape)
            moved.append(moved.pop(dim))
            rows = max(1, idx.numel() // max(1, k))
            values = (torch.arange(rows).unsqueeze(1) * k + torch.arange(k)) % max(1, n)
            self.known[idx] = values.reshape(moved).movedim(-1, dim).contiguous()
        self._assume(
            "topk",
            "picks from values the trace cannot know (a router's scores); taken as spread "
            "evenly over the choices (every expert an equal share of the tokens)",
            everywhere=True,
        )

    def _data_dependent(self, func: Any, args: Any, kwargs: Any) -> Any:
        real = self._real_args(args, kwargs)
        known = real is not None
        if real is None:
            real = self._bound_args(func, args, kwargs)
        elif any(t in self._random for t in tensors((args, kwargs))):
            self._assume(
                _op_name(func),
                "depends on random numbers (torch.rand); they were taken at the top of "
                "their range, so a random skip such as layer drop is not taken",
            )
        with unset_fake_temporarily():
            real_out = func(*real[0], **real[1])
        if not isinstance(real_out, torch.Tensor | tuple | list):
            return real_out  # a Python scalar from .item()

        def fake(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                f = self.fake_mode.from_tensor(x)
                if known:  # a bound's stand-in values are not the real ones
                    self.known[f] = x
                return f
            return x

        return tree_map(fake, real_out)

    def _bound_args(self, func: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Stand-ins for unknown values that give the operator its largest output.

        An unknown truth value reads as true, except while a model is built (weight
        init's rejection sampling, ``while (w > 2).any(): redraw``, must end; the build
        is not traced) and after :data:`LOOP_LIMIT` true readings at one place (a
        loop on unknown values is cut, and the cut is listed).
        """
        name = _op_name(func)
        scalar = func in (_aten._local_scalar_dense.default, _aten.is_nonzero.default)
        falsy = not self.record
        if scalar and self.record:
            key = (name, self.module)
            self._reads[key] = self._reads.get(key, 0) + 1
            if self._reads[key] > LOOP_LIMIT:
                falsy = True
                self._assume(f"{name} (a loop)", f"read as true {LOOP_LIMIT} times, then false")
        if name in _VALUE_SHAPED and self.record and not falsy:
            if scalar:
                what = "read as 1 (true)"
            else:
                what = "sized for its largest output (all elements selected, all distinct)"
            self._assume(name, f"depends on values the trace cannot know; {what}")

        def standin(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            r = self.known.get(x)
            if r is not None:
                return r
            if x.numel() > BOUND_NUMEL_LIMIT:
                raise DataDependentError(name, self.module, x.numel())
            with unset_fake_temporarily():
                if falsy:
                    return torch.zeros(x.shape, dtype=x.dtype)
                if x.dtype == torch.bool:
                    return torch.ones(x.shape, dtype=torch.bool)
                return (torch.arange(x.numel()) + 1).reshape(x.shape).to(x.dtype)

        ra, rk = tree_map(standin, (args, kwargs))
        return ra, rk

    def _assume(self, name: str, what: str, *, everywhere: bool = False) -> None:
        """Record an assumption once per operator and module (``everywhere``: once)."""
        module = "" if everywhere else self.module
        key = (name, module)
        if key in self._assumed:
            return
        self._assumed.add(key)
        where = f" in {module}" if module else ""
        self.trace.assumptions.append(f"{name}{where} {what}")


def _on_host(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The step is traced on the host: a tensor made or moved onto a GPU in the forward
    (``torch.arange(n, device="cuda")``, ``x.to("cuda")``) stays with the fake CPU model."""
    device = kwargs.get("device")
    if device is None or torch.device(device).type in ("cpu", "meta"):
        return kwargs
    return {**kwargs, "device": torch.device("cpu")}


def _plain(t: torch.Tensor) -> bool:
    """A real tensor among fake ones: a constant (a Python number PyTorch wrapped for
    ``x[i] = 0``, the list ``torch.tensor([...])`` lifts into the fake mode)."""
    return not isinstance(t, FakeTensor) and not t.is_meta


def _grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten._grouped_mm``'s output, for the inputs its meta kernel refuses.

    The meta kernel checks CUDA's constraints (bf16 inputs, 16-byte strides), so a fake
    fp32 call fails where the real CPU and fp32 kernels run (transformers' grouped-GEMM
    mixture-of-experts layers). The output is what the kernel returns: 2-D x 3-D and
    3-D x 2-D give ``[M, N]``, 2-D x 2-D one ``[M, N]`` per group, 3-D x 3-D a batch.
    """
    del bias
    if offs is None and (a.dim() == 2 or b.dim() == 2):
        raise RuntimeError("_grouped_mm: offsets are needed for 2-D operands")
    if a.dim() == 2 and b.dim() == 2:
        assert offs is not None
        size = [offs.size(0), a.size(0), b.size(1)]
    elif a.dim() == 2:
        size = [a.size(0), b.size(-1)]
    elif b.dim() == 2:
        size = [a.size(1), b.size(1)]
    else:
        size = [a.size(0), a.size(1), b.size(-1)]
    return torch.empty(size, dtype=out_dtype or a.dtype, device=a.device)


def _contiguous_first(out: Any) -> Any:
    """The first output made contiguous, as the CPU and CUDA kernels return it."""
    first = out[0]
    if not isinstance(first, torch.Tensor) or first.is_contiguous():
        return out
    return (torch.empty(first.shape, dtype=first.dtype, device=first.device), *out[1:])


#: Operators whose meta kernels return another layout than the real ones: the output as
#: the real kernel lays it out. Layer norm's backward computes on contiguous copies and
#: returns a contiguous input gradient; the meta kernel copies the input's strides, so
#: after a transpose (audio feature encoders normalise over channels) the gradient the
#: next operator gets was contiguous in the trace and not in the real step, which then
#: copies it (a convolution's backward does).
_EAGER_LAYOUT: dict[Any, Callable[[Any], Any]] = {
    _aten.native_layer_norm_backward.default: _contiguous_first,
}
#: Operators whose meta kernels refuse inputs their real kernels take: the output made
#: another way (called under the fake mode, so it is fake too).
_FAKE_RULES: dict[Any, Callable[..., Any]] = {
    torch.ops.aten._grouped_mm.default: _grouped_mm,
}


class EagerLinear(TorchFunctionMode):
    """Give ``F.linear`` on fake tensors the memory behaviour it has on real ones.

    For an input that is not contiguous (a permuted 4-D activation, an LSTM's
    output), eager ``linear`` computes ``matmul`` and adds the bias in place. With
    a tensor subclass such as a fake tensor it adds out of place instead ("for
    composite compliance"), which would hold one extra output at that moment.
    This mode takes the eager path.

    It also formats a one-element tensor by its value, as a real one formats
    (``f"expert_{idx}"``): a fake tensor would format as ``FakeTensor(...)``. The
    value is read with ``.item()``, which the tracer answers (known, or a stand-in).

    And it keeps code written for a GPU on the host, where the step is traced:
    ``x.cuda()`` and ``x.to("cuda")`` leave ``x`` where it is (a cast still casts).
    """

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # traced on the host (see _on_host): already there
            return args[0]
        if func is torch.Tensor.to:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type not in ("cpu", "meta"):
                kept: dict[str, Any] = {"dtype": dtype, "memory_format": memory_format}
                return func(args[0], **{k: v for k, v in kept.items() if v is not None})
        if func is torch.Tensor.__format__ and args and args[0].numel() == 1:
            return format(args[0].item(), *args[1:])
        if func is torch.nn.functional.linear:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (
                bias is not None
                and isinstance(x, torch.Tensor)
                and isinstance(weight, torch.Tensor)
                and x.dim() >= 3
                and not x.is_contiguous()
            ):
                out = torch.matmul(x, weight.t())
                return out.add_(bias if bias.dtype == out.dtype else bias.to(out.dtype))
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_op_module_to() -> Iterator[None]:
    """``module.to(...)`` that changes nothing returns the module, as eager PyTorch's does
    in effect, instead of swapping every fake parameter for itself.

    ``Module._apply`` always swaps a fake parameter (``swap_tensors``), and the swap fails
    while the fake mode holds a weak reference to it; a model that casts a submodule in its
    forward (Switch Transformers' router: ``self.classifier.to(self.dtype)``) would not trace.
    """

    def make_to(original: Callable[..., Any]) -> Callable[..., Any]:
        def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            parsed: Any = torch._C._nn._parse_to(*args, **kwargs)
            device, dtype, _, memory_format = parsed
            if device is not None and torch.device(device).type not in ("cpu", "meta"):
                device = "cpu"  # traced on the host (see _on_host)
            same = memory_format is None and all(
                (dtype is None or not t.is_floating_point() or t.dtype == dtype)
                and (device is None or t.device == torch.device(device))
                for t in itertools.chain(self.parameters(), self.buffers())
            )
            return self if same else original(self, *args, **kwargs)

        return to

    def make_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
        def cuda(self: nn.Module, device: Any = None) -> nn.Module:
            return self  # traced on the host (see _on_host)

        return cuda

    with patched(nn.Module, "to", make_to), patched(nn.Module, "cuda", make_cuda):
        yield


class DataDependentError(RuntimeError):
    """A data-dependent operator too large to bound with a stand-in."""

    def __init__(self, op: str, module: str, numel: int) -> None:
        super().__init__(
            f"{op} in {module or 'the step'} depends on the values of a {numel}-element tensor"
        )
        self.op = op
        self.module = module


def _op_name(func: Any) -> str:
    return str(getattr(func, "__name__", func)).split(".")[0]


_SEEDED: dict[Any, bool] = {}


def _seeded(func: Any) -> bool:
    """Whether an operator draws random numbers."""
    hit = _SEEDED.get(func)
    if hit is None:
        hit = _SEEDED[func] = torch.Tag.nondeterministic_seeded in func.tags
    return hit


def _is_inplace(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


@contextlib.contextmanager
def storage_resizes(tracer: Tracer) -> Iterator[None]:
    """``UntypedStorage.resize_`` seen by ``tracer``: FSDP2 frees a gathered parameter by
    resizing its storage to nothing and allocates it again by resizing it back."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            tracer.resized(st, int(size))
            return out

        return resize_

    with patched(torch.UntypedStorage, "resize_", make):
        yield
