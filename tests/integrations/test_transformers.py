"""vramctl.integrations.transformers with real tiny Hugging Face models and a real ``Trainer``.

Memory pressure comes from a simulated GPU (``vramctl.simulate``), which raises real
``torch.OutOfMemoryError``s on the CPU; the ``cuda``-marked test does the same on a real GPU.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import vramctl
from vramctl.fit import FitError
from vramctl.integrations.transformers import (
    GuardedTrainer,
    TrainerBatchSize,
    TrainerIntegrationError,
    VramctlCallback,
    fit_trainer_batch_size,
)
from vramctl.monitor import UsageRule

CAPACITY = 64 * 2**20


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and do not fight the other tests for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- models and data ------------------------------------------------------------------


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
    )
    return BertForSequenceClassification(config)


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class Classification(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token ids and a class label per sample."""

    def __init__(self, n: int = 64, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 100, (n, length), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Language(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Right-padded token sequences of different lengths; padding is labelled -100, so
    every batch has its own number of target tokens (``num_items_in_batch``)."""

    def __init__(self, n: int = 48, length: int = 24) -> None:
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 100, (n, length), generator=g)
        self.lengths = torch.randint(4, length + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(self.ids.shape[1]) < self.lengths[i]).long()
        labels = self.ids[i].masked_fill(mask == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": labels}


def arguments(tmp_path: Path, **options: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1,
        "per_device_train_batch_size": 8,
        "max_steps": 6,
        "learning_rate": 1e-3,
        "seed": 0,
    }
    settings.update(options)
    return TrainingArguments(**settings)


def train(
    trainer_cls: type[Trainer],
    model: torch.nn.Module,
    args: TrainingArguments,
    dataset: Any,
    *,
    budget: int | None = None,
    **options: Any,
) -> tuple[Trainer, vramctl.SimulatedDevice]:
    """Train on a simulated GPU; ``budget`` bytes are left free by a co-tenant's tensor."""
    with vramctl.simulate(CAPACITY) as gpu:
        gpu.adopt(model)
        hog = None
        if budget is not None:
            hog = gpu.adopt(torch.empty(CAPACITY - budget, dtype=torch.uint8))
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, **options)
        trainer.train()
        del hog
    return trainer, gpu


def pressure(
    make_model: Any, args: TrainingArguments, dataset: Any, trainer_cls: type[Trainer] = Trainer
) -> tuple[Trainer, int]:
    """The plain Trainer's run, and a budget where its batch runs out of memory but a
    quarter of it does not: halfway between the peaks of the two batch sizes."""
    plain, gpu = train(trainer_cls, make_model(), args, dataset)
    whole = gpu.peak_bytes
    quarter = copy.copy(args)
    quarter.per_device_train_batch_size = args.per_device_train_batch_size // 4
    _, small = train(trainer_cls, make_model(), quarter, dataset)
    assert small.peak_bytes < whole
    return plain, (whole + small.peak_bytes) // 2


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, atol: float) -> None:
    theirs = b.state_dict()
    for name, value in a.state_dict().items():
        torch.testing.assert_close(theirs[name], value, rtol=1e-5, atol=atol, msg=name)


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# -- the guarded training step --------------------------------------------------------------


@pytest.mark.parametrize(
    ("optim", "accumulation", "atol"),
    [("adamw_torch", 1, 1e-6), ("sgd", 2, 1e-7)],
    ids=["adamw", "sgd-accumulate-2"],
)
def test_guarded_trainer_under_pressure_matches_the_plain_trainer(
    tmp_path: Path, optim: str, accumulation: int, atol: float
) -> None:
    args = arguments(tmp_path, optim=optim, gradient_accumulation_steps=accumulation)
    data = Classification()
    plain, budget = pressure(tiny_bert, args, data)

    guarded, _ = train(GuardedTrainer, tiny_bert(), args, data, budget=budget)

    assert isinstance(guarded, GuardedTrainer)
    summary = guarded.guard.summary()
    assert summary["ooms"] >= 1 and summary["ooms_recovered"] == summary["ooms"]
    assert summary["split_steps"] >= 1
    assert guarded.state.global_step == plain.state.global_step == 6
    # BERT takes **kwargs, so the Trainer passes num_items_in_batch, but its loss is a mean
    # over the micro-batch: measured, not taken from the Trainer's flag.
    assert guarded.model_accepts_loss_kwargs
    assert guarded._vramctl_found == {True: "mean"}
    assert_same_weights(plain.model, guarded.model, atol)
    assert losses(guarded) == pytest.approx(losses(plain), rel=1e-5)
    untrained = tiny_bert()
    moved = max(
        (p - q).abs().max().item()
        for p, q in zip(guarded.model.parameters(), untrained.parameters(), strict=True)
    )
    assert moved > 1000 * atol  # the weights did change: the comparison means something


def test_causal_lm_loss_normalized_by_num_items_in_batch(tmp_path: Path) -> None:
    args = arguments(tmp_path, optim="sgd", gradient_accumulation_steps=2, max_steps=4)
    data = Language()
    plain, budget = pressure(tiny_gpt2, args, data)

    guarded, _ = train(GuardedTrainer, tiny_gpt2(), args, data, budget=budget)

    assert isinstance(guarded, GuardedTrainer)
    assert guarded.guard.ooms >= 1 and guarded.guard.split_steps >= 1
    # Each piece's loss is its share of the accumulated batch's token sum: they add up.
    assert guarded._vramctl_found == {True: "sum"}
    assert_same_weights(plain.model, guarded.model, 1e-7)
    assert losses(guarded) == pytest.approx(losses(plain), rel=1e-5)


class MeanLoss(Trainer):
    """A Trainer that passes no ``num_items_in_batch``: the causal LM loss is then a mean
    over each micro-batch's tokens (as with a model that takes no loss kwargs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = False


class GuardedMeanLoss(GuardedTrainer, MeanLoss):
    pass


@pytest.mark.parametrize(
    "weight_fn",
    [None, lambda b: (b["labels"][:, 1:] != -100).sum()],  # the targets: labels shifted
    ids=["items-the-trainer-counts", "weight_fn"],
)
def test_token_mean_loss_weighted_by_tokens(tmp_path: Path, weight_fn: Any) -> None:
    args = arguments(tmp_path, optim="sgd", gradient_accumulation_steps=2, max_steps=4)
    data = Language()
    plain, budget = pressure(tiny_gpt2, args, data, MeanLoss)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reduction is measured, no warning
        guarded, _ = train(
            GuardedMeanLoss, tiny_gpt2(), args, data, budget=budget, weight_fn=weight_fn
        )

    assert isinstance(guarded, GuardedTrainer)
    assert guarded.guard.split_steps >= 1
    assert guarded._vramctl_found == {False: "mean"}
    assert_same_weights(plain.model, guarded.model, 1e-7)


def test_pieces_grow_back_to_whole_batches_when_memory_comes_back(tmp_path: Path) -> None:
    args = arguments(tmp_path, optim="sgd", max_steps=8)
    data = Classification()
    plain, budget = pressure(tiny_bert, args, data)
    held: list[torch.Tensor] = []

    class CoTenantLeaves(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 3:
                held.clear()

    with vramctl.simulate(CAPACITY) as gpu:
        model = gpu.adopt(tiny_bert())
        held.append(gpu.adopt(torch.empty(CAPACITY - budget, dtype=torch.uint8)))
        trainer = GuardedTrainer(
            model=model, args=args, train_dataset=data, callbacks=[CoTenantLeaves()], patience=2
        )
        trainer.train()

    kinds = [e.kind for e in trainer.guard.events]
    assert "oom" in kinds and "grow" in kinds
    assert trainer.guard.piece_limit is None  # whole batches again
    assert_same_weights(plain.model, trainer.model, 1e-7)


def test_an_error_that_is_not_an_oom_goes_through_unchanged(tmp_path: Path) -> None:
    class Broken(GuardedTrainer):
        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            raise KeyError("no such column")

    trainer = Broken(model=tiny_bert(), args=arguments(tmp_path), train_dataset=Classification())
    with pytest.raises(KeyError, match="no such column"):
        trainer.train()
    assert trainer.guard.ooms == 0
    assert all(p.grad is None for p in trainer.model.parameters())


# -- the callback ----------------------------------------------------------------------------


class Recorder(TrainerCallback):
    """What the callbacks after vramctl's see in ``logs`` (as a reporting integration would)."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append(dict(logs or {}))


def test_readings_reach_the_log_history_and_the_callbacks_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = VramctlCallback(interval=0.05, rules=[UsageRule(0.5, 0.99, for_s=0)])
    recorder = Recorder()
    caplog.set_level(logging.WARNING, logger="vramctl.monitor")
    with vramctl.simulate(CAPACITY) as gpu:
        model = gpu.adopt(tiny_bert())
        hog = gpu.adopt(torch.empty(CAPACITY * 6 // 10, dtype=torch.uint8))  # 60% in use
        trainer = Trainer(
            model=model,
            args=arguments(tmp_path, max_steps=3),
            train_dataset=Classification(),
            callbacks=[callback, recorder],
        )
        trainer.train()
        del hog

    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    for entry in logged:
        assert 0.06 * CAPACITY / 2**30 < entry["vramctl/used_gib"] <= CAPACITY / 2**30
        assert entry["vramctl/peak_gib"] >= entry["vramctl/used_gib"]
        assert "vramctl/ooms" not in entry  # a plain Trainer has no guard
    assert all("vramctl/used_gib" in logs for logs in recorder.logs)
    assert callback.device is not None and callback.device.id == gpu.id
    assert callback.monitor is not None and not callback.monitor.running
    assert [a.rule for a in callback.alerts] == ["memory"]  # 60% is over the 50% warning
    assert caplog.text.count("[warning] sim:64MiB memory: 6") == 1  # logged once


def test_attach_runs_the_callback_before_the_reporting_integrations(tmp_path: Path) -> None:
    plain = Trainer(model=tiny_bert(), args=arguments(tmp_path), train_dataset=Classification())
    callback = VramctlCallback().attach(plain)
    names = [type(c).__name__ for c in plain.callback_handler.callbacks]
    assert names[:2] == ["DefaultFlowCallback", "VramctlCallback"]
    assert callback.guard is None

    first = VramctlCallback()
    guarded = GuardedTrainer(
        model=tiny_bert(), args=arguments(tmp_path), train_dataset=Classification(),
        callbacks=[Recorder(), first],
    )  # fmt: skip
    callbacks = guarded.callback_handler.callbacks
    assert callbacks[1] is first and first.guard is guarded.guard
    guarded.train()
    assert all(h["vramctl/ooms"] == 0 for h in guarded.state.log_history if "loss" in h)


def test_a_leak_in_a_step_is_reported_and_can_stop_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kept: list[torch.Tensor] = []

    class Leaky(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            kept.append(torch.randn(256, 1024))  # 1 MiB kept every step

    callback = VramctlCallback(rules=[], stop_on_leak=True)
    caplog.set_level(logging.WARNING, logger="vramctl.integrations.transformers")
    trainer = Trainer(
        model=tiny_bert(),
        args=arguments(tmp_path, max_steps=80, logging_steps=100, per_device_train_batch_size=2),
        train_dataset=Classification(),
        callbacks=[Leaky(), callback],
    )
    trainer.train()

    assert len(callback.leaks) == 1
    report = callback.leaks[0]
    assert report.rate_bytes_per_step >= 2**19
    assert trainer.state.global_step < 80  # stopped at the leak
    assert "memory leak on cpu" in caplog.text
    assert "stop_on_leak" in caplog.text


# -- the fitted batch size ---------------------------------------------------------------------


def test_fit_then_twenty_trainer_steps_fit(tmp_path: Path) -> None:
    data = Classification(n=256, length=32)
    args = arguments(
        tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=2, max_steps=20,
        logging_steps=100, optim="adamw_torch",
    )  # fmt: skip
    with vramctl.simulate("1536KiB") as gpu:
        model = gpu.adopt(tiny_bert())
        fitted = fit_trainer_batch_size(model, args, data, cache_dir=tmp_path / "cache")
        again = fit_trainer_batch_size(model, args, data, cache_dir=tmp_path / "cache")
        ooms = gpu.ooms
        fitted.apply(args)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        assert gpu.ooms == ooms  # not one out-of-memory error in 20 steps

    assert isinstance(fitted, TrainerBatchSize)
    assert fitted.effective_batch == 32
    assert fitted.per_device_train_batch_size * fitted.gradient_accumulation_steps == 32
    assert 1 <= fitted.per_device_train_batch_size <= fitted.fit.batch_size < 32
    assert 1 <= len(fitted.fit.probes) <= 3
    assert fitted.fit.device == gpu.id
    assert again.fit.source == "cache" and again.fit.probes == []
    assert again.per_device_train_batch_size == fitted.per_device_train_batch_size
    assert trainer.state.global_step == 20
    assert args.per_device_train_batch_size == fitted.per_device_train_batch_size
    assert args.gradient_accumulation_steps == fitted.gradient_accumulation_steps


def test_a_peft_model_is_fitted_larger_and_trains_without_an_oom(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    data = Classification(n=256, length=32)
    args = arguments(
        tmp_path, per_device_train_batch_size=64, gradient_accumulation_steps=1, max_steps=10,
        logging_steps=100, optim="adamw_torch",
    )  # fmt: skip
    with vramctl.simulate("1536KiB") as gpu:
        full = fit_trainer_batch_size(gpu.adopt(tiny_bert()), args, data, cache=False)
        gc.collect()
        lora = peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"])
        model = gpu.adopt(peft.get_peft_model(tiny_bert(), lora))
        fitted = fit_trainer_batch_size(model, args, data, cache=False)
        ooms = gpu.ooms
        fitted.apply(args)
        Trainer(model=model, args=args, train_dataset=data).train()
        assert gpu.ooms == ooms  # the fitted batch trains
    assert fitted.fit.predicted is not None  # the search was seeded by the estimate
    assert fitted.fit.batch_size > full.fit.batch_size  # no gradients nor state for the base


def test_a_qlora_model_is_fitted_and_trains_without_an_oom(tmp_path: Path) -> None:
    """A PEFT model over bitsandbytes' 4-bit layers, as QLoRA trains it."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    try:
        from estimate_finetune import quantize  # the benchmark's real QLoRA rows do the same
    finally:
        sys.path.pop(0)
    data = Classification(n=256, length=32)
    args = arguments(
        tmp_path, per_device_train_batch_size=64, gradient_accumulation_steps=1, max_steps=6,
        logging_steps=100, optim="adamw_torch", bf16=True,
    )  # fmt: skip
    base = tiny_bert().to(torch.bfloat16)
    quantize(base, "nf4", True)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base, lora)
    with vramctl.simulate("1536KiB") as gpu:
        gpu.adopt(model)
        fitted = fit_trainer_batch_size(model, args, data, cache=False)
        ooms = gpu.ooms
        fitted.apply(args)
        Trainer(model=model, args=args, train_dataset=data).train()
        assert gpu.ooms == ooms  # the fitted batch trains
    assert fitted.fit.predicted is not None  # the search was seeded by the estimate
    assert 1 <= len(fitted.fit.probes) <= 3


def test_the_whole_effective_batch_when_it_fits(tmp_path: Path) -> None:
    args = arguments(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    with vramctl.simulate("64MiB") as gpu:
        model = gpu.adopt(tiny_bert())
        fitted = fit_trainer_batch_size(
            model, args, Classification(), effective_batch=12, cache=False
        )
    assert (fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps) == (12, 1)
    assert fitted.fit.batch_size == 12  # max: never above the effective batch


def test_apply_turns_auto_find_batch_size_off(tmp_path: Path) -> None:
    fit = vramctl.FitResult(batch_size=20, peak_used=1, budget=2, predicted=None)
    args = arguments(tmp_path, auto_find_batch_size=True)
    assert TrainerBatchSize(16, 4, 64, fit).apply(args) is args
    assert args.per_device_train_batch_size == 16 and args.gradient_accumulation_steps == 4
    assert args.auto_find_batch_size is False
    with pytest.raises(TrainerIntegrationError, match="TrainingArguments"):
        TrainerBatchSize(16, 4, 64, fit).apply({"per_device_train_batch_size": 1})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "bert"}, "model must be a torch.nn.Module"),
        ({"args": {"per_device_train_batch_size": 8}}, "TrainingArguments"),
        ({"train_dataset": None}, "train_dataset is None"),
        ({"train_dataset": []}, "train_dataset is empty"),
        ({"data_collator": 3}, "data_collator must be callable"),
        ({"effective_batch": 0}, "effective_batch must be a positive integer"),
        ({"effective_batch": True}, "effective_batch must be a positive integer"),
        ({"target": 1.5}, "target must be in"),
    ],
)
def test_bad_input_to_the_fit(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    call: dict[str, Any] = {
        "model": tiny_bert(),
        "args": arguments(tmp_path),
        "train_dataset": Classification(n=4),
        "cache": False,
    }
    call.update(change)
    with vramctl.simulate("64MiB"), pytest.raises(FitError, match=message):
        fit_trainer_batch_size(**call)


def test_a_dataset_without_labels_says_so(tmp_path: Path) -> None:
    unlabelled = [{"input_ids": torch.randint(0, 100, (8,))} for _ in range(4)]
    with vramctl.simulate("64MiB"), pytest.raises(FitError, match="need labels"):
        fit_trainer_batch_size(tiny_bert(), arguments(tmp_path), unlabelled, cache=False)


def test_unsupported_setups_and_options_are_clear_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = Classification(n=4)
    with pytest.raises(TrainerIntegrationError, match="loss_reduction must be"):
        GuardedTrainer(
            model=tiny_bert(), args=arguments(tmp_path), train_dataset=data, loss_reduction="max"
        )
    args = arguments(tmp_path)
    args.deepspeed = {"zero_optimization": {"stage": 2}}
    with pytest.raises(TrainerIntegrationError, match="not supported with DeepSpeed"):
        GuardedTrainer(model=tiny_bert(), args=args, train_dataset=data)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(TrainerIntegrationError, match=r"2 processes \(args.world_size\)"):
        GuardedTrainer(model=tiny_bert(), args=arguments(tmp_path), train_dataset=data)
    with pytest.raises(TrainerIntegrationError, match="interval"):
        VramctlCallback(interval=0)
    with pytest.raises(TrainerIntegrationError, match="needs a transformers Trainer"):
        VramctlCallback().attach(object())


# -- a real GPU ----------------------------------------------------------------------------


@contextlib.contextmanager
def capped(budget: int) -> Iterator[None]:
    """The CUDA allocator refuses what would take this process's reserved memory past
    ``budget`` bytes (``set_per_process_memory_fraction``)."""
    gc.collect()
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(0)
    torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        gc.collect()
        torch.cuda.empty_cache()


def gpu_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        vocab_size=1000, max_position_embeddings=512, hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
    )  # fmt: skip
    return BertForSequenceClassification(config)


@pytest.mark.cuda
def test_guarded_trainer_on_a_real_gpu(tmp_path: Path) -> None:
    if torch.cuda.device_count() > 1:
        pytest.skip("with several GPUs visible the Trainer uses DataParallel: run on one")
    data = Classification(n=256, length=512)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to=[], save_strategy="no", disable_tqdm=True,
        logging_steps=1, per_device_train_batch_size=64, max_steps=4, learning_rate=1e-3,
        optim="sgd", seed=0,
    )  # fmt: skip
    plain = Trainer(model=gpu_bert(), args=args, train_dataset=data)
    torch.cuda.reset_peak_memory_stats(0)
    plain.train()
    whole = torch.cuda.max_memory_reserved(0)
    plain_model = plain.model.cpu()
    del plain
    gc.collect()
    torch.cuda.empty_cache()

    with capped(int(whole * 0.6)):
        guarded = GuardedTrainer(model=gpu_bert(), args=args, train_dataset=data)
        assert guarded.guard.device.id == "cuda:0"
        guarded.train()

    assert guarded.guard.ooms >= 1 and guarded.guard.split_steps >= 1
    assert guarded.state.global_step == 4
    # cuBLAS picks kernels by shape, so pieces and whole batches round differently.
    theirs = guarded.model.cpu().state_dict()
    for name, value in plain_model.state_dict().items():
        torch.testing.assert_close(theirs[name], value, rtol=1e-4, atol=1e-6, msg=name)
