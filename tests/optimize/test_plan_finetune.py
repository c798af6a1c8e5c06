"""vramctl.plan's fine-tuning axis (full, LoRA, QLoRA) and its traced 8-bit AdamW: priced on
fake tensors, applied for real with PEFT and bitsandbytes on the CPU."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import vramctl
from vramctl.cli._app import app
from vramctl.optimize import OptimizeError, plan

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.estimator.small_llama import CONFIG, QV, llama  # noqa: E402

BENCH = Path(__file__).parents[2] / "benchmarks"


def make_batch(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (n, 64), generator=torch.Generator().manual_seed(n))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def tight() -> Any:
    """A device on which no full fine-tuning plan of the small Llama fits at a micro-batch of
    1 (checkpointed, in the least memory), and LoRA does."""
    least_full = vramctl.estimate(
        llama(), make_batch(1), device="cpu", precision="amp-bf16", checkpointing=True
    )
    lora = vramctl.estimate(llama(), make_batch(1), device="cpu", precision="bf16", adapter=QV)
    assert lora.peak_allocated < 0.5 * least_full.peak_allocated
    return vramctl.simulate(int(0.6 * least_full.peak_allocated / 0.9))


@pytest.fixture(scope="module")
def priced(tight: Any) -> Any:
    return plan(
        llama(),
        make_batch,
        device=tight,
        effective_batch=4,
        adapter=QV,
        checkpointing=["none", "full"],
        offload=["none", "activations"],
        optimizers=["adamw"],
    )


def test_lora_and_qlora_fit_where_full_fine_tuning_does_not(priced: Any) -> None:
    by = {t: [p for p in priced.plans if p.finetune == t] for t in ("full", "lora", "qlora")}
    assert all(by.values()), {t: len(v) for t, v in by.items()}
    assert not any(p.fits for p in by["full"])
    assert all("fit" in p.rejected for p in by["full"])
    assert priced.best is not None and priced.best.finetune in ("lora", "qlora")
    # an adapter's plans run on a 16-bit base, and its optimizer state is not offloaded
    assert {p.precision for p in by["lora"] + by["qlora"]} == {"bf16"}
    assert {p.offload for p in by["lora"] + by["qlora"]} <= {"none", "activations"}
    # each was traced with its adapter and quantization
    qlora = next(p for p in by["qlora"] if p.estimate is not None)
    assert qlora.estimate.adapter is not None and qlora.estimate.quant is not None
    assert qlora.estimate.quant.startswith("nf4") and "double" in qlora.estimate.quant
    lora = next(p for p in by["lora"] if p.estimate is not None and p.fits)
    assert lora.estimate.quant is None
    # 4-bit weights leave more room: QLoRA's largest micro-batch is no smaller
    best_micro = {t: max((p.micro_batch for p in by[t] if p.fits), default=0) for t in by}
    assert best_micro["qlora"] >= best_micro["lora"] >= 1
    assert "lora" in priced.best.label
    doc = json.loads(json.dumps(priced.to_dict()))
    assert {p["finetune"] for p in doc["plans"]} == {"full", "lora", "qlora"}
    assert any(n.startswith("QLoRA's weights: nf4") for n in priced.notes)


def test_a_lora_plan_applied_runs_real_steps_within_its_device(priced: Any, tight: Any) -> None:
    chosen = next(p for p in priced.plans if p.finetune == "lora" and p.fits)
    model = llama()
    names = {n for n, _ in model.named_parameters()}
    with tight:
        model = tight.adopt(model)
        user_opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
        applied = chosen.apply(model, user_opt, device=tight)
        try:
            assert isinstance(applied.model, peft.PeftModel)
            trainable = [p for p in applied.model.parameters() if p.requires_grad]
            assert trainable and all(p.dtype == torch.float32 for p in trainable)
            opt = applied.step.optimizer
            assert opt is not user_opt
            assert [p for g in opt.param_groups for p in g["params"]] == trainable
            assert opt.param_groups[0]["lr"] == 3e-4
            before = [p.detach().clone() for p in trainable]
            for _ in range(chosen.accumulation):
                with applied.step.autocast():
                    loss = applied.model(**make_batch(chosen.micro_batch)).loss
                applied.step.backward(loss / chosen.accumulation)
            applied.step.step()
            assert any(not torch.equal(a, b) for a, b in zip(before, trainable, strict=True))
        finally:
            applied.undo()
    # the adapter is taken off again: the model's own parameters, by their own names
    assert {n for n, _ in model.named_parameters()} == names


def test_a_qlora_plan_needs_a_4bit_model_and_trains_one() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    result = plan(
        llama(),
        make_batch,
        device="cpu",
        effective_batch=2,
        finetune=["qlora"],
        adapter=QV,
        checkpointing=["none"],
        optimizers=["adamw"],
    )
    best = result.best
    assert best is not None and best.finetune == "qlora" and best.micro_batch == 2
    with pytest.raises(OptimizeError, match="BitsAndBytesConfig"):
        best.apply(llama(), device="cpu")
    sys.path.insert(0, str(BENCH))
    try:
        from estimate_finetune import quantize  # the benchmark's real QLoRA rows do the same
    finally:
        sys.path.remove(str(BENCH))
    model = llama().to(torch.bfloat16)
    quantize(model, "nf4", True)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        applied = best.apply(model, device="cpu")
    try:
        trainable = [p for p in applied.model.parameters() if p.requires_grad]
        assert trainable and all(p.dtype == torch.float32 for p in trainable)
        before = [p.detach().clone() for p in trainable]
        loss = applied.model(**make_batch(2)).loss
        applied.step.backward(loss)
        applied.step.step()
        assert any(not torch.equal(a, b) for a, b in zip(before, trainable, strict=True))
    finally:
        applied.undo()


def test_eight_bit_adamw_is_traced_not_derived() -> None:
    pytest.importorskip("bitsandbytes")
    result = plan(
        llama(),
        make_batch,
        device="cpu",
        effective_batch=2,
        precisions=["fp32"],
        checkpointing=["none"],
        optimizers=["adamw", "adamw-8bit"],
    )
    eight = next(p for p in result.plans if p.optimizer == "adamw-8bit")
    plain = next(p for p in result.plans if p.optimizer == "adamw" and p.micro_batch == 2)
    assert eight.priced == "traced"
    assert eight.peak_bytes < plain.peak_bytes
    direct = vramctl.estimate(llama(), make_batch(2), device="cpu", optimizer="adamw-8bit")
    assert eight.peak_bytes == direct.judged_peak


def test_the_fine_tuning_axis_refuses_what_it_cannot_price(monkeypatch: pytest.MonkeyPatch) -> None:
    kw: dict[str, Any] = {"device": "cpu", "effective_batch": 2}
    with pytest.raises(OptimizeError, match="finetune must be among"):
        plan(llama(), make_batch, finetune=["partial"], **kw)
    with pytest.raises(OptimizeError, match="for training"):
        plan(llama(), make_batch, mode="infer", adapter=QV, **kw)
    with pytest.raises(OptimizeError, match="'lora' and 'qlora'"):
        plan(llama(), make_batch, finetune=["full"], adapter=QV, **kw)
    with pytest.raises(OptimizeError, match="unknown format"):
        plan(llama(), make_batch, finetune=["qlora"], quant="nf3", **kw)
    from vramctl.optimize import _plan

    real = _plan.importlib.util.find_spec
    monkeypatch.setattr(
        _plan.importlib.util, "find_spec", lambda n, *a: None if n == "peft" else real(n, *a)
    )
    with pytest.raises(OptimizeError, match=r"vramctl\[finetune\]"):
        plan(llama(), make_batch, finetune=["lora"], **kw)


def test_the_command_line_prices_the_fine_tuning_axis(tmp_path: Path) -> None:
    CONFIG.to_json_file(tmp_path / "config.json")
    args = [
        "plan", str(tmp_path), "--device", "cpu", "--effective-batch", "2", "--seq-len", "32",
        "--lora", "r=8,targets=q_proj,v_proj", "--finetune", "lora,qlora", "--quant", "nf4",
        "--checkpointing", "none", "--optimizer", "adamw",
    ]  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert {p["finetune"] for p in doc["plans"]} == {"lora", "qlora"}
    assert doc["best"]["fits"] is True
    summary = CliRunner().invoke(app, args)
    assert summary.exit_code == 0, summary.output
    # the best plan, and the fastest plan of the other way to fine-tune against it
    other = "qlora" if doc["best"]["finetune"] == "lora" else "lora"
    assert "best: " in summary.output and f"tuning {other}: " in summary.output
    assert max(len(line) for line in summary.output.splitlines()) <= 80
    table = CliRunner().invoke(app, [*args, "--all"])
    assert table.exit_code == 0, table.output
    assert "tuning" in table.output and "qlora" in table.output
    # the settings every plan shares are said once, and the table keeps to 80 columns
    assert "every plan: " in table.output and "optimizer adamw" in table.output
    assert max(len(line) for line in table.output.splitlines()) <= 80
    bad = CliRunner().invoke(app, [*args[:4], "--double-quant"])
    assert bad.exit_code != 0 and "--double-quant goes with --quant" in bad.output
