"""Models named by their Hugging Face config: a folder, the JSON file, a config object, a Hub id.

The configs under ``configs/`` ship with the tests; nothing here reaches the network (the
Hub-id tests run with ``HF_HUB_OFFLINE=1`` and an empty cache).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import vramctl
from vramctl.estimator import EstimateError, StepSpec, config_model

from .real_steps import cpu_step_peak

pytest.importorskip("transformers")

CONFIGS = Path(__file__).parent / "configs"


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network and an empty cache (huggingface_hub reads both when it is imported)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _real_peak(source: Any, mode: str, precision: str = "fp32", **lengths: Any) -> int:
    """The real CPU peak of the step the estimate describes, with the same batch."""
    cm = config_model(source)
    torch.manual_seed(0)
    model = cm.build()
    spec = StepSpec(mode=mode, precision=precision)
    if spec.param_dtype is not None:
        model.to(spec.param_dtype)
    batch = cm.make_batch(2, labels=mode == "train", **lengths)
    for k, v in batch.items():
        if v.is_floating_point():
            batch[k] = v.normal_().to(spec.param_dtype or v.dtype)
    return cpu_step_peak(model, batch, spec)


@pytest.mark.parametrize("where", ["tiny-llama", "tiny-llama/config.json"])
def test_a_folder_or_its_config_json_names_the_model(where: str) -> None:
    est = vramctl.estimate(str(CONFIGS / where), batch_size=2, seq_len=16, device="cpu")
    assert est.parameters == config_model(str(CONFIGS / "tiny-llama")).build().num_parameters()
    assert est.seq_len == 16
    assert any("LlamaForCausalLM (causal-lm)" in n for n in est.notes)


def test_a_json_file_of_another_name_and_a_config_object_work_too() -> None:
    from transformers import ViTConfig

    est = vramctl.estimate(str(CONFIGS / "tiny-vit.json"), batch_size=2, device="cpu")
    data = json.loads((CONFIGS / "tiny-vit.json").read_text())
    data.pop("model_type")
    same = vramctl.estimate(ViTConfig(**data), batch_size=2, device="cpu")
    assert est.logical_peak == same.logical_peak
    assert any("ViTForImageClassification" in n for n in est.notes)


@pytest.mark.parametrize(
    ("where", "lengths"),
    [
        ("tiny-llama", {"seq_len": 16}),
        ("tiny-wav2vec2", {"seconds": 1.0}),
        ("tiny-whisper", {"seq_len": 8}),
        ("tiny-vit.json", {}),
    ],
)
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_the_estimate_follows_the_real_step(where: str, lengths: dict[str, Any], mode: str) -> None:
    source = str(CONFIGS / where)
    est = vramctl.estimate(source, batch_size=2, mode=mode, device="cpu", **lengths)
    real = _real_peak(source, mode, **lengths)
    assert est.logical_peak == pytest.approx(real, rel=0.02)


def test_a_state_space_scan_and_its_gradient_sums_follow_the_real_step() -> None:
    # Mamba's reference scan (no CUDA kernels here). Its training peak is where autograd sums
    # two gradients of one activation: in place in eager PyTorch, out of place for fake
    # tensors; modelled in place, the estimate is exact (it was 5.5% high).
    source = str(CONFIGS / "tiny-mamba")
    est = vramctl.estimate(source, batch_size=2, seq_len=32, device="cpu")
    real = _real_peak(source, "train", seq_len=32)
    assert est.logical_peak == pytest.approx(real, rel=0.005)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_grouped_gemm_experts_trace_in_fp32_and_bf16(mode: str, precision: str) -> None:
    # transformers' mixture-of-experts layers call torch._grouped_mm, whose meta kernel
    # refuses fp32 (and strides CUDA would refuse) although the real kernels run.
    source = str(CONFIGS / "tiny-mixtral")
    est = vramctl.estimate(
        source, batch_size=2, seq_len=16, mode=mode, precision=precision, device="cpu"
    )
    real = _real_peak(source, mode, precision, seq_len=16)
    assert est.logical_peak == pytest.approx(real, rel=0.02)


def test_task_picks_the_head_and_the_batch() -> None:
    source = str(CONFIGS / "tiny-llama")
    cm = config_model(source, task="seq-classification")
    assert cm.class_name == "LlamaForSequenceClassification"
    batch = cm.make_batch(3, seq_len=8)
    assert batch["labels"].shape == (3,)
    # The config has no pad token; one is set so that a batch of several runs.
    assert any("pad token" in n for n in cm.notes)
    est = vramctl.estimate(source, task="seq-classification", batch_size=3, seq_len=8)
    assert est.batch_size == 3


def test_a_config_without_architectures_takes_a_head_and_says_so() -> None:
    cm = config_model(str(CONFIGS / "tiny-bert-noarch"))
    assert cm.task == "masked-lm"
    assert any("names no architecture" in n for n in cm.notes)


def test_image_size_builds_the_model_for_that_size() -> None:
    source = str(CONFIGS / "tiny-vit.json")
    small = vramctl.estimate(source, batch_size=2, device="cpu")
    large = vramctl.estimate(source, batch_size=2, device="cpu", image_size=128)
    assert large.logical_peak > small.logical_peak
    assert config_model(source, image_size=128).make_batch(1)["pixel_values"].shape[-1] == 128


def test_max_batch_and_lengths_search_a_config_model() -> None:
    best = vramctl.max_batch_size(
        str(CONFIGS / "tiny-llama"), device="4GiB", seq_len=64, lengths=True, limit=64
    )
    assert best.batch_size > 1
    assert best.length_arg == "seq_len"
    assert best.max_length == 256  # the config's max_position_embeddings


@pytest.mark.parametrize(
    ("source", "kwargs", "message"),
    [
        ("tiny-llama", {"task": "ctc"}, "no ctc head for model type 'llama'"),
        ("tiny-llama", {"task": "poetry"}, "task must be one of"),
        ("custom-code", {}, "--trust-remote-code"),
        ("./no-such-folder", {}, "no such file or folder"),
        ("tiny-vit.json", {"image_size": 0}, "image_size must be positive"),
    ],
)
def test_a_model_that_cannot_be_built_says_why_in_one_line(
    source: str, kwargs: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(CONFIGS)
    with pytest.raises(EstimateError, match=message) as info:
        vramctl.estimate(source, device="cpu", **kwargs)
    assert "\n" not in str(info.value)


def test_trusted_custom_code_builds_the_models_own_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.dynamic_module_utils as dynamic

    # transformers copies a model's own code into its modules cache: a temporary one here.
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    source = str(CONFIGS / "custom-code")
    est = vramctl.estimate(source, trust_remote_code=True, batch_size=2, seq_len=16)
    assert any("AcmeForCausalLM (causal-lm)" in n for n in est.notes)
    # 100 x 64 embedding, 64 x 64 mixer, 64 x 100 head, with biases.
    assert est.parameters == 100 * 64 + 64 * 64 + 64 + 64 * 100 + 100


def test_a_folder_without_config_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(EstimateError, match=r"without a config\.json"):
        vramctl.estimate(str(tmp_path), device="cpu")


@pytest.mark.usefixtures("offline_hub")
def test_a_hub_id_with_no_network_and_no_cache_says_so() -> None:
    with pytest.raises(EstimateError, match=r"offline mode .* no copy of its config") as info:
        vramctl.estimate("acme-labs/tiny-model", device="cpu")
    assert "\n" not in str(info.value)


@pytest.mark.usefixtures("offline_hub")
def test_an_unknown_bare_name_lists_the_built_in_models() -> None:
    with pytest.raises(EstimateError, match=r"is not a built-in model .*gpt2.* as a Hub id"):
        vramctl.estimate("gpt3", device="cpu")


@pytest.mark.usefixtures("offline_hub")
def test_a_hub_id_in_the_local_cache_is_read_from_it(tmp_path: Path) -> None:
    # The cache layout huggingface_hub reads offline: refs/main -> snapshots/<rev>/config.json.
    repo = tmp_path / "hf" / "hub" / "models--acme-labs--tiny-llama"
    snap = repo / "snapshots" / "0"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((CONFIGS / "tiny-llama" / "config.json").read_text())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0")
    est = vramctl.estimate("acme-labs/tiny-llama", batch_size=2, seq_len=16, device="cpu")
    local = vramctl.estimate(str(CONFIGS / "tiny-llama"), batch_size=2, seq_len=16, device="cpu")
    assert est.logical_peak == local.logical_peak
