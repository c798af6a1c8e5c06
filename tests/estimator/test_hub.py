"""Models named by their Hugging Face config: a folder, the JSON file, a config object, a Hub id.

The configs under ``configs/`` ship with the tests; nothing here reaches the network (the
Hub-id tests run with ``HF_HUB_OFFLINE=1`` and an empty cache).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import vramctl
from vramctl import VramctlError
from vramctl.estimator import EstimateError
from vramctl.estimator._hub import config_model, unknown_config_keys
from vramctl.estimator._spec import StepSpec

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
    # The estimate takes a random layer drop as no drop (every layer runs), and so does the
    # step it is held to. Which layers a seeded step would drop depends on the random
    # numbers its dropout masks drew first, which differ by CPU: PyTorch's bernoulli_
    # draws one seed (for MKL) on an Intel CPU and one number per element on others.
    for key in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
        if getattr(cm.config, key, 0.0):
            setattr(cm.config, key, 0.0)
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
        vramctl.estimate("distilgpt2", device="cpu")


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


# -- a new user's slips: misspelled keys and names, lengths past the model's, no network -----


def _tiny_llama_with(tmp_path: Path, **changes: Any) -> str:
    data = json.loads((CONFIGS / "tiny-llama" / "config.json").read_text())
    data.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(data))
    return str(tmp_path)


def test_config_keys_the_class_does_not_know_are_named_with_a_guess(tmp_path: Path) -> None:
    source = _tiny_llama_with(tmp_path, vocab_sise=50_000, intermediate_szie=512)
    est = vramctl.estimate(source, batch_size=1, seq_len=8, device="cpu", mode="infer")
    plain = vramctl.estimate(
        str(CONFIGS / "tiny-llama"), batch_size=1, seq_len=8, device="cpu", mode="infer"
    )
    assert est.parameters == plain.parameters  # transformers ignored both keys
    (note,) = [n for n in est.notes if "does not know" in n]
    assert "vocab_sise (did you mean vocab_size?)" in note
    assert "intermediate_szie (did you mean intermediate_size?)" in note


def test_a_config_object_with_a_misspelled_key_is_named_too() -> None:
    from transformers import LlamaConfig

    assert unknown_config_keys(LlamaConfig(hidden_size=64, num_hidden_layer=4)) == [
        ("num_hidden_layer", "num_hidden_layers")
    ]
    # An old name for a key, with the same value as the key: it changes nothing.
    assert unknown_config_keys(LlamaConfig(num_hidden_layer=32, num_hidden_layers=32)) == []


@pytest.mark.parametrize(
    "where",
    sorted(p.name for p in CONFIGS.iterdir() if p.name != "custom-code"),
)
def test_the_configs_the_tests_ship_have_no_unknown_keys(where: str) -> None:
    cm = config_model(str(CONFIGS / where))
    assert not [n for n in cm.notes if "does not know" in n]


@pytest.mark.parametrize(
    "model_type",
    ["gpt2", "llama", "bert", "t5", "bart", "whisper", "wav2vec2", "llava", "detr", "mamba"],
)
def test_a_classs_own_config_saved_and_read_back_has_no_unknown_keys(
    model_type: str, tmp_path: Path
) -> None:
    from transformers import CONFIG_MAPPING, AutoConfig

    config = CONFIG_MAPPING[model_type]()
    assert unknown_config_keys(config) == []
    config.save_pretrained(tmp_path)  # what a save_pretrained folder holds
    assert unknown_config_keys(AutoConfig.from_pretrained(tmp_path)) == []
    (tmp_path / "config.json").write_text(config.to_json_string(use_diff=False))
    assert unknown_config_keys(AutoConfig.from_pretrained(tmp_path)) == []


@pytest.mark.slow
def test_no_default_config_of_any_transformers_class_has_unknown_keys() -> None:
    from transformers import CONFIG_MAPPING

    flagged = {}
    for model_type in list(CONFIG_MAPPING.keys()):
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:
            continue  # a class that needs arguments: nothing is checked for it either
        found = unknown_config_keys(config)
        if found:
            flagged[model_type] = found
    assert flagged == {}


def _gpt2(positions: int) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_positions=positions,
        vocab_size=100,
        bos_token_id=0,
        eos_token_id=0,
    )


def test_seq_len_past_a_learned_position_table_is_one_line() -> None:
    ok = vramctl.estimate(_gpt2(64), seq_len=64, device="cpu", mode="infer")
    assert not [n for n in ok.notes if "positions" in n]
    with pytest.raises(VramctlError, match=r"more than the 64 positions") as info:
        vramctl.estimate(_gpt2(64), seq_len=65, device="cpu", mode="infer")
    assert "n_positions" in str(info.value) and "seq_len=64 or less" in str(info.value)
    assert "\n" not in str(info.value)


def test_seq_len_past_what_rope_was_trained_for_is_a_note(tmp_path: Path) -> None:
    # tiny-llama: rotary positions, max_position_embeddings 256.
    est = vramctl.estimate(
        str(CONFIGS / "tiny-llama"), seq_len=300, device="cpu", mode="infer", batch_size=1
    )
    assert est.seq_len == 300
    assert any("beyond the 256 positions" in n for n in est.notes)
    # Llama 3's scaling: original_max_position_embeddings x factor, when that is larger.
    scaled = _tiny_llama_with(
        tmp_path,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        rope_theta=10000.0,
    )
    cm = config_model(scaled)
    assert cm.max_positions == 512 and cm.max_length == 512
    assert "rope scaling" in cm.positions_from


def test_an_unknown_model_type_is_one_whole_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "lama", "hidden_size": 8}))
    (tmp_path / "mine.json").write_text(json.dumps({"model_type": "lama", "hidden_size": 8}))
    for source in (tmp_path, tmp_path / "config.json", tmp_path / "mine.json"):
        with pytest.raises(EstimateError) as info:
            vramctl.estimate(str(source), device="cpu")
        text = str(info.value)
        assert "does not know model type 'lama' (did you mean 'llama'?)" in text
        assert "pip install --upgrade transformers" in text
        assert text.endswith("(trust_remote_code=True)") and "\n" not in text


@pytest.mark.usefixtures("offline_hub")
@pytest.mark.parametrize(("typed", "meant"), [("gtp2", "gpt2"), ("llama1b", "llama-1b")])
def test_a_misspelled_built_in_name_is_a_typo_not_a_hub_id(typed: str, meant: str) -> None:
    with pytest.raises(EstimateError, match=f"did you mean {meant}\\?") as info:
        vramctl.estimate(typed, device="cpu")
    assert "Hub id" not in str(info.value) and "offline" not in str(info.value)  # not asked


def test_an_unreachable_hub_fails_fast_in_one_line(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nothing listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))
    code = (
        "import time\n"
        "from vramctl import VramctlError\n"
        "from vramctl.estimator._hub import config_model\n"
        "t = time.perf_counter()\n"
        "try:\n"
        "    config_model('acme-labs/tiny-model')\n"
        "except VramctlError as exc:\n"
        "    print(round(time.perf_counter() - t, 1), exc, sep='|')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    seconds, _, message = run.stdout.strip().partition("|")
    assert "cannot reach the Hugging Face Hub" in message, run.stdout + run.stderr
    assert float(seconds) < 10  # no half minute of retries
    assert "Retry" not in run.stderr
