"""Placement: which GPUs of which node a job goes to, by one small policy interface.

The core is generic over its units: a cluster is nodes, each with GPUs of a capacity
(bytes for vramctl's own devices, thousandths of a GPU for a shared-GPU trace), and
optionally node-level CPU and memory and a GPU model name. Every front end and the
benchmarks place through the same pieces:

- :class:`Request`: what a job asks for: ``need`` per GPU on ``gpus`` GPUs of one node,
  node ``cpu`` and ``memory``, and optionally a GPU ``model``;
- :class:`ClusterState`: what is free, as torch tensors (free per GPU, the node of each
  GPU, jobs per GPU, node CPU and memory left); :meth:`ClusterState.allocate` and
  :meth:`ClusterState.release` change it;
- :class:`Policy`: ``choose(state, request) -> Placement | None``. :class:`BestFit` (the
  GPUs left with the least), :class:`MostFree` (the GPUs with the most free),
  :class:`LeastLoaded` (the GPUs running the fewest jobs) and :class:`Fragmentation`
  (FGD's idea: where the expected fragmentation, for the typical job mix of a
  :class:`Workload`, grows least).

A policy looks at every feasible candidate at once (tensor operations, no Python loop
over nodes), so a decision on a cluster of thousands of GPUs takes milliseconds.

>>> state = ClusterState([2, 1], gpu_capacity=[1000, 1000])
>>> state.allocate(Request(600), Placement(0, (0,)))
>>> BestFit().choose(state, Request(300))
Placement(node=0, gpus=(0,))
>>> MostFree().choose(state, Request(300))
Placement(node=0, gpus=(1,))
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "BestFit",
    "ClusterState",
    "Fragmentation",
    "LeastLoaded",
    "MostFree",
    "Placement",
    "Policy",
    "Request",
    "Workload",
]

_F = torch.float64


@dataclass(frozen=True)
class Request:
    """What one job asks for, in the cluster's units.

    ``need`` on each of ``gpus`` GPUs of one node (``gpus=0``: a job with no GPU, placed
    by CPU and memory only), ``cpu`` and ``memory`` on that node, and ``model``: the GPU
    model it must run on (None: any).
    """

    need: float
    gpus: int = 1
    cpu: float = 0.0
    memory: float = 0.0
    model: str | None = None

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.need < 0 or self.cpu < 0 or self.memory < 0:
            raise ValueError(f"a request's sizes cannot be negative: {self}")


@dataclass(frozen=True)
class Placement:
    """Where a request goes: the node's index and the indices of the GPUs it takes
    (indices into :attr:`ClusterState.free`; empty for a request with no GPU)."""

    node: int
    gpus: tuple[int, ...]


class ClusterState:
    """The cluster's free resources as tensors, changed by :meth:`allocate`/:meth:`release`.

    ``node_gpus[n]`` is node n's GPU count and ``gpu_capacity[n]`` the capacity of each of
    its GPUs. GPUs are numbered node by node. ``node_cpu`` and ``node_memory`` (None:
    unlimited) are each node's CPU and memory; ``node_model`` its GPU model's name;
    ``max_jobs_per_gpu`` how many jobs a GPU may hold at once (None: no limit).

    Attributes (tensors, one entry per GPU unless said): ``free`` and ``capacity``
    (float64), ``jobs`` (int64), ``gpu_node`` (int64); per node: ``cpu_free``,
    ``memory_free`` (float64); ``slots`` (int64, nodes x the most GPUs of a node: each
    node's GPU indices, -1 after its last).
    """

    def __init__(
        self,
        node_gpus: Sequence[int],
        gpu_capacity: float | Sequence[float],
        *,
        node_cpu: Sequence[float] | None = None,
        node_memory: Sequence[float] | None = None,
        node_model: Sequence[str] | None = None,
        max_jobs_per_gpu: int | None = None,
    ) -> None:
        n = len(node_gpus)
        caps = (
            [float(gpu_capacity)] * n
            if isinstance(gpu_capacity, int | float)
            else list(gpu_capacity)
        )
        if len(caps) != n:
            raise ValueError(f"gpu_capacity has {len(caps)} entries for {n} nodes")
        if any(g < 0 for g in node_gpus):
            raise ValueError("a node's GPU count cannot be negative")
        counts = torch.tensor(list(node_gpus), dtype=torch.int64)
        self.gpu_node = torch.repeat_interleave(torch.arange(n), counts)
        self.capacity = torch.repeat_interleave(torch.tensor(caps, dtype=_F), counts)
        self.free = self.capacity.clone()
        self.jobs = torch.zeros_like(self.gpu_node)
        width = max(1, int(counts.max())) if n else 1
        first = torch.cumsum(counts, 0) - counts
        col = torch.arange(width)
        self.slots = torch.where(col < counts[:, None], first[:, None] + col, -1)
        self.cpu_free = self._per_node(node_cpu, n)
        self.memory_free = self._per_node(node_memory, n)
        self.models: list[str] = sorted(set(node_model)) if node_model is not None else []
        if node_model is not None and len(node_model) != n:
            raise ValueError(f"node_model has {len(node_model)} entries for {n} nodes")
        self.node_model = torch.tensor(
            [self.models.index(m) for m in node_model] if node_model is not None else [0] * n,
            dtype=torch.int64,
        )
        self.max_jobs_per_gpu = max_jobs_per_gpu

    @staticmethod
    def _per_node(values: Sequence[float] | None, n: int) -> torch.Tensor:
        if values is None:
            return torch.full((n,), math.inf, dtype=_F)
        if len(values) != n:
            raise ValueError(f"{len(values)} values for {n} nodes")
        return torch.tensor(list(values), dtype=_F)

    @property
    def num_nodes(self) -> int:
        """How many nodes."""
        return int(self.slots.shape[0])

    @property
    def num_gpus(self) -> int:
        """How many GPUs."""
        return int(self.free.shape[0])

    def slot_free(self) -> torch.Tensor:
        """Free per node and GPU slot (nodes x slots), -1 in a slot with no GPU.

        Kept until ``free`` or ``slots`` change (a tensor's version counts its in-place
        changes; a new tensor is another object): a decision asks for it several times."""
        key = (id(self.free), self.free._version, id(self.slots), self.slots._version)
        kept = getattr(self, "_slot_free", None)
        if kept is None or kept[0] != key:
            value = torch.where(self.slots >= 0, self.free[self.slots.clamp(min=0)], -1.0)
            kept = (key, value)
            self._slot_free = kept
        return kept[1]

    def feasible(self, request: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """The nodes that can take ``request`` (bool per node) and, per node and slot, the
        GPUs that can (bool, nodes x slots): enough free, under ``max_jobs_per_gpu``, the
        model asked for, and the node's CPU and memory."""
        node_ok = (self.cpu_free >= request.cpu) & (self.memory_free >= request.memory)
        if request.model is not None:
            if request.model not in self.models:
                node_ok = torch.zeros_like(node_ok)
            else:
                node_ok &= self.node_model == self.models.index(request.model)
        gpu_ok = self.free >= request.need
        if self.max_jobs_per_gpu is not None:
            gpu_ok &= self.jobs < self.max_jobs_per_gpu
        slot_ok = (self.slots >= 0) & gpu_ok[self.slots.clamp(min=0)]
        if request.gpus > 0:
            node_ok &= slot_ok.sum(1) >= request.gpus
        return node_ok, slot_ok & node_ok[:, None]

    def allocate(self, request: Request, placement: Placement) -> None:
        """Take ``request``'s resources at ``placement``."""
        self._apply(request, placement, 1)

    def release(self, request: Request, placement: Placement) -> None:
        """Give back what :meth:`allocate` took for ``request`` at ``placement``."""
        self._apply(request, placement, -1)

    def _apply(self, request: Request, placement: Placement, sign: int) -> None:
        if len(placement.gpus) != request.gpus:
            raise ValueError(f"{request.gpus} GPUs asked for, {len(placement.gpus)} placed")
        if placement.gpus:
            idx = torch.tensor(placement.gpus, dtype=torch.int64)
            if bool((self.gpu_node[idx] != placement.node).any()):
                raise ValueError(f"GPUs {placement.gpus} are not all on node {placement.node}")
            self.free[idx] -= sign * request.need
            self.jobs[idx] += sign
        self.cpu_free[placement.node] -= sign * request.cpu
        self.memory_free[placement.node] -= sign * request.memory

    def allocated_share(self) -> float:
        """The share of all GPU capacity allocated, 0 to 1."""
        total = float(self.capacity.sum())
        return float((self.capacity - self.free).sum()) / total if total else 0.0


@runtime_checkable
class Policy(Protocol):
    """A placement policy: where ``request`` goes in ``state``, or None where it fits
    nowhere. It does not change ``state``; the caller allocates what it chose."""

    def choose(self, state: ClusterState, request: Request) -> Placement | None:
        """The placement, or None."""
        ...


# -- candidates ------------------------------------------------------------------------


@dataclass
class _Candidates:
    """Feasible placements: ``node`` (C), ``slot`` (C x k: the slots taken) and ``before``
    (C x k: their free before)."""

    node: torch.Tensor
    slot: torch.Tensor
    before: torch.Tensor


def _candidates(state: ClusterState, request: Request, order: str = "tight") -> _Candidates | None:
    """Every feasible placement of a one-GPU request (a candidate per GPU), or one per
    node for a multi-GPU request, whose GPUs are that node's ``order`` ones: ``tight``
    (least free first), ``loose`` (most free first) or ``idle`` (fewest jobs first)."""
    node_ok, slot_ok = state.feasible(request)
    fm = state.slot_free()
    if request.gpus == 0:
        node = torch.nonzero(node_ok).flatten()
        empty = torch.zeros((len(node), 0), dtype=torch.int64)
        return _Candidates(node, empty, empty.to(_F)) if len(node) else None
    if request.gpus == 1:
        node, slot = torch.nonzero(slot_ok, as_tuple=True)
        if not len(node):
            return None
        return _Candidates(node, slot[:, None], fm[node, slot][:, None])
    node = torch.nonzero(node_ok).flatten()
    if not len(node):
        return None
    ok = slot_ok[node]
    if order == "idle":
        key = state.jobs[state.slots[node].clamp(min=0)].to(_F)
    elif order == "loose":
        key = -fm[node]
    else:
        key = fm[node]
    key = torch.where(ok, key, math.inf)
    slot = torch.argsort(key, dim=1, stable=True)[:, : request.gpus]
    return _Candidates(node, slot, torch.gather(fm[node], 1, slot))


def _lexmin(*keys: torch.Tensor) -> int:
    """The index of the smallest entry by the first key, ties by the next ones, then the
    lowest index."""
    alive = torch.ones_like(keys[0], dtype=torch.bool)
    for k in keys:
        best = torch.where(alive, k, math.inf).min()
        alive &= k == best
    return int(torch.nonzero(alive)[0, 0])


def _placement(state: ClusterState, c: _Candidates, i: int) -> Placement:
    node = int(c.node[i])
    return Placement(node, tuple(int(state.slots[node, s]) for s in c.slot[i].tolist()))


def _fits(free: Sequence[float], jobs: Sequence[int], asked: float, cap: int | None) -> list[int]:
    """The one-GPU devices (plain numbers) where ``asked`` fits, under ``cap`` jobs."""
    return [
        d
        for d, (f, j) in enumerate(zip(free, jobs, strict=True))
        if f >= asked and (cap is None or j < cap)
    ]


def _node_free_after(state: ClusterState, c: _Candidates, request: Request) -> torch.Tensor:
    """Each candidate's node: its GPUs' total free after the placement."""
    fm = state.slot_free().clamp(min=0).sum(1)
    return fm[c.node] - request.need * request.gpus


class BestFit:
    """The tightest fit: the GPUs left with the least free memory (summed over a
    multi-GPU request's GPUs), ties to the node left with the least free, then the lowest
    index. Packs jobs, keeping whole GPUs whole for large jobs."""

    def choose(self, state: ClusterState, request: Request) -> Placement | None:
        """The candidate with the least left over."""
        c = _candidates(state, request, "tight")
        if c is None:
            return None
        left = (c.before - request.need).sum(1)
        return _placement(state, c, _lexmin(left, _node_free_after(state, c, request)))

    def pick(
        self, free: Sequence[float], jobs: Sequence[int], asked: float, cap: int | None = None
    ) -> int | None:
        """:meth:`choose`'s rule on a few one-GPU devices given as plain numbers (free and
        jobs per device): the index chosen, or None. Building the tensors would cost more
        than the decision on a machine's few GPUs."""
        fits = _fits(free, jobs, asked, cap)
        return min(fits, key=lambda d: free[d]) if fits else None


class MostFree:
    """The GPUs with the most free memory (worst fit: spreads jobs out, leaving each the
    most headroom), ties to the lowest index."""

    def choose(self, state: ClusterState, request: Request) -> Placement | None:
        """The candidate with the most left over."""
        c = _candidates(state, request, "loose")
        if c is None:
            return None
        left = (c.before - request.need).sum(1)
        return _placement(state, c, _lexmin(-left, -_node_free_after(state, c, request)))

    def pick(
        self, free: Sequence[float], jobs: Sequence[int], asked: float, cap: int | None = None
    ) -> int | None:
        """:meth:`choose`'s rule on plain numbers (see :meth:`BestFit.pick`)."""
        fits = _fits(free, jobs, asked, cap)
        return min(fits, key=lambda d: -free[d]) if fits else None


class LeastLoaded:
    """The GPUs running the fewest jobs (summed over a multi-GPU request's GPUs), ties to
    the most free memory, then the lowest index."""

    def choose(self, state: ClusterState, request: Request) -> Placement | None:
        """The candidate with the fewest jobs."""
        c = _candidates(state, request, "idle")
        if c is None:
            return None
        gpu = state.slots[c.node[:, None], c.slot]
        load = (
            state.jobs[gpu].sum(1).to(_F) if c.slot.shape[1] else torch.zeros(len(c.node), dtype=_F)
        )
        left = (c.before - request.need).sum(1)
        return _placement(state, c, _lexmin(load, -left))

    def pick(
        self, free: Sequence[float], jobs: Sequence[int], asked: float, cap: int | None = None
    ) -> int | None:
        """:meth:`choose`'s rule on plain numbers (see :meth:`BestFit.pick`)."""
        fits = _fits(free, jobs, asked, cap)
        return min(fits, key=lambda d: (jobs[d], -free[d])) if fits else None


# -- fragmentation ------------------------------------------------------------------------


def _shape(r: Request) -> tuple[int, float, float, str]:
    """A request's kind for :class:`Workload`: GPU count, need, CPU, model ("": any)."""
    return (r.gpus, float(r.need) if r.gpus else 0.0, float(r.cpu), r.model or "")


class Workload:
    """A typical job mix, for :class:`Fragmentation`: request kinds with their shares.

    Requests are grouped by (GPU count, need per GPU, GPU model); within a group, the CPU
    asked for is kept as a distribution. Weights are normalised to sum to 1 over the kinds
    kept:

    - ``popular`` (0 to 1; None: every kind): only the most frequent kinds, by (GPU count,
      need, CPU, model), the most frequent first (ties: the most CPU first), until
      their shares add up to at least ``popular`` of the mix; the rest, rare shapes that
      would weigh little but cost a term each, are left out before normalising (FGD's
      simulator keeps 95%);
    - ``no_gpu``: jobs with no GPU are part of the mix: they use none of a node's free GPU
      memory, so for their share all of it is fragmented (FGD counts them so). By default
      they are left out.

    The expected fragmentation of a node with free ``f_1..f_K`` on its GPUs and CPU ``c``
    left (FGD, Weng et al., USENIX ATC 2023) is, over the kinds ``t`` of the mix with
    share ``p_t``, need ``m_t`` on ``k_t`` GPUs and CPU ``q_t``:

        sum_t p_t * (sum of f_j with f_j < m_t   if the node can host t
                     else sum of all f_j)

    where the node can host ``t`` when at least ``k_t`` GPUs have ``f_j >= m_t``, ``c >=
    q_t`` and, where ``t`` asks for a GPU model, the node's GPUs are that model: the free
    memory that a job of the mix cannot use. A job with no GPU can host none of it.
    """

    def __init__(
        self, kinds: Mapping[Request, float], *, popular: float | None = None, no_gpu: bool = False
    ) -> None:
        if popular is not None and not 0 < popular <= 1:
            raise ValueError(f"popular is a share, in (0, 1]: {popular}")
        shapes: dict[tuple[int, float, float, str], float] = {}
        for r, w in kinds.items():
            if w > 0 and (r.gpus > 0 or no_gpu):
                shape = _shape(r)
                shapes[shape] = shapes.get(shape, 0.0) + w
        order = sorted(shapes.items(), key=lambda kv: (kv[1], kv[0][2], kv[0][1:]), reverse=True)
        if popular is not None:
            whole, share, n = sum(shapes.values()), 0.0, 0
            while n < len(order) and share < popular * whole:
                share += order[n][1]
                n += 1
            order = order[:n]
        kept = {k for k, _ in order}
        groups: dict[tuple[int, float, str], list[tuple[float, float]]] = {}
        idle = total = 0.0
        for (gpus, need, q, model), w in order:
            total += w
            if gpus == 0:
                idle += w
            else:
                groups.setdefault((gpus, need, model), []).append((q, w))
        if not groups:
            raise ValueError("a workload needs at least one request with a GPU")
        keys = sorted(groups)
        self.kinds = {r: w for r, w in kinds.items() if w > 0 and _shape(r) in kept}
        self.count = torch.tensor([k for k, _, _ in keys], dtype=_F)
        self.need = torch.tensor([m for _, m, _ in keys], dtype=_F)
        self.models: list[str | None] = [g or None for _, _, g in keys]
        width = max(len(v) for v in groups.values())
        cpu = torch.full((len(keys), width), math.inf, dtype=_F)
        cum = torch.zeros((len(keys), width + 1), dtype=_F)
        for i, key in enumerate(keys):
            rows = sorted(groups[key])
            cpu[i, : len(rows)] = torch.tensor([q for q, _ in rows], dtype=_F)
            weights = torch.tensor([w / total for _, w in rows], dtype=_F)
            cum[i, 1 : len(rows) + 1] = torch.cumsum(weights, 0)
            cum[i, len(rows) + 1 :] = cum[i, len(rows)]
        self._cpu = cpu.contiguous()
        self._cum = cum
        self._all = float(cum[:, -1].sum()) + idle / total
        self._access_for: tuple[tuple[str, ...], torch.Tensor] | None = None

    @classmethod
    def from_requests(
        cls, requests: Iterable[Request], *, popular: float | None = None, no_gpu: bool = False
    ) -> Workload:
        """The mix of ``requests``, each kind weighted by how often it occurs (``popular``
        and ``no_gpu`` as for the class)."""
        return cls(dict(Counter(requests)), popular=popular, no_gpu=no_gpu)

    @property
    def model_aware(self) -> bool:
        """Whether a kind of the mix asks for a GPU model."""
        return any(m is not None for m in self.models)

    def access(self, models: Sequence[str], node_model: torch.Tensor) -> torch.Tensor | None:
        """Per node and group: whether the node can run the group's GPU model. ``models``
        are the model names, ``node_model`` each node's index into them (-1: a node with no
        model named, where only the groups asking for no model run). None where no group
        asks for a model (every group runs everywhere)."""
        if not self.model_aware:
            return None
        names = tuple(models)
        if self._access_for is None or self._access_for[0] != names:
            rows = [[m is None or m == name for m in self.models] for name in names]
            rows.append([m is None for m in self.models])
            self._access_for = (names, torch.tensor(rows, dtype=torch.bool))
        return self._access_for[1][torch.where(node_model >= 0, node_model, len(names))]

    def _cpu_share(self, cpu: torch.Tensor) -> torch.Tensor:
        """Per node (C) and group (M): the share of the mix in that group asking for at
        most ``cpu``."""
        values = cpu[None, :].expand(len(self._cpu), -1).contiguous()
        idx = torch.searchsorted(self._cpu, values, right=True)
        return torch.gather(self._cum, 1, idx).T

    def _terms(self, free: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per node and group: GPUs with free >= the need, and their free summed."""
        ge = free[:, None, :] >= self.need[None, :, None]
        return ge.sum(2).to(_F), torch.where(ge, free[:, None, :], 0.0).sum(2)

    def _combine(
        self,
        total: torch.Tensor,
        count: torch.Tensor,
        usable: torch.Tensor,
        cpu: torch.Tensor,
        access: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hosted = (count >= self.count) * self._cpu_share(cpu)
        if access is not None:
            hosted = hosted * access
        return total * self._all - (hosted * usable).sum(1)

    def fragmentation(
        self,
        free: torch.Tensor,
        cpu: torch.Tensor | None = None,
        models: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        """The expected fragmentation of each node (see the class): ``free`` is nodes x
        slots (negative in a slot with no GPU), ``cpu`` each node's CPU left (None:
        unlimited), ``models`` each node's GPU model (None: every kind runs anywhere; a
        node's None: a kind asking for a model cannot run there)."""
        free = free.to(_F)
        if cpu is None:
            cpu = torch.full((free.shape[0],), math.inf, dtype=_F)
        access = None
        if models is not None:
            names = sorted({m for m in models if m is not None})
            idx = torch.tensor([-1 if m is None else names.index(m) for m in models])
            access = self.access(names, idx)
        count, usable = self._terms(free)
        return self._combine(free.clamp(min=0).sum(1), count, usable, cpu.to(_F), access)


def _first(inverse: torch.Tensor, groups: int) -> torch.Tensor:
    """The lowest index in each group of ``inverse`` (as torch.unique returns it)."""
    first = torch.full((groups,), len(inverse), dtype=torch.int64)
    return first.scatter_reduce(0, inverse, torch.arange(len(inverse)), "amin")


def _row_ids_exact(rows: torch.Tensor) -> torch.Tensor:
    """An id per row, equal for equal rows (``torch.unique(dim=0)``'s inverse, by
    one-dimensional uniques column by column, which are much faster)."""
    ids = torch.zeros(rows.shape[0], dtype=torch.int64)
    for j in range(rows.shape[1]):
        _, col = torch.unique(rows[:, j], return_inverse=True)
        _, ids = torch.unique(ids * (int(col.max()) + 1) + col, return_inverse=True)
    return ids


_HASH = torch.randint(
    -(2**62), 2**62, (64,), generator=torch.Generator().manual_seed(0x5EED), dtype=torch.int64
).bitwise_or(1)


def _row_ids(rows: torch.Tensor) -> torch.Tensor:
    """An id per row (float64), equal for equal rows: each row's bits mixed into one
    integer, one unique over those, then every row checked against its group's first; a
    collision (different rows, one hash: never seen) falls back to the column-by-column
    way. Two uniques instead of two per column."""
    if rows.shape[1] > len(_HASH):
        return _row_ids_exact(rows)
    bits = rows.to(_F).contiguous().view(torch.int64)
    ids: torch.Tensor
    _, ids = torch.unique((bits * _HASH[: rows.shape[1]]).sum(1), return_inverse=True)
    first = _first(ids, int(ids.max()) + 1 if len(ids) else 0)
    if bool((rows[first[ids]] == rows).all()):
        return ids
    return _row_ids_exact(rows)


def _distinct(state: ClusterState, c: _Candidates, model: bool = False) -> _Candidates:
    """The candidates less those that are the same as an earlier one for
    :class:`Fragmentation` (its growth and its tie-breaks): a node whose GPUs' free
    (sorted) and CPU left (and GPU model, with ``model``) equal an earlier candidate's
    node's, taking GPUs with the same free. Thousands of candidates on a near-empty
    cluster come to a few dozen."""
    nodes, inverse = torch.unique(c.node, return_inverse=True)
    fm = torch.sort(state.slot_free()[nodes], dim=1, descending=True).values
    cols = [fm, state.cpu_free[nodes, None]]
    if model:
        cols.append(state.node_model[nodes, None].to(_F))
    sig = torch.cat(cols, dim=1)
    group = _row_ids(torch.cat([sig[inverse], c.before], dim=1))
    keep = torch.sort(_first(group, int(group.max()) + 1)).values
    return _Candidates(c.node[keep], c.slot[keep], c.before[keep])


class Fragmentation:
    """FGD's policy: the placement after which the expected fragmentation of the cluster,
    for the typical job mix, grows least (only the chosen node's changes).

    As FGD scores it, the growth ``g`` is compared on ``levels`` steps of
    ``sigmoid(-g / scale)`` (``scale``: one GPU's capacity, the largest in the cluster,
    where None), so that growths a small share of a GPU apart tie. ``levels=None``
    compares the growth itself.

    ``ties``: ``"tightest"`` (the default) gives a tie to the tightest fit (as
    :class:`BestFit`: a small device before a large one), then the node left with the
    least, then the lowest index. ``"order"`` gives it to the first node in the cluster's
    order, and on it to the lowest GPU: a fixed priority of nodes, as FGD's own simulator
    breaks them, which keeps filling the same nodes and leaves others whole (on FGD's
    trace, with the nodes in a random order, it fills 0.1 points more).

    ``workload``: the typical mix; None learns it from the requests this policy is asked
    to place (each counted every time it is asked, kept or not).
    """

    def __init__(
        self,
        workload: Workload | None = None,
        *,
        levels: int | None = 100,
        scale: float | None = None,
        ties: str = "tightest",
    ) -> None:
        if ties not in ("order", "tightest"):
            raise ValueError(f"ties must be 'order' or 'tightest', got {ties!r}")
        self.ties = ties
        self.workload = workload
        self.levels = levels
        self.scale = scale
        self._learn = workload is None
        self._seen: Counter[Request] = Counter()
        self._dirty = False

    def observe(self, request: Request) -> None:
        """Count ``request`` in the learned mix (the mix is then rebuilt when next used)."""
        if request.gpus > 0:
            self._seen[request] += 1
            self._dirty = True

    def _mix(self) -> Workload | None:
        if self._dirty:
            self.workload = Workload(dict(self._seen))
            self._dirty = False
        return self.workload

    def delta(
        self, state: ClusterState, request: Request
    ) -> tuple[_Candidates, torch.Tensor] | None:
        """The candidates and, for each, how much its node's expected fragmentation grows."""
        c = _candidates(state, request, "tight")
        mix = self._mix()
        if c is None or mix is None:
            return None
        c = _distinct(state, c, mix.model_aware)
        nodes, inverse = torch.unique(c.node, return_inverse=True)
        fm = state.slot_free()[nodes]
        count_b, usable_b = mix._terms(fm)
        total_b = fm.clamp(min=0).sum(1)
        cpu_b = state.cpu_free[nodes]
        model = state.node_model[nodes] if state.models else torch.full_like(nodes, -1)
        access = mix.access(state.models, model)
        frag_b = mix._combine(total_b, count_b, usable_b, cpu_b, access)
        # After: only the taken slots change; update the per-group terms slot by slot.
        count, usable = count_b[inverse], usable_b[inverse]
        need = mix.need[None, :]
        for j in range(c.slot.shape[1]):
            old = c.before[:, j : j + 1]
            new = old - request.need
            was, now = (old >= need).to(_F), (new >= need).to(_F)
            count = count - was + now
            usable = usable - was * old + now * new
        total_a = total_b[inverse] - request.need * request.gpus
        access_a = None if access is None else access[inverse]
        frag_a = mix._combine(total_a, count, usable, cpu_b[inverse] - request.cpu, access_a)
        return c, frag_a - frag_b[inverse]

    def choose(self, state: ClusterState, request: Request) -> Placement | None:
        """The candidate whose node's expected fragmentation grows least."""
        if self._learn:
            self.observe(request)
        got = self.delta(state, request)
        if got is None:
            c = _candidates(state, request, "tight")
            return None if c is None else _placement(state, c, 0)
        c, grow = got
        if self.levels is not None:
            scale = self.scale if self.scale is not None else float(state.capacity.max())
            grow = -torch.floor(self.levels * torch.sigmoid(-grow / scale))
        if self.ties == "order":
            return _placement(state, c, _lexmin(grow))
        left = (c.before - request.need).sum(1)
        return _placement(state, c, _lexmin(grow, left, _node_free_after(state, c, request)))
