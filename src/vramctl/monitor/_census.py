"""The leak census: the tensors a few steps create, with the line of code that made each one,
which of them outlive their steps, and what holds them (a growing container, an attribute, an
autograd graph kept alive); on CUDA, also the allocator's record of the blocks still allocated.
Its result names the suspects of a leak report and says in words what most likely leaks.
"""

from __future__ import annotations

import collections
import gc
import operator
import os
import sys
import sysconfig
import types
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

from vramctl._tensors import tensor_parts
from vramctl._units import format_bytes

__all__ = [
    "CENSUS_MAX_RECORD_STEPS",
    "CENSUS_RECORD_STEPS",
    "CENSUS_SURVIVE_STEPS",
    "Census",
    "CensusResult",
    "LeakSuspect",
]

#: Steps the census records (the tensors they create) at least and at most (it stops once
#: memory has grown by ``min_rate``), then steps those tensors must outlive.
CENSUS_RECORD_STEPS = 2
CENSUS_MAX_RECORD_STEPS = 16
CENSUS_SURVIVE_STEPS = 2
#: Suspects a report lists at most.
_MAX_SUSPECTS = 10
#: Autograd nodes the census walks at most, from each tensor that keeps a graph.
_MAX_GRAPH_NODES = 20_000


# -- the suspects ----------------------------------------------------------------------


@dataclass(frozen=True)
class LeakSuspect:
    """Tensors made by the same line of code, of one shape and dtype, that outlived their step.

    ``site`` is the first frame outside PyTorch and vramctl (``"train.py:42 in
    train_step"``). ``holder`` says what keeps them alive, as far as the census
    can see: ``"list"``, ``"dict"``, ``"deque"``, ``"attribute Trainer.history"``,
    ``"autograd graph"`` (saved by the graph of a tensor something keeps), or
    ``"unknown"``. Suspects from the CUDA allocator's own records (memory no
    tensor census saw) have ``shape`` and ``dtype`` ``None`` and ``source``
    ``"allocator"``.
    """

    shape: tuple[int, ...] | None
    dtype: str | None
    site: str
    count: int
    nbytes: int
    requires_grad: bool = False
    holder: str = "unknown"
    source: str = "tensor"

    def describe(self) -> str:
        """One line: ``2 x float32[256, 1024] (2.00 MiB) made at train.py:42 in step, ...``."""
        what = (
            f"{self.dtype}[{', '.join(map(str, self.shape))}]"
            if self.shape is not None and self.dtype is not None
            else "allocator block(s)"
        )
        grad = ", requires grad" if self.requires_grad else ""
        held = "" if self.holder == "unknown" else f", held by {_article(self.holder)}"
        return (
            f"{self.count} x {what} ({format_bytes(self.nbytes)}{grad}) made at {self.site}{held}"
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = None if self.shape is None else list(self.shape)
        return out


def _article(holder: str) -> str:
    if holder.startswith("attribute"):
        return f"the {holder}"
    return f"an {holder}" if holder[:1] in "aeiou" else f"a {holder}"


# -- where a tensor was made ---------------------------------------------------------------


_TORCH_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    # vramctl: this file is vramctl/monitor/_census.py
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)
_LIBRARY_DIRS = tuple(
    {
        os.path.abspath(p) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
)
#: filename -> 0 (your code), 1 (the standard library or an installed package), 2 (torch, vramctl)
_FRAME_KIND: dict[str, int] = {}


def _frame_kind(filename: str) -> int:
    kind = _FRAME_KIND.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_TORCH_DIRS) or filename.startswith("<eval_with_key"):
            kind = 2
        elif path.startswith(_LIBRARY_DIRS) or filename.startswith("<frozen"):
            kind = 1
        else:
            kind = 0
        _FRAME_KIND[filename] = kind
    return kind


Site = tuple[str, int, str]
_UNKNOWN_SITE: Site = ("<unknown>", 0, "?")


def _caller_site() -> Site:
    """The innermost frame of your code (else of any library but torch's) that led here."""
    fallback: Site | None = None
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        code = f.f_code
        kind = _frame_kind(code.co_filename)
        if kind == 0:
            return (code.co_filename, f.f_lineno, code.co_name)
        if kind == 1 and fallback is None:
            fallback = (code.co_filename, f.f_lineno, code.co_name)
        f = f.f_back
    return fallback or _UNKNOWN_SITE


def _frames_site(frames: Iterable[dict[str, Any]]) -> Site:
    """The same choice among a CUDA allocator record's frames (innermost first)."""
    fallback: Site | None = None
    for fr in frames:
        filename = str(fr.get("filename", "?"))
        site = (filename, int(fr.get("line", 0)), str(fr.get("name", "?")))
        kind = _frame_kind(filename)
        if kind == 0:
            return site
        if kind == 1 and fallback is None:
            fallback = site
    return fallback or _UNKNOWN_SITE


def _format_site(site: Site) -> str:
    filename, line, name = site
    if site == _UNKNOWN_SITE:
        return "an unknown place"
    if not filename.startswith("<"):
        try:
            rel = os.path.relpath(filename)
            if not rel.startswith(".."):
                filename = rel
        except ValueError:  # another drive (Windows)
            pass
    return f"{filename}:{line} in {name}"


# -- the census ----------------------------------------------------------------------------


@dataclass
class _Record:
    storage: StorageWeakRef
    tensor: weakref.ref[torch.Tensor]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    site: Site


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None  # sparse, nested, or a wrapper subclass without storage


#: Ops whose output may be their input, yet is a tensor made by the user's code.
_FRESH_OPS = ("aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift")


class _CensusMode(TorchDispatchMode):
    """Records each new storage an op on the watched device makes, and the line that made it."""

    def __init__(self, census: Census) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.census = census
        self.recording = True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recording:
            try:
                self.census.record(func, args, kwargs, out)
            except Exception as exc:  # never let the census break a step
                self.recording = False
                self.census.failed = f"the census stopped: {type(exc).__name__}: {exc}"
        return out


class _AllocatorCensus:
    """On CUDA: the allocator's record of where each live block was allocated.

    ``torch.cuda.memory._record_memory_history(enabled="state")`` during the
    recorded steps only: blocks allocated then keep their Python frames until
    freed; blocks allocated after recording stops have none (and turning it off
    clears the allocator's trace). A snapshot two steps later lists the blocks
    still allocated that carry frames, less those that had frames already.
    If the history is already being recorded (by you, for a memory profile),
    it is left as it is and this part of the census is skipped.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.recording = False
        self.used = False
        self.note = ""
        self.before: set[tuple[int, int]] = set()

    def _snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = torch.cuda.memory._snapshot()
        return snap

    def _blocks(self, snap: dict[str, Any]) -> Iterable[dict[str, Any]]:
        for seg in snap.get("segments", []):
            if int(seg.get("device", self.index)) != self.index:
                continue
            for block in seg.get("blocks", []):
                if block.get("state") == "active_allocated" and block.get("frames"):
                    yield block

    @staticmethod
    def _key(block: dict[str, Any]) -> tuple[int, int]:
        return (int(block.get("address", -1)), int(block.get("size", 0)))

    def start(self) -> None:
        try:
            enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
            snap = self._snapshot()
            if (enabled is not None and enabled()) or any(snap.get("device_traces") or []):
                self.note = "the CUDA allocator's history is already being recorded: left as it is"
                return
            self.before = {self._key(b) for b in self._blocks(snap)}
            torch.cuda.memory._record_memory_history(
                enabled="state", context="state", stacks="python", max_entries=1
            )
            self.recording = self.used = True
        except Exception as exc:  # an older or a stripped build
            self.note = f"the CUDA allocator's history is not available ({exc})"

    def stop(self) -> None:
        if self.recording:
            self.recording = False
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as exc:
                self.note = f"could not stop the CUDA allocator's history ({exc})"

    def survivors(self) -> list[LeakSuspect]:
        if not self.used:
            return []
        groups: dict[tuple[int, Site], list[int]] = {}
        for block in self._blocks(self._snapshot()):
            if self._key(block) in self.before:
                continue
            size = int(block.get("requested_size") or block.get("size", 0))
            key = (size, _frames_site(block.get("frames") or []))
            groups.setdefault(key, []).append(int(block.get("size", size)))
        return [
            LeakSuspect(
                shape=None,
                dtype=None,
                site=_format_site(site),
                count=len(sizes),
                nbytes=sum(sizes),
                holder="unknown",
                source="allocator",
            )
            for (_, site), sizes in groups.items()
        ]


@dataclass(frozen=True)
class CensusResult:
    done_step: int
    suspects: tuple[LeakSuspect, ...]
    causes: tuple[str, ...]
    note: str


class Census:
    """One census: record ``CENSUS_RECORD_STEPS`` steps, then check what outlived them.

    ``cuda``: the watched device's tensors are CUDA memory (its ``Device.is_cuda``), and the
    CUDA allocator's own record is read too.
    """

    def __init__(self, device: torch.device, started: int, *, cuda: bool) -> None:
        self.device = device
        self.first = started + 1  # the first recorded step
        self.last = started + CENSUS_RECORD_STEPS  # moved on while recording goes on
        self.check: int | None = None  # set when recording stops
        self.records: dict[int, _Record] = {}
        self.start_reading = 0  # the detector's reading when recording began
        self.failed = ""
        self.mode = _CensusMode(self)
        self.entered = False
        self.allocator = _AllocatorCensus(device.index or 0) if cuda else None

    # recording

    def start(self) -> None:
        if self.allocator is not None:
            self.allocator.start()
        self.mode.recording = False
        self.mode.__enter__()  # type: ignore[no-untyped-call]
        self.entered = True
        # The first op under a Python dispatch mode imports PyTorch's Python dispatcher
        # (about 25 MiB and a second, once per process): here, not in the user's step.
        torch.empty(0).add_(0)
        self.mode.recording = True

    def stop_recording(self) -> None:
        self.mode.recording = False
        # If a mode entered after ours is still active, ours stays, silent, until a
        # later call finds it on top again.
        if self.entered and _get_current_dispatch_mode() is self.mode:
            self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self.entered = False
        if self.allocator is not None:
            self.allocator.stop()

    @property
    def recording(self) -> bool:
        return self.mode.recording

    def record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return
        inputs: set[int] | None = None
        fresh = str(getattr(func, "name", lambda: "")()).startswith(_FRESH_OPS)
        for t in outs:
            if t.device != self.device:
                continue
            # A sparse tensor's bytes are in its values and indices: one record for all.
            new: list[tuple[int, torch.UntypedStorage]] = []
            for part in tensor_parts(t):
                key = _storage_key(part)
                if key is None or key in self.records:
                    continue
                if not fresh:
                    if inputs is None:  # a view or an in-place op returns an input's storage
                        inputs = {
                            k
                            for x in tree_leaves((args, kwargs))
                            if isinstance(x, torch.Tensor)
                            for p in tensor_parts(x)
                            if (k := _storage_key(p)) is not None
                        }
                    if key in inputs:
                        continue
                storage = part.untyped_storage()
                if int(storage.nbytes()) > 0:
                    new.append((key, storage))
            if not new:
                continue
            key, storage = new[0]
            self.records[key] = _Record(
                storage=StorageWeakRef(storage),
                tensor=weakref.ref(t),
                shape=tuple(int(s) for s in t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                nbytes=sum(int(st.nbytes()) for _, st in new),
                site=_caller_site(),
            )

    def close(self) -> None:
        self.stop_recording()
        self.records.clear()

    # the check

    def analyse(self, now: int) -> CensusResult:
        try:
            return self._analyse(now)
        except Exception as exc:  # the report goes out without suspects
            return CensusResult(now, (), (), f"the census failed: {type(exc).__name__}: {exc}")
        finally:
            self.close()

    def _analyse(self, now: int) -> CensusResult:
        made = len(self.records)
        alive = [r for r in self.records.values() if not r.storage.expired()]
        span = f"steps {self.first}-{self.last}"
        note = (
            f"{len(alive)} of the {made} tensors made in {span} on {self.device} still alive at "
            f"step {now}"
        )
        if self.failed:
            note += f"; {self.failed}"
        if self.allocator is not None and self.allocator.note:
            note += f"; {self.allocator.note}"
        tensors = {id(r): t for r in alive if (t := r.tensor()) is not None}
        objs = list(tensors.values())
        holders = _holders(objs, exclude={id(tensors), id(objs)})
        roots = [t for t in tensors.values() if t.grad_fn is not None and id(t) in holders]
        in_graph = _graph_storages(roots)
        if any(
            r.storage.cdata not in in_graph and holders.get(id(tensors.get(id(r)))) is None
            for r in alive
        ):
            # Survivors nothing in Python holds: are they saved by the graph of some tensor
            # made later (a running total += loss makes a new one every step)?
            mine = {id(t) for t in objs}
            later = [
                o
                for o in gc.get_objects()
                # type(), not isinstance(): some objects warn when their __class__ is read
                if issubclass(type(o), torch.Tensor) and id(o) not in mine and o.grad_fn is not None
            ]
            in_graph |= _graph_storages(later)
            del later
        groups: dict[tuple[tuple[int, ...], str, Site], list[_Record]] = {}
        for r in alive:
            groups.setdefault((r.shape, r.dtype, r.site), []).append(r)
        suspects: list[LeakSuspect] = []
        graph_kept: dict[str, Any] = {}
        for (shape, dtype, site), recs in groups.items():
            kinds: collections.Counter[str] = collections.Counter()
            grad = False
            for r in recs:
                t = tensors.get(id(r))
                if t is not None and t.requires_grad:
                    grad = True
                h = holders.get(id(t)) if t is not None else None
                if h is not None:
                    kinds[h.kind] += 1
                    if t is not None and t.grad_fn is not None:
                        graph_kept.setdefault("roots", []).append((h, r, t.grad_fn))
                elif r.storage.cdata in in_graph:
                    kinds["autograd graph"] += 1
                else:
                    kinds["unknown"] += 1
            suspects.append(
                LeakSuspect(
                    shape=shape,
                    dtype=dtype,
                    site=_format_site(site),
                    count=len(recs),
                    nbytes=sum(r.nbytes for r in recs),
                    requires_grad=grad,
                    holder=kinds.most_common(1)[0][0],
                )
            )
        if self.allocator is not None:
            named = {s.site for s in suspects}
            suspects += [s for s in self.allocator.survivors() if s.site not in named]
        suspects.sort(key=lambda s: -s.nbytes)
        causes = _causes(suspects, holders, graph_kept, span, str(self.device))
        return CensusResult(now, tuple(suspects[:_MAX_SUSPECTS]), tuple(causes), note)


@dataclass(frozen=True)
class _Holder:
    kind: str  # "list", "dict", "deque", "attribute Cls.name", "tuple", ...
    size: int  # the container's length (0 when it has none)


def _holders(objs: list[torch.Tensor], exclude: set[int]) -> dict[int, _Holder]:
    """What refers to each tensor, as far as the garbage collector can see (one pass).

    ``exclude``: the ids of the caller's own containers of ``objs``.
    """
    if not objs:
        return {}
    ids = {id(t) for t in objs}
    ours = exclude | {id(objs)}
    found: dict[int, _Holder] = {}

    def note(t: object, holder: _Holder) -> None:
        old = found.get(id(t))
        if old is None or _rank(holder.kind) < _rank(old.kind):
            found[id(t)] = holder

    dicts: list[dict[Any, Any]] = []
    for ref in gc.get_referrers(*objs):
        if id(ref) in ours or isinstance(ref, types.FrameType):
            continue
        if isinstance(ref, tuple) and len(ref) == len(objs) and all(map(operator.is_, ref, objs)):
            continue  # the arguments of this very call
        if isinstance(ref, dict):
            dicts.append(ref)
            continue
        try:
            members = list(ref) if isinstance(ref, list | tuple | collections.deque | set) else []
        except TypeError:
            members = []
        kind = type(ref).__name__
        for m in members:
            if id(m) in ids:
                note(m, _Holder(kind, len(members)))
    if dicts:
        owners = _dict_owners(dicts, ours | {id(dicts)})
        for d in dicts:
            owner = owners.get(id(d))
            for name, value in d.items():
                if id(value) not in ids:
                    continue
                if owner is not None:
                    note(value, _Holder(f"attribute {type(owner).__name__}.{name}", 0))
                else:
                    note(value, _Holder("dict", len(d)))
    return found


def _rank(kind: str) -> int:
    """Which holder to name when several hold a tensor: a growing container first."""
    order = ("list", "deque", "dict", "attribute", "set", "tuple")
    return next((i for i, k in enumerate(order) if kind.startswith(k)), len(order))


def _dict_owners(dicts: list[dict[Any, Any]], skip: set[int]) -> dict[int, object]:
    """The objects whose ``__dict__`` is one of ``dicts``."""
    ids = {id(d) for d in dicts}
    owners: dict[int, object] = {}
    for ref in gc.get_referrers(*dicts):
        if id(ref) in skip or isinstance(ref, dict | types.FrameType):
            continue
        d = getattr(ref, "__dict__", None)
        if d is not None and id(d) in ids:
            owners[id(d)] = ref
    return owners


def _graph_storages(roots: list[torch.Tensor]) -> set[int]:
    """The storages the autograd graphs of ``roots`` have saved for backward."""
    keys: set[int] = set()
    # The nodes seen, kept alive until the walk ends: a node's Python object may be made
    # afresh each time it is read (``next_functions``) and freed once dropped, and a later
    # node's object can then reuse its address, so an id alone would skip unseen nodes.
    seen: dict[int, Any] = {}
    stack: list[Any] = [t.grad_fn for t in roots]
    names: dict[type, list[str]] = {}
    while stack and len(seen) < _MAX_GRAPH_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        attrs = names.get(type(node))
        if attrs is None:
            attrs = names[type(node)] = [
                a
                for a in dir(node)
                if a.startswith("_saved_") and not a.endswith(("_sym_sizes", "_sym_strides"))
            ]
        for a in attrs:
            try:
                value = getattr(node, a)
            except RuntimeError:  # freed by a backward pass
                continue
            for v in value if isinstance(value, list | tuple) else (value,):
                if isinstance(v, torch.Tensor) and (k := _storage_key(v)) is not None:
                    keys.add(k)
        stack += [fn for fn, _ in getattr(node, "next_functions", ())]
    return keys


def _causes(
    suspects: list[LeakSuspect],
    holders: dict[int, _Holder],
    graph_kept: dict[str, Any],
    span: str,
    device: str,
) -> list[str]:
    causes: list[str] = []

    def add(text: str) -> None:
        if text not in causes:
            causes.append(text)

    tensor_suspects = [s for s in suspects if s.source == "tensor"]
    if not suspects:
        add(
            f"no tensor made on {device} in {span} outlived them: the growth is in memory the "
            "census does not see (Python objects or a C/C++ library on the CPU, another "
            "thread's tensors, or fragmentation)"
        )
        return causes
    roots = graph_kept.get("roots", [])
    graph_bytes = sum(s.nbytes for s in tensor_suspects if s.holder == "autograd graph")
    if roots:
        holder, record, grad_fn = roots[0]
        where = _container_words(holder)
        kept = f"; their graphs hold {format_bytes(graph_bytes)} more" if graph_bytes else ""
        add(
            "a loss or output accumulated with its autograd graph: tensors with grad_fn "
            f"{type(grad_fn).__name__} made at {_format_site(record.site)} are kept in {where}"
            f"{kept}; keep loss.item() or loss.detach() instead"
        )
    elif graph_bytes:
        top = next(s for s in tensor_suspects if s.holder == "autograd graph")
        add(
            "a loss or output accumulated with its autograd graph: "
            f"{format_bytes(graph_bytes)} saved for backward (made at {top.site}) stay alive "
            "in the graph of a tensor kept across steps, as a running total += loss keeps "
            "every step's graph; accumulate loss.item() or loss.detach()"
        )
    for s in tensor_suspects:
        if s.requires_grad and s.holder not in ("unknown", "autograd graph"):
            continue  # said above
        if s.holder in ("list", "deque"):
            size = _container_size(holders, s.holder)
            add(
                f"a {s.holder} that grows every step{size}: it keeps the {s.dtype}"
                f"[{', '.join(map(str, s.shape or ()))}] tensors made at {s.site}; stop "
                "append(...)ing them, append(t.item()) or append(t.detach().cpu()) for what "
                "you need, or bound it (collections.deque(maxlen=...))"
            )
        elif s.holder == "dict":
            add(
                f"a dict that grows every step keeps the tensors made at {s.site}: bound "
                "the cache (evict old keys) or store t.detach().cpu()"
            )
        elif s.holder.startswith("attribute"):
            add(f"{s.holder} keeps the tensors made at {s.site} alive from step to step")
        elif s.holder == "unknown" and s.source == "tensor":
            add(
                f"the tensors made at {s.site} stay alive with no Python object that the "
                "census can see holding them: most often the autograd graph of a tensor "
                "accumulated across steps (total_loss += loss; keep loss.item()), a view of "
                "them kept elsewhere, or C++ state"
            )
    if any(s.source == "allocator" for s in suspects):
        add(
            "CUDA blocks allocated in the census steps, at lines the tensor census did not "
            "name, are still allocated: memory kept outside tensors (a C++ extension, "
            "torch.cuda.caching_allocator_alloc) or tensors made on another thread"
        )
    return causes


def _container_words(holder: _Holder) -> str:
    if holder.kind.startswith("attribute"):
        return f"the {holder.kind}"
    size = f" (now {holder.size} items)" if holder.size else ""
    return f"a {holder.kind} that grows every step{size}"


def _container_size(holders: dict[int, _Holder], kind: str) -> str:
    sizes = [h.size for h in holders.values() if h.kind == kind and h.size]
    return f" (now {max(sizes)} items)" if sizes else ""
