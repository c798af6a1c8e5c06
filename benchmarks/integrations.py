"""vramctl inside Lightning, the Hugging Face Trainer and Accelerate, against their own tools.

On the models and simulated GPUs of ``fit_search.py`` (a real search finds the true largest
batch whose steps peak within 0.9 C), end to end through each framework:

- Lightning: its ``Tuner.scale_batch_size(mode="binsearch")`` (the ``BatchSizeFinder``) on a
  device of 0.9 C against ``VramctlBatchSize`` (target 0.9 of C) in ``Trainer.fit``;
- Hugging Face: ``Trainer(auto_find_batch_size=True)`` (starting at 1024 in the full run, 128
  with ``--quick``) on 0.9 C against ``fit_trainer_batch_size`` before the ``Trainer`` is built;
- Accelerate: ``find_executable_batch_size`` against vramctl's drop-in of the same shape;

each with the batch it picks as a fraction of the true largest, the trials (real runs at a
size) it made, its seconds, and whether real training steps then run at that size without
an OOM (200; ``--quick``: 20, for vramctl's answers only, on one model). Then, under a
co-tenant that takes a share of the device in the middle of a run, the samples lost (batches
never trained because the run died) by a Lightning run and a Hugging Face ``Trainer`` run,
each with and without vramctl's guard.

The last line is one JSON object: vramctl's worst figures (``min_fraction_of_true_max``,
``max_trials``, ``ooms_after_tuning``, ``samples_lost``), each peer's beside them under
``peers``, and the rows.

    python benchmarks/integrations.py --quick     # one model, under a minute
    python benchmarks/integrations.py             # four models
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import fit_search
import torch
from fit_search import Outcome, Session, Spec
from torch import nn

import vramctl

import _common

TARGET = fit_search.TARGET
QUICK_STEPS = 20
#: --quick runs this model, and the survival check for vramctl's answers only.
QUICK_MODELS = ("cnn",)
HF_START = 1024
QUICK_HF_START = 128
#: The co-tenant run: steps, the step at which the co-tenant arrives, its share of C.
COTENANT_STEPS = 12
COTENANT_AT = 4
COTENANT_SHARE = 0.3


class _Samples(torch.utils.data.Dataset[Any]):
    def __init__(self, spec: Spec, key: str | None = None) -> None:
        self.spec = spec
        self.key = key

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> Any:
        x = self.spec.sample()
        return {self.key: x} if self.key else x


# -- Lightning --------------------------------------------------------------------------------


def _lit(spec: Spec, batch_size: int, hog_at: int | None = None, hog: int = 0) -> Any:
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, _ = fit_search.fresh(spec)
            self.batch_size = batch_size
            self.trained = 0
            self.held: list[torch.Tensor] = []

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(_Samples(spec), batch_size=self.batch_size)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if hog_at is not None and batch_idx == hog_at and not self.held:
                self.held.append(
                    vramctl.current_device().adopt(torch.empty(hog, dtype=torch.uint8))
                )
            return fit_search.loss_of(self.net(batch), batch)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.trained += batch.shape[0]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Lit()


def _lightning_trainer(root: str, steps: int, callbacks: list[Any]) -> Any:
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks,
    )


def run_vramctl_lightning(s: Session, spec: Spec, capacity: int) -> Outcome:
    from vramctl.integrations.lightning import VramctlBatchSize

    cb = VramctlBatchSize(cache=False, target=TARGET)
    with tempfile.TemporaryDirectory() as root, _common.quiet(), s.fit_room(capacity) as gpu:
        lit = _lit(spec, 2)
        gpu.adopt(lit)
        trainer = _lightning_trainer(root, 1, [cb])
        t0 = time.perf_counter()
        trainer.fit(lit)
        seconds = time.perf_counter() - t0
    assert cb.result is not None
    return Outcome(
        cb.batch_size or 0,
        len(cb.result.probes),
        seconds,
        detail={"tried": [b for b, _, _ in cb.result.probes], "predicted": cb.result.predicted},
    )


def lost_lightning(spec: Spec, capacity: int, batch: int, guarded: bool) -> dict[str, Any]:
    """Samples never trained when a co-tenant takes a share of the device mid-run."""
    from vramctl.integrations.lightning import VramctlGuard

    hog = int(COTENANT_SHARE * capacity)
    guard = VramctlGuard() if guarded else None
    planned = COTENANT_STEPS * batch
    error = None
    with tempfile.TemporaryDirectory() as root, _common.quiet(), vramctl.simulate(capacity) as gpu:
        lit = _lit(spec, batch, COTENANT_AT, hog)
        gpu.adopt(lit)
        try:
            _lightning_trainer(root, COTENANT_STEPS, [guard] if guard else []).fit(lit)
        except torch.OutOfMemoryError as exc:
            error = f"{type(exc).__name__}"
        trained = lit.trained
        del lit
    ooms = guard.guard.ooms if guard is not None and guard.guard is not None else None
    return {
        "samples_planned": planned,
        "samples_lost": planned - trained,
        "ooms": ooms,
        "crashed": error,
    }


# -- Hugging Face Trainer ---------------------------------------------------------------------


class _HfWrap(nn.Module):
    """The model as the Trainer calls it: keyword inputs in, ``{"loss": ...}`` out."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.net, _ = fit_search.fresh(spec)
        self.sizes: list[int] = []
        self.hog: Callable[[int], None] | None = None

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.sizes.append(x.shape[0])
        if self.hog is not None:
            self.hog(len(self.sizes))
        return {"loss": fit_search.loss_of(self.net(x), x)}


def _hf_args(root: str, batch: int, steps: int, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=root,
        per_device_train_batch_size=batch,
        max_steps=steps,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        learning_rate=1e-4,
        **kwargs,
    )


def _trials(sizes: list[int]) -> list[int]:
    """The batch sizes of successive attempts (a new attempt starts at a new size)."""
    out: list[int] = []
    for b in sizes:
        if not out or b != out[-1]:
            out.append(b)
    return out


def run_hf_auto(s: Session, spec: Spec, budget: int, start: int) -> Outcome:
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as root, _common.quiet(), s.room(budget):
        model = _HfWrap(spec)
        trainer = Trainer(
            model=model,
            args=_hf_args(root, start, 2, auto_find_batch_size=True),
            train_dataset=_Samples(spec, "x"),
        )
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
        found = int(trainer._train_batch_size)
        tried = _trials(model.sizes)
        del trainer, model
    return Outcome(found, len(tried), seconds, detail={"tried": tried})


def run_vramctl_hf(s: Session, spec: Spec, capacity: int) -> Outcome:
    from vramctl.integrations.transformers import fit_trainer_batch_size

    with tempfile.TemporaryDirectory() as root, _common.quiet(), s.fit_room(capacity) as gpu:
        model = gpu.adopt(_HfWrap(spec))
        args = _hf_args(root, 8, 2)
        t0 = time.perf_counter()
        picked = fit_trainer_batch_size(
            model, args, _Samples(spec, "x"), effective_batch=1 << 16, target=TARGET, cache=False
        )
        seconds = time.perf_counter() - t0
        del model
    fit = picked.fit
    return Outcome(
        fit.batch_size,
        len(fit.probes),
        seconds,
        detail={
            "tried": [b for b, _, _ in fit.probes],
            "predicted": fit.predicted,
            "per_device_for_65536": picked.per_device_train_batch_size,
            "accumulation_for_65536": picked.gradient_accumulation_steps,
        },
    )


def lost_hf(spec: Spec, capacity: int, batch: int, guarded: bool) -> dict[str, Any]:
    from transformers import Trainer

    from vramctl.integrations.transformers import GuardedTrainer

    hog = int(COTENANT_SHARE * capacity)
    planned = COTENANT_STEPS * batch
    error = None
    trainer: Any = None
    with tempfile.TemporaryDirectory() as root, _common.quiet(), vramctl.simulate(capacity) as gpu:
        model = gpu.adopt(_HfWrap(spec))
        held: list[torch.Tensor] = []

        def take(calls: int) -> None:
            if calls == COTENANT_AT + 1 and not held:
                held.append(gpu.adopt(torch.empty(hog, dtype=torch.uint8)))

        model.hog = take
        cls = GuardedTrainer if guarded else Trainer
        trainer = cls(
            model=model,
            args=_hf_args(root, batch, COTENANT_STEPS),
            train_dataset=_Samples(spec, "x"),
        )
        try:
            trainer.train()
        except torch.OutOfMemoryError as exc:
            error = type(exc).__name__
        steps_done = int(trainer.state.global_step)
        ooms = trainer.guard.ooms if guarded else None
        held.clear()
        del trainer, model
    return {
        "samples_planned": planned,
        "samples_lost": planned - steps_done * batch,
        "ooms": ooms,
        "crashed": error,
    }


# -- Accelerate ------------------------------------------------------------------------------


def run_vramctl_accelerate(s: Session, spec: Spec, capacity: int, start: int) -> Outcome:
    from vramctl.integrations.accelerate import find_executable_batch_size

    with s.fit_room(capacity):
        model, opt = fit_search.fresh(spec, s.device)
        step = fit_search.make_step(model, opt)
        tried: list[int] = []

        @find_executable_batch_size(starting_batch_size=start, target=TARGET)
        def train(batch_size: int) -> int:
            tried.append(batch_size)
            x = spec.batch(batch_size, s.device)
            for _ in range(2):
                step(x)
            return batch_size

        t0 = time.perf_counter()
        found = train()
        seconds = time.perf_counter() - t0
        del model, opt
    return Outcome(found, len(_trials(tried)), seconds, detail={"tried": tried})


# -- the run ----------------------------------------------------------------------------------


def _start(quick: bool) -> int:
    return QUICK_HF_START if quick else HF_START


#: (framework, tool, is it vramctl's, run(session, spec, capacity, budget, quick)).
TOOLS: list[tuple[str, str, bool, Callable[[Session, Spec, int, int, bool], Outcome]]] = [
    (
        "lightning",
        "BatchSizeFinder",
        False,
        lambda s, sp, c, b, q: fit_search.run_lightning(s, sp, b),
    ),
    ("lightning", "VramctlBatchSize", True, lambda s, sp, c, b, q: run_vramctl_lightning(s, sp, c)),
    (
        "transformers",
        "auto_find_batch_size",
        False,
        lambda s, sp, c, b, q: run_hf_auto(s, sp, b, _start(q)),
    ),
    (
        "transformers",
        "fit_trainer_batch_size",
        True,
        lambda s, sp, c, b, q: run_vramctl_hf(s, sp, c),
    ),
    (
        "accelerate",
        "find_executable_batch_size",
        False,
        lambda s, sp, c, b, q: fit_search.run_accelerate(s, sp, b, _start(q)),
    ),
    (
        "accelerate",
        "vramctl find_executable_batch_size",
        True,
        lambda s, sp, c, b, q: run_vramctl_accelerate(s, sp, c, _start(q)),
    ),
]


def _ooms(outs: list[dict[str, Any]]) -> int | None:
    """Answers that ran out of memory in the survival check (None: some were not checked)."""
    if any(o["survived_200_steps"] is None for o in outs):
        return None
    return sum(1 for o in outs if o["survived_200_steps"] is False)


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(__doc__, quick="one model, 20 survival steps; under a minute")
    ap.add_argument(
        "--models", help="comma-separated subset of " + ",".join(s.name for s in fit_search.SPECS)
    )
    args = _common.parse(ap, argv)
    wanted = args.models.split(",") if args.models else QUICK_MODELS if args.quick else None
    specs = [s for s in fit_search.SPECS if wanted is None or s.name in wanted]
    steps = QUICK_STEPS if args.quick else fit_search.SURVIVAL_STEPS
    logging.getLogger("vramctl").setLevel(logging.ERROR)
    session = Session()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    print(
        f"{'model':<12}{'true max':>9}  {'framework':<13}{'tool':<36}{'batch':>6}{'of max':>8}"
        f"{'trials':>7}{'seconds':>8}  OOM-free {steps} steps"
    )
    for spec in specs:
        capacity = spec.room(False, args.quick)
        budget = int(TARGET * capacity)
        truth, _, held = fit_search.true_max(session, spec, budget)
        row: dict[str, Any] = {
            "model": spec.name,
            "capacity_bytes": capacity,
            "true_max": truth,
            "true_max_edge_held": held,
            "tools": {},
            "cotenant": {},
        }
        rows.append(row)
        for framework, tool, mine, run in TOOLS:
            try:
                out = run(session, spec, capacity, budget, args.quick)
            except Exception as exc:
                out = Outcome(error=f"{type(exc).__name__}: {exc}"[:300])
            gc.collect()
            if out.batch_size and truth:
                out.fraction = out.batch_size / truth
            if out.batch_size and (mine or not args.quick):
                try:
                    out.survived = fit_search.runs(session, spec, out.batch_size, budget, steps)
                except Exception as exc:
                    out.error = f"survival check: {type(exc).__name__}: {exc}"[:300]
            d = out.to_dict()
            d.update(framework=framework, vramctl=mine)
            row["tools"][tool] = d
            print(
                f"{spec.name:<12}{truth:>9}  {framework:<13}{tool:<36}{out.batch_size:>6}"
                f"{out.fraction:>8.1%}{out.probes:>7}{out.seconds:>8.2f}  "
                f"{out.error or {True: 'yes', False: 'NO', None: 'not run'}[out.survived]}",
                flush=True,
            )
        # The co-tenant: training at 80% of the true largest batch, then 30% of C taken.
        batch = max(1, int(0.8 * truth))
        for name, fn in (("lightning", lost_lightning), ("transformers", lost_hf)):
            for guarded in (False, True):
                key = f"{name}{' + vramctl guard' if guarded else ''}"
                try:
                    res = fn(spec, capacity, batch, guarded)
                except Exception as exc:
                    res = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                row["cotenant"][key] = res
                print(
                    f"{spec.name:<12}  co-tenant {key:<30} lost {res.get('samples_lost')} of "
                    f"{res.get('samples_planned')} samples  {res.get('error') or ''}",
                    flush=True,
                )

    def figures(mine: bool) -> dict[str, Any]:
        outs = [o for r in rows for o in r["tools"].values() if o["vramctl"] == mine]
        ok = [o for o in outs if not o["error"]]
        return {
            "min_fraction_of_true_max": min((o["fraction_of_true_max"] for o in ok), default=None),
            "max_trials": max((o["probes"] for o in ok), default=None),
            "ooms_after_tuning": _ooms(ok),
            "errors": len(outs) - len(ok),
        }

    def lost(guarded: bool) -> int | None:
        vals = [
            v.get("samples_lost")
            for r in rows
            for k, v in r["cotenant"].items()
            if ("guard" in k) == guarded
        ]
        return None if any(v is None for v in vals) else sum(vals)  # type: ignore[misc]

    by_tool: dict[str, dict[str, Any]] = {}
    for _, tool, _mine, _ in TOOLS:
        outs = [r["tools"][tool] for r in rows]
        ok = [o for o in outs if not o["error"]]
        by_tool[tool] = {
            "min_fraction_of_true_max": min((o["fraction_of_true_max"] for o in ok), default=None),
            "max_trials": max((o["probes"] for o in ok), default=None),
            "ooms_after_tuning": _ooms(ok),
            "seconds": round(sum(o["seconds"] for o in ok), 2),
            "errors": len(outs) - len(ok),
        }
    mine, peers = figures(True), figures(False)
    summary = {
        "benchmark": "integrations",
        "quick": args.quick,
        "target": TARGET,
        "survival_steps": steps,
        **{k: mine[k] for k in ("min_fraction_of_true_max", "max_trials", "ooms_after_tuning")},
        "samples_lost": lost(True),
        "errors": mine["errors"],
        "peers": {**peers, "samples_lost": lost(False)},
        "per_tool": by_tool,
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "versions": {m: _common.version(m) for m in ("lightning", "transformers", "accelerate")},
    }
    ok = (
        mine["errors"] == 0
        and (mine["min_fraction_of_true_max"] or 0) >= 0.97
        and (mine["max_trials"] or 99) <= 3
        and mine["ooms_after_tuning"] == 0
        and summary["samples_lost"] == 0
    )
    return _common.finish(summary, ok)


if __name__ == "__main__":
    sys.exit(main())
