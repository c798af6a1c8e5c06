"""A run's row, the reference runs, and how a run's outputs are checked.

Every run is checked two ways against a reference run with no co-tenant: its final
weights (or all its inference outputs, in order) with ``torch.allclose``, and, sample
by sample, with a ``Ledger`` of what the run actually produced: for training, each
sample's count from the tally (``workload.Tallied``) of the step that made it into the
final weights; for inference, how many of the outputs it got back match the
sample's reference output. ``samples_lost`` counts the samples found 0 times,
``samples_duplicated`` those found more than once.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .cotenant import CotenantStartError, Tenant
from .memory import Session, load, load_infer, session
from .workload import Config, Data, build_model, make_optimizer, plan, train_step

#: The largest difference ``weights_match`` and ``outputs_match`` accept.
RTOL, ATOL = 1e-4, 1e-6


@dataclass
class Row:
    run: str
    loop: str
    finished: bool = True
    crashes: int = 0
    ooms: int = 0
    ooms_recovered: int = 0
    samples_lost: int = 0
    samples_duplicated: int = 0
    samples_redone: int = 0
    steps: int = 0
    batch_size: int = 0
    final_batch_size: int = 0
    match: bool | None = None
    max_abs_diff: float | None = None
    wall_s: float = 0.0
    time_lost_s: float = 0.0
    ticks: int = 0
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        key = "weights_match" if self.loop == "train" else "outputs_match"
        d[key] = d.pop("match")
        d["wall_s"] = round(self.wall_s, 3)
        d["time_lost_s"] = round(self.time_lost_s, 3)
        extra = d.pop("extra")
        d.update(extra)
        return d


HEADER = (
    f"{'loop':<6}{'run':<11}{'done':>5}{'crashes':>8}{'ooms':>6}{'lost':>9}{'dup':>5}"
    f"{'redone':>8}{'steps':>7}{'batch':>7}{'match':>7}{'maxdiff':>9}{'wall s':>8}{'lost s':>8}"
)


def print_row(r: Row) -> None:
    match = "-" if r.match is None else ("yes" if r.match else "NO")
    diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}"
    print(
        f"{r.loop:<6}{r.run:<11}{'yes' if r.finished else 'NO':>5}{r.crashes:>8}{r.ooms:>6}"
        f"{r.samples_lost:>9}{r.samples_duplicated:>5}{r.samples_redone:>8}{r.steps:>7}"
        f"{r.final_batch_size:>7}{match:>7}{diff:>9}{r.wall_s:>8.2f}{r.time_lost_s:>8.2f}"
        f"  {r.note}",
        flush=True,
    )


def run(fn: Callable[..., Row], *args: Any) -> Row:
    """One run; an error that is not an OOM ends that run only, reported in its row."""
    try:
        return fn(*args)
    except CotenantStartError:
        raise
    except Exception as exc:
        traceback.print_exc()
        loop, name = fn.__name__.split("_", 1)
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        return Row(name, loop, finished=False, note=f"error: {type(exc).__name__}: {first}")


# -- what a run produced -----------------------------------------------------------------


class Ledger:
    """Per batch of a plan, how many times each of its samples is in what the run produced.

    A batch's counts are forgotten when the run throws its result away (a restart from
    a checkpoint); a batch never recorded counts 0 for each of its samples.
    """

    def __init__(self, batches: list[tuple[int, int, int]]) -> None:
        self.batches = batches
        self.sizes = [hi - lo for _, lo, hi in batches]
        self.counts: dict[int, torch.Tensor] = {}

    def add(self, i: int, counts: torch.Tensor) -> None:
        self.counts[i] = counts + self.counts[i] if i in self.counts else counts

    def forget(self, start: int) -> None:
        """Batches ``start`` on are no longer in the result."""
        for i in [i for i in self.counts if i >= start]:
            del self.counts[i]

    def lost(self) -> int:
        return sum(
            int((self.counts[i] == 0).sum()) if i in self.counts else n
            for i, n in enumerate(self.sizes)
        )

    def duplicated(self) -> int:
        return sum(int((c > 1).sum()) for c in self.counts.values())


def matches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """For each row of ``want`` (a sample's reference output), how many rows of ``got``
    (the outputs a run got back for those samples) are close to it."""
    if got.shape == want.shape:
        close = torch.isclose(got, want, rtol=RTOL, atol=ATOL).all(1)
        if bool(close.all()):
            return torch.ones(len(want), dtype=torch.long)
    if got.ndim != 2 or not len(got):
        return torch.zeros(len(want), dtype=torch.long)
    # Not each in its place: every produced row counts for every sample it matches.
    close = (got[:, None] - want[None]).abs() <= ATOL + RTOL * want.abs()[None]
    return close.all(2).sum(0)


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[bool, float | None]:
    """``torch.allclose`` on every tensor, and the largest absolute difference."""
    if len(got) != len(want) or any(a.shape != b.shape for a, b in zip(got, want, strict=True)):
        return False, None
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, want, strict=True))
    ok = all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(got, want, strict=True))
    return ok, diff


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().to("cpu", copy=True) for p in model.parameters()]


def close_row(
    row: Row,
    s: Session,
    tenant: Tenant,
    t_start: float,
    ledger: Callable[[], Ledger],
    got: Callable[[], list[torch.Tensor]],
    want: list[torch.Tensor],
) -> None:
    """The run's time, its co-tenant's figures, then (in host memory) its ledger and its
    result (``got()``) against the reference's (``want``)."""
    s.sync()
    row.wall_s = time.perf_counter() - t_start
    row.ticks = tenant.ticks
    row.extra.update(tenant.figures())
    if hasattr(s, "room_error"):  # a GPU: free memory the ballast left beyond the plan
        row.extra["room_error"] = s.room_error
    with s.host():
        done = ledger()
        row.samples_lost, row.samples_duplicated = done.lost(), done.duplicated()
        row.match, row.max_abs_diff = compare(got(), want)


# -- the references: the same loops with no co-tenant -------------------------------------


def train_reference(kind: str, cfg: Config, data: Data) -> tuple[list[torch.Tensor], float]:
    with session("cpu" if kind == "sim" else kind, None) as s:
        model = build_model(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model)
        t0 = time.perf_counter()
        for e, lo, hi in plan(cfg.n_samples, cfg.epochs, cfg.batch):
            x, y, _ = load(s, data, e, lo, hi)
            train_step(model, opt, x, y)
        s.sync()
        return weights(model), time.perf_counter() - t0


def infer_model(cfg: Config, s: Session) -> nn.Module:
    model = build_model(cfg)
    s.adopt(model)
    return model.eval()


def infer_plan(cfg: Config, size: int) -> list[tuple[int, int, int]]:
    return plan(cfg.n_samples, cfg.infer_passes, size)


def infer_reference(kind: str, cfg: Config, data: Data) -> torch.Tensor:
    """Every pass's outputs, one after another (a pass's rows are its samples in order)."""
    with session("cpu" if kind == "sim" else kind, None) as s:
        model = infer_model(cfg, s)
        outs = []
        with torch.no_grad():
            for _, lo, hi in infer_plan(cfg, cfg.infer_batch):
                outs.append(model(load_infer(s, data, lo, hi)).to("cpu", copy=True))
        return torch.cat(outs)


def infer_ledger(
    cfg: Config,
    batches: list[tuple[int, int, int]],
    produced: list[tuple[int, torch.Tensor]],
    ref: torch.Tensor,
) -> Ledger:
    """The ledger of inference outputs: ``produced`` holds (batch, its outputs) pairs."""
    ledger = Ledger(batches)
    for i, out in produced:
        e, lo, hi = batches[i]
        ledger.add(i, matches(out, ref[e * cfg.n_samples + lo : e * cfg.n_samples + hi]))
    return ledger
