"""The Lightning callbacks with a real Lightning Trainer on CPU, simulated GPUs for the OOMs
and gloo DDP (spawned ranks) for the agreement on a batch size."""

from __future__ import annotations

import csv
import logging
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import vramctl

pytest.importorskip("lightning")

from lightning.pytorch.loggers import CSVLogger

from tests.integrations.lightning_models import Lit, Recorder, rank_device, trainer
from vramctl.integrations.lightning import (
    LightningIntegrationError,
    VramctlBatchSize,
    VramctlGuard,
    VramctlMonitor,
)

MiB = 2**20


def _fits(batch: int, capacity: int, steps: int = 3) -> bool:
    """Whether ``steps`` real steps of a fresh module at ``batch`` run on a simulated GPU."""
    from tests.integrations.lightning_models import Tokens

    torch.manual_seed(0)
    lit = Lit()
    data = Tokens()
    opt = torch.optim.AdamW(lit.parameters(), lr=1e-3)
    with vramctl.simulate(capacity) as gpu:
        gpu.adopt(lit)
        try:
            for _ in range(steps):
                x = torch.stack([data[i][0] for i in range(batch)])
                y = torch.stack([data[i][1] for i in range(batch)])
                torch.nn.functional.cross_entropy(lit.net(x).mean(1), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            return False
    return True


def test_batch_size_is_set_on_the_module_and_trains_without_oom(tmp_path: Path) -> None:
    capacity = 96 * MiB
    lit = Lit(batch_size=8)
    cb = VramctlBatchSize(cache=False)
    with vramctl.simulate(capacity) as gpu:
        gpu.adopt(lit)
        trainer(tmp_path, max_steps=6, callbacks=[cb]).fit(lit)
    assert cb.result is not None and cb.batch_size == lit.batch_size == cb.result.batch_size
    assert len(cb.result.probes) <= 3
    # Lightning trained with the new size: every batch after the probes had it.
    assert lit.seen[-6:] == [lit.batch_size] * 6
    # Within the budget, close to the largest size that fits 0.9 of the device.
    budget = int(0.9 * capacity)
    assert _fits(lit.batch_size, budget)
    assert not _fits(int(lit.batch_size * 1.05) + 1, budget)


def test_batch_size_on_the_datamodule_and_a_simulated_gpu_by_name(tmp_path: Path) -> None:
    import lightning as L

    class Data(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 4

        def train_dataloader(self) -> torch.utils.data.DataLoader[object]:
            from tests.integrations.lightning_models import Tokens

            return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size)

    class NoSize(Lit):
        def __init__(self) -> None:
            super().__init__()
            del self.batch_size

    data, lit = Data(), NoSize()
    cb = VramctlBatchSize(cache=False, device="sim:64MiB")
    trainer(tmp_path, max_steps=2, callbacks=[cb]).fit(lit, datamodule=data)
    assert cb.result is not None and cb.result.device == "sim:64MiB"
    assert data.batch_size == cb.batch_size > 4
    assert lit.seen[-1] == data.batch_size


def test_batch_size_needs_an_attribute(tmp_path: Path) -> None:
    class NoSize(Lit):
        def __init__(self) -> None:
            super().__init__()
            del self.batch_size

        def train_dataloader(self) -> torch.utils.data.DataLoader[object]:
            from tests.integrations.lightning_models import Tokens

            return torch.utils.data.DataLoader(Tokens(), batch_size=4)

    with pytest.raises(LightningIntegrationError, match="batch_arg_name"):
        trainer(tmp_path, callbacks=[VramctlBatchSize(cache=False)]).fit(NoSize())
    with pytest.raises(LightningIntegrationError, match="agree"):
        VramctlBatchSize(agree="max")


def _weights(
    hog: int, accumulate: int, guard: VramctlGuard | None, root: Path
) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    lit = Lit(batch_size=256, hog=hog)
    with vramctl.simulate(64 * MiB) as gpu:
        gpu.adopt(lit)
        t = trainer(
            root,
            accumulate_grad_batches=accumulate,
            callbacks=[guard] if guard is not None else [],
        )
        t.fit(lit)
    return {k: v.detach().clone() for k, v in lit.state_dict().items()}


@pytest.mark.parametrize(
    ("hog_mib", "accumulate"),
    [(36, 1), (36, 2), (14, 1), (14, 2)],
    ids=["forward-oom", "forward-oom-accumulate", "backward-oom", "backward-oom-accumulate"],
)
def test_guard_finishes_the_step_in_pieces_with_the_same_weights(
    tmp_path: Path, hog_mib: int, accumulate: int
) -> None:
    reference = _weights(0, accumulate, None, tmp_path)
    with pytest.raises(torch.OutOfMemoryError):  # without the guard, the co-tenant kills it
        _weights(hog_mib * MiB, accumulate, None, tmp_path)
    guard = VramctlGuard()
    got = _weights(hog_mib * MiB, accumulate, guard, tmp_path)
    assert guard.guard is not None
    summary = guard.guard.summary()
    assert summary["ooms"] >= 1 and summary["ooms_recovered"] == summary["ooms"]
    assert summary["split_steps"] == 4 * accumulate
    # The same update up to summation order (elementwise, Adam's division by the root of
    # the second moment magnifies rounding in tiny entries: compare each tensor's L2 norm).
    for name, ref in reference.items():
        assert (got[name] - ref).norm() <= 1e-5 * ref.norm(), name


def test_guard_recovers_from_an_oom_in_lightnings_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 14 MiB of co-tenant: the forward of 256 samples fits, its backward does not; the first
    # step's pieces are run from the watched backward, the later ones before it.
    callers: list[str] = []
    pieces = VramctlGuard._pieces

    def spy(self: VramctlGuard, *args: object, **kwargs: object) -> torch.Tensor:
        callers.append(traceback.extract_stack()[-2].name)
        return pieces(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(VramctlGuard, "_pieces", spy)
    guard = VramctlGuard()
    _weights(14 * MiB, 1, guard, tmp_path)
    assert callers == ["_guarded_backward"] + ["_split_before_backward"] * 3
    # 36 MiB: the forward itself does not fit; every step's pieces run before the backward.
    callers.clear()
    _weights(36 * MiB, 1, VramctlGuard(), tmp_path)
    assert callers == ["_split_before_backward"] * 4


class _Logs(Lit):
    """Logs a mean (on the step, and on the step and epoch through log_dict), a sum and a
    max in every training step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.append(x.shape[0])
        logits = self.net(x).mean(1)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        self.log("samples", float(x.shape[0]), reduce_fx="sum")
        self.log("top_logit", logits.max(), reduce_fx="max")
        self.log_dict({"acc": (logits.argmax(1) == y).float().mean()}, on_epoch=True)
        return loss


def _logged(
    hog: int, guard: VramctlGuard | None, root: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[tuple[int, str], list[float]], dict[str, float]]:
    """Each ``self.log`` call Lightning got, by (step, name); and its callback metrics."""
    import lightning as L

    calls: dict[tuple[int, str], list[float]] = {}
    real = L.LightningModule.log

    def spy(self: L.LightningModule, name: str, value: Any, *args: Any, **kw: Any) -> None:
        seen = value.detach() if isinstance(value, torch.Tensor) else value
        calls.setdefault((self.trainer.global_step, name), []).append(float(seen))
        real(self, name, value, *args, **kw)

    monkeypatch.setattr(L.LightningModule, "log", spy)
    torch.manual_seed(0)
    lit = _Logs(batch_size=256, hog=hog)
    with vramctl.simulate(64 * MiB) as gpu:
        gpu.adopt(lit)
        t = trainer(root, callbacks=[guard] if guard is not None else [])
        t.fit(lit)
    monkeypatch.setattr(L.LightningModule, "log", real)
    return calls, {k: float(v) for k, v in t.callback_metrics.items()}


@pytest.mark.parametrize("hog_mib", [36, 14], ids=["forward-oom", "backward-oom"])
def test_a_split_step_logs_each_name_once_with_the_whole_batchs_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hog_mib: int
) -> None:
    reference, ref_metrics = _logged(0, None, tmp_path, monkeypatch)
    guard = VramctlGuard()
    got, metrics = _logged(hog_mib * MiB, guard, tmp_path, monkeypatch)
    assert guard.guard is not None and guard.guard.summary()["split_steps"] == 4
    assert guard.guard.piece_limit is not None and guard.guard.piece_limit < 256
    names = ["train_loss", "samples", "top_logit", "acc"]
    assert sorted(got) == sorted(reference) == sorted((s, n) for s in range(4) for n in names)
    for key, values in got.items():
        assert len(values) == 1, key  # once per step, not once per piece
        (want,) = reference[key]
        # The whole batch's value, up to summation order (the weights are the same too).
        assert abs(values[0] - want) <= 1e-5 * max(1.0, abs(want)) + 1e-6, key
    assert {k: v for k, v in metrics.items() if k in names} == pytest.approx(
        {k: v for k, v in ref_metrics.items() if k in names}, rel=1e-5
    )
    assert metrics["samples"] == 256.0
    # The epoch's mean of acc, over four steps of 256 samples each.
    assert metrics["acc_epoch"] == pytest.approx(ref_metrics["acc_epoch"], rel=1e-5)


def test_guard_rejects_manual_optimization(tmp_path: Path) -> None:
    class Manual(Lit):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(LightningIntegrationError, match="manual optimization"):
        trainer(tmp_path, callbacks=[VramctlGuard()]).fit(Manual())


def test_guard_is_removed_after_training(tmp_path: Path) -> None:
    lit = Lit(batch_size=16)
    trainer(tmp_path, max_steps=2, callbacks=[VramctlGuard()]).fit(lit)
    assert "training_step" not in vars(lit) and "backward" not in vars(lit)


def test_monitor_logs_memory_through_the_loggers(tmp_path: Path) -> None:
    lit = Lit(batch_size=32)
    mon = VramctlMonitor(interval=0.05, log_every_n_steps=2)
    with vramctl.simulate(128 * MiB) as gpu:
        gpu.adopt(lit)
        t = trainer(
            tmp_path,
            max_steps=6,
            logger=CSVLogger(str(tmp_path), name="run"),
            callbacks=[mon, VramctlGuard()],
        )
        t.fit(lit)
    assert mon.monitor is not None and not mon.monitor.running
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").open()))
    used = [float(r["vramctl/used_bytes"]) for r in rows if r.get("vramctl/used_bytes")]
    assert len(used) >= 3
    # The simulated GPU held at least the weights while training.
    weights = sum(p.numel() * p.element_size() for p in lit.parameters())
    assert max(used) >= weights
    assert all(
        float(r["vramctl/total_bytes"]) == 128 * MiB for r in rows if r.get("vramctl/total_bytes")
    )
    assert any(r.get("vramctl/ooms") for r in rows)


def test_monitor_finds_a_leak_and_can_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lit = Lit(batch_size=4, leak=2 * MiB)
    mon = VramctlMonitor(interval=1.0, stop_on_leak=True)
    with caplog.at_level(logging.WARNING, logger="vramctl.integrations"):
        trainer(tmp_path, max_steps=200, callbacks=[mon]).fit(lit)
    assert mon.leaks_found, "2 MiB kept per step was not reported"
    assert len(lit.seen) < 200  # stopped at the first leak
    assert any("leak" in r.getMessage() for r in caplog.records)


def test_monitor_is_quiet_without_a_leak(tmp_path: Path) -> None:
    lit = Lit(batch_size=4)
    mon = VramctlMonitor(interval=1.0, stop_on_leak=True)
    trainer(tmp_path, max_steps=80, callbacks=[mon]).fit(lit)
    assert mon.leaks_found == [] and len(lit.seen) == 80


@pytest.mark.slow
def test_batch_size_under_ddp_every_rank_takes_the_smallest(tmp_path: Path) -> None:
    lit = Lit(batch_size=8)
    cb = VramctlBatchSize(cache=False, device=rank_device)
    t = trainer(
        tmp_path,
        devices=2,
        strategy="ddp_spawn",
        max_steps=2,
        callbacks=[cb, Recorder(str(tmp_path))],
    )
    t.fit(lit)
    sizes = [int((tmp_path / f"rank{r}.txt").read_text()) for r in (0, 1)]
    assert sizes[0] == sizes[1]
    # The 64 MiB rank decides: its answer fits 0.9 of 64 MiB, and is below the 96 MiB one's.
    assert _fits(sizes[0], int(0.9 * 64 * MiB))
    assert not _fits(int(sizes[0] * 1.3), int(0.9 * 64 * MiB))


@pytest.mark.cuda
def test_guard_on_a_real_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    lit = Lit(batch_size=256)
    guard = VramctlGuard(piece_limit=64)
    trainer(tmp_path, accelerator="gpu", devices=1, callbacks=[guard]).fit(lit)
    assert guard.guard is not None and guard.guard.summary()["split_steps"] == 4
