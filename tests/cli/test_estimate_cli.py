"""`vramctl estimate`: every input in its JSON, the device range, and a --max-batch that does
not claim a limit it did not find."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from vramctl.cli._app import app

runner = CliRunner()


def wide_mlp() -> torch.nn.Module:
    """Small inputs and 40 KB of activations a sample (the probes' peaks round together)."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 64)
    )


def wide_batch(b: int) -> torch.Tensor:
    return torch.zeros(b, 64)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(autouse=True)
def _no_alloc_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimates price PyTorch's default allocator unless a test sets one."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


def test_json_reports_every_input_used_defaults_included() -> None:
    r = runner.invoke(app, ["estimate", "lstm", "--batch", "2", "--device", "T4-16GB", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    inputs = doc["inputs"]
    assert inputs == {
        "model": "lstm",
        "batch_fn": None,
        "batch_sizes": [2],
        "mode": "train",
        "precision": "fp32",
        "optimizer": "adamw",
        "seq_len": 256,  # lstm's default, which the trace used: not null
        "seconds": None,
        "image_size": None,
        "task": None,
        "trust_remote_code": False,
        "checkpointing": False,
        "offload": [],
        "keep_output": True,
        "grad_accumulation": False,
        "side_streams": False,
        "device": "T4-16GB",
        "capacity_bytes": doc["estimates"][0]["capacity_bytes"],
        "target_utilization": 0.9,
        "calibration": None,
        "calibrated": False,
        "safe": True,
        "allocator": {"max_split_size": None, "expandable_segments": False},
        "max_batch": False,
        "max_length": False,
        "parallel": None,
        "lora": None,
        "adapter": None,
        "quant": None,
        "double_quant": False,
        "kbit_prep": False,
        "group_size": None,
        "quantization": None,
        "max_new_tokens": None,
        "cache": None,
        "kv_dtype": None,
    }
    est = doc["estimates"][0]
    assert est["seq_len"] == 256 and est["optimizer"] == "adamw"
    assert est["device_uncertainty_bytes"] == 2**30
    assert est["peak_device_high_bytes"] == est["peak_device_bytes"] + 2**30
    infer = runner.invoke(
        app, ["estimate", "lstm", "--mode", "infer", "--device", "cpu", "--optimistic", "--json"]
    )
    inputs = json.loads(infer.stdout)["inputs"]
    assert inputs["optimizer"] is None and inputs["safe"] is False and inputs["calibrated"]


def test_the_allocator_is_priced_as_the_alloc_conf_or_the_environment_sets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = ["estimate", "gpt2", "--batch", "4", "--device", "H100-80GB", "--json"]

    def priced(*extra: str) -> tuple[dict[str, object], int]:
        r = runner.invoke(app, [*args, *extra])
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        return doc["inputs"]["allocator"], doc["estimates"][0]["peak_reserved_bytes"]

    fixed, fixed_reserved = priced()
    assert fixed == {"max_split_size": None, "expandable_segments": False}
    grown, grown_reserved = priced("--alloc-conf", "expandable_segments:True")
    assert grown == {"max_split_size": None, "expandable_segments": True}
    # expandable segments map what the step needs: no 20 MiB segments half used
    assert grown_reserved < fixed_reserved
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert priced() == (grown, grown_reserved)  # the environment's, by default
    assert priced("--alloc-conf", "") == (fixed, fixed_reserved)  # '': PyTorch's defaults
    split, _ = priced("--alloc-conf", "max_split_size_mb:128")
    assert split == {"max_split_size": 128 * 2**20, "expandable_segments": False}
    bad = runner.invoke(app, [*args, "--alloc-conf", "expandable_segment:True"])
    assert bad.exit_code == 2
    assert "did you mean 'expandable_segments'" in bad.output
    assert len(bad.output.strip().splitlines()) == 1


def test_the_loops_options_are_priced_as_the_python_api_prices_them() -> None:
    """--offload, --release-output, --grad-accumulation and --side-streams give the estimate
    Step's fields of the same names; each changes what it should, and the ones only a
    training loop has are refused with one line for another mode."""
    import vramctl

    args = ["estimate", "gpt2", "--batch", "2", "--seq-len", "64", "--device", "H100-80GB"]

    def cli(*extra: str) -> dict[str, object]:
        r = runner.invoke(app, [*args, *extra, "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["estimates"][0]

    def api(**step: object) -> vramctl.Estimate:
        return vramctl.estimate("gpt2", batch_size=2, seq_len=64, device="H100-80GB", **step)

    cases = [
        (("--offload", "activations,optimizer"), {"offload_activations": True,
                                                  "offload_optimizer": True}),
        (("--release-output",), {"keep_output": False}),
        (("--grad-accumulation",), {"grad_accumulation": True}),
        (("--side-streams",), {"side_streams": True}),
    ]  # fmt: skip
    plain = cli()
    for extra, step in cases:
        got, want = cli(*extra), api(**step)
        assert got["peak_allocated_bytes"] == want.peak_allocated, extra
        assert got["peak_device_bytes"] == want.peak_device, extra
        assert got != plain, extra
    # the stream pool is outside the allocator: only the device peak grows
    streams = cli("--side-streams")
    assert streams["peak_reserved_bytes"] == plain["peak_reserved_bytes"]
    assert streams["peak_device_bytes"] > plain["peak_device_bytes"]
    for bad, says in (
        (["--offload", "disk"], "'disk' is not one of activations, optimizer"),
        (["--mode", "infer", "--offload", "optimizer"], "go with --mode train"),
        (["--mode", "infer", "--release-output"], "go with --mode train"),
    ):
        r = runner.invoke(app, [*args, *bad])
        assert r.exit_code == 2 and says in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1


def test_text_shows_which_peak_is_which_the_range_and_the_missing_profile() -> None:
    r = runner.invoke(app, ["estimate", "lstm", "--batch", "2", "--device", "T4-16GB"])
    assert r.exit_code == 0, r.output
    out = flat(r.stdout)
    assert "nvidia-smi" in out and "max_memory_allocated" in out and "max_memory_reserved" in out
    assert "iB to " in out and "1.00 GiB above it" in out  # the range
    assert "no calibration profile for T4-16GB: run `vramctl calibrate` on it" in out
    cpu = flat(runner.invoke(app, ["estimate", "lstm", "--device", "cpu"]).stdout)
    assert "calibrat" not in cpu and "iB to " not in cpu  # no range: nothing to calibrate
    assert "CPU target: live tensor bytes" in cpu


def test_max_batch_says_no_limit_found_rather_than_a_size_it_did_not_bracket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vramctl.estimator._maxbatch as mb

    monkeypatch.setattr(mb, "SEARCH_INPUT_BYTES", 1 << 16)  # 256 samples of 256 bytes
    args = [
        "estimate",
        "tests.cli.test_estimate_cli:wide_mlp",
        "--batch-fn",
        "tests.cli.test_estimate_cli:wide_batch",
        "--device",
        "T4-16GB",
        "--max-batch",
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    out = flat(r.stdout)
    assert "no limit found up to 256" in out and "host memory" in out
    assert "256 fits" not in out and "confirmed" not in out
    assert "judged at the safe end" in out and "--optimistic" in out
    doc = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert doc["max_batch"]["limit_found"] is False
    assert doc["max_batch"]["stopped_by"] == "input"
    assert doc["max_batch"]["max_batch_size"] == 256


def test_max_batch_found_names_the_traces_that_bracket_it() -> None:
    args = ["estimate", "lstm", "--seq-len", "64", "--device", "T4-16GB", "--max-batch"]
    safe = runner.invoke(app, [*args, "--json"])
    best = json.loads(safe.stdout)["max_batch"]
    n = best["max_batch_size"]
    assert best["limit_found"] and best["safe"]
    fits = {p["batch_size"]: p["fits"] for p in best["curve"]}
    assert fits[n] and fits[n + 1] is False
    text = flat(runner.invoke(app, args).stdout)
    assert f"largest batch that fits: {n} " in text and f"{n} fits, {n + 1} does not" in text
    loose = json.loads(runner.invoke(app, [*args, "--optimistic", "--json"]).stdout)
    assert loose["max_batch"]["max_batch_size"] > n and not loose["max_batch"]["safe"]


CONFIGS = __import__("pathlib").Path(__file__).parents[1] / "estimator" / "configs"


def test_a_config_folder_estimates_with_its_head_named() -> None:
    r = runner.invoke(
        app,
        [
            "estimate",
            str(CONFIGS / "tiny-llama"),
            "--batch",
            "1,2",
            "--seq-len",
            "16",
            "--device",
            "T4-16GB",
            "--task",
            "seq-classification",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["inputs"]["task"] == "seq-classification"
    assert [e["batch_size"] for e in doc["estimates"]] == [1, 2]
    assert any("LlamaForSequenceClassification" in n for n in doc["estimates"][0]["notes"])


def test_a_config_that_needs_its_own_code_is_one_line_and_status_2() -> None:
    r = runner.invoke(app, ["estimate", str(CONFIGS / "custom-code"), "--device", "cpu"])
    assert r.exit_code == 2
    assert "--trust-remote-code" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_image_size_reaches_a_config_model() -> None:
    r = runner.invoke(
        app,
        [
            "estimate",
            str(CONFIGS / "tiny-vit.json"),
            "--image-size",
            "32",
            "--device",
            "cpu",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["inputs"]["image_size"] == 32


def test_the_text_names_the_device_its_capacity_and_the_parameters() -> None:
    r = runner.invoke(
        app,
        ["estimate", "lstm", "--batch", "2", "--device", "T4-16GB", "--precision", "amp-bf16"],
    )
    assert r.exit_code == 0, r.output
    out = flat(r.stdout)
    assert "device: T4-16GB (14.58 GiB)" in out
    assert "parameters: 37,283,600" in out
    assert "note: no native bf16 on T4-16GB (compute capability 7.5" in out


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("A100-80G", "error: unknown device 'A100-80G': did you mean A100-80GB?"),
        ("V100-32G", "error: unknown device 'V100-32G': did you mean V100-32GB?"),
        ("A100", "error: 'A100' matches several GPUs: A100-40GB, A100-80GB; name one"),
    ],
)
def test_a_device_that_is_not_one_catalog_gpu_is_one_line(device: str, message: str) -> None:
    """These were the A100-40GB and the V100-16GB, said only in the table's title."""
    r = runner.invoke(app, ["estimate", "lstm", "--device", device])
    assert r.exit_code == 2
    assert r.output.strip() == message


@pytest.mark.parametrize("size", ["100000000", "99999999999999999999"])
def test_a_batch_beyond_any_gpu_is_one_line(size: str) -> None:
    r = runner.invoke(app, ["estimate", "lstm", "--batch", size, "--device", "A100-80GB"])
    assert r.exit_code == 2
    assert len(r.output.strip().splitlines()) == 1
    assert f"error: batch {size} of lstm is beyond any GPU's reach" in r.output


def test_an_option_the_model_does_not_use_gets_a_note() -> None:
    r = runner.invoke(
        app, ["estimate", "lstm", "--image-size", "64", "--device", "cpu", "--mode", "infer"]
    )
    assert r.exit_code == 0, r.output
    assert "note: image_size=64 was given but not used: lstm's inputs take no images" in flat(
        r.output
    )


def test_seq_len_past_gpt2s_position_table_is_one_line_and_status_2(tmp_path: Path) -> None:
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": 1,
        "n_embd": 32,
        "n_head": 2,
        "n_positions": 64,
        "vocab_size": 100,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = runner.invoke(app, ["estimate", str(tmp_path), "--seq-len", "100000", "--device", "cpu"])
    assert r.exit_code == 2
    assert len(r.output.strip().splitlines()) == 1
    assert "more than the 64 positions" in r.output and "n_positions" in r.output


def test_a_misspelled_config_key_is_a_note_in_the_cli(tmp_path: Path) -> None:
    data = json.loads((CONFIGS / "tiny-llama" / "config.json").read_text())
    data["vocab_sise"] = data.pop("vocab_size")
    (tmp_path / "config.json").write_text(json.dumps(data))
    r = runner.invoke(
        app, ["estimate", str(tmp_path), "--seq-len", "8", "--device", "cpu", "--mode", "infer"]
    )
    assert r.exit_code == 0, r.output
    assert "vocab_sise (did you mean vocab_size?)" in flat(r.output)
