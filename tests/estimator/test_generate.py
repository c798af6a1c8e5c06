"""mode="generate": a causal LM's greedy ``generate`` priced against the real one on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import vramctl
from tests.estimator.real_steps import profiled_peak, storages_bytes
from vramctl.cli._app import app
from vramctl.estimator import EstimateError
from vramctl.estimator._shared import run_target

transformers = pytest.importorskip("transformers")

from tests.estimator.small_llama import CONFIG, llama  # noqa: E402


def prompt(batch: int, length: int) -> torch.Tensor:
    return torch.randint(
        0, CONFIG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1)
    )


def generate_peak(model: Any, ids: torch.Tensor, new: int, cache: str, **kw: Any) -> int:
    """The real peak of a greedy ``generate`` of exactly ``new`` tokens, after a warm-up."""
    model.generation_config.eos_token_id = None

    def run() -> None:
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                pad_token_id=0, cache_implementation=cache, **kw,
            )  # fmt: skip

    run()
    return storages_bytes([*model.parameters(), *model.buffers(), ids]) + profiled_peak(run)


@pytest.mark.parametrize(
    ("batch", "length", "new", "cache"),
    [(2, 64, 32, "dynamic"), (2, 64, 32, "static"), (4, 16, 96, "static"), (1, 256, 8, "dynamic")],
)
def test_generate_is_priced_as_the_real_one(batch: int, length: int, new: int, cache: str) -> None:
    model = llama().eval()
    ids = prompt(batch, length)
    real = generate_peak(model, ids, new, cache)
    est = vramctl.estimate(
        model, ids, device="cpu", mode="generate", max_new_tokens=new, cache=cache
    )
    # transformers' decode loop holds two (batch x vocabulary) buffers more, not yet named
    assert -0.01 < (est.peak_allocated - real) / real < 0.005, (est.peak_allocated, real)
    assert est.mode == "generate"
    assert any(n.startswith("generate: the prefill and the last") for n in est.notes)


def test_sliding_window_layers_keep_their_window() -> None:
    """Gemma-2 alternates full and sliding-window layers: after the window fills, a sliding
    layer's cache stops growing (priced as the model's own cache class keeps it)."""
    cfg = transformers.Gemma2Config(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=32,
        max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    ids = prompt(4, 16)
    real = generate_peak(model, ids, 96, "dynamic")
    est = vramctl.estimate(model, ids, device="cpu", mode="generate", max_new_tokens=96)
    assert -0.01 < (est.peak_allocated - real) / real < 0.005, (est.peak_allocated, real)


def test_the_cache_is_its_own_category_at_its_whole_length() -> None:
    """A static cache holds every position from the first step: 2 (keys, values) x layers x
    key-value heads x head size x batch x (prompt + new tokens - 1: the last token is never
    cached), in the weights' dtype."""
    model = llama().eval()
    batch, length, new = 2, 64, 32
    est = vramctl.estimate(
        model, prompt(batch, length), device="cpu", mode="generate", max_new_tokens=new,
        cache="static",
    )  # fmt: skip
    head = CONFIG.hidden_size // CONFIG.num_attention_heads
    per_token = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * head * 4
    assert est.breakdown["kv_cache"] == per_token * batch * (length + new - 1)
    longer = vramctl.estimate(
        model, prompt(batch, length), device="cpu", mode="generate", max_new_tokens=4 * new,
        cache="static",
    )  # fmt: skip
    assert longer.breakdown["kv_cache"] == per_token * batch * (length + 4 * new - 1)
    assert longer.peak_allocated > est.peak_allocated


def test_a_long_generation_peaks_at_its_last_step() -> None:
    """With a short prompt and many new tokens the dynamic cache's last concatenation is the
    peak: the whole cache and one layer's keys (or values) twice."""
    model = llama().eval()
    short = vramctl.estimate(model, prompt(4, 16), device="cpu", mode="generate", max_new_tokens=8)
    long = vramctl.estimate(model, prompt(4, 16), device="cpu", mode="generate", max_new_tokens=400)
    head = CONFIG.hidden_size // CONFIG.num_attention_heads
    per_token = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * head * 4
    grown = long.peak_allocated - short.peak_allocated
    assert grown >= per_token * 4 * (400 - 8)
    assert long.breakdown["kv_cache"] >= per_token * 4 * (16 + 400 - 2)


def test_max_batch_size_searches_the_generation() -> None:
    model = llama().eval()
    one = vramctl.estimate(model, prompt(1, 64), device="cpu", mode="generate", max_new_tokens=64)
    found = vramctl.max_batch_size(
        model,
        lambda n: prompt(n, 64),
        # a device of the host's kind (no CUDA context), of that many bytes
        device=run_target(vramctl.simulate(int(one.peak_allocated * 1.6 / 0.9))),
        mode="generate",
        max_new_tokens=64,
        limit=64,
    )
    assert 1 < found.batch_size < 64


def test_what_cannot_generate_is_one_clear_line() -> None:
    bert = transformers.BertModel(
        transformers.BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    )
    ids = prompt(1, 8)
    with pytest.raises(EstimateError, match="cannot generate"):
        vramctl.estimate(bert, ids, device="cpu", mode="generate", max_new_tokens=4)
    with pytest.raises(EstimateError, match="needs max_new_tokens"):
        vramctl.estimate(llama(), ids, device="cpu", mode="generate")
    with pytest.raises(EstimateError, match="cache must be one of"):
        vramctl.estimate(
            llama(), ids, device="cpu", mode="generate", max_new_tokens=4, cache="paged"
        )


def t5() -> Any:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=1000, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    return model


def bart() -> Any:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
        decoder_ffn_dim=256, max_position_embeddings=512,
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(config).eval()
    for key in ("eos_token_id", "forced_eos_token_id", "forced_bos_token_id"):
        setattr(model.generation_config, key, None)
    return model


@pytest.mark.parametrize(
    ("make", "batch", "length", "new", "cache"),
    [(t5, 4, 16, 96, "dynamic"), (t5, 2, 64, 32, "static"), (bart, 4, 16, 96, "dynamic"),
     (bart, 2, 64, 32, "static")],
)  # fmt: skip
def test_an_encoder_decoder_generates_as_the_real_one(
    make: Any, batch: int, length: int, new: int, cache: str
) -> None:
    """The encoder once, its output kept; the decoder's self-attention cache grows and its
    cross-attention cache holds the encoder's keys and values."""
    model = make()
    ids = torch.randint(3, 1000, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def run() -> None:
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, do_sample=False, num_beams=1,
                cache_implementation=cache,
            )  # fmt: skip

    run()
    real = storages_bytes([*model.parameters(), *model.buffers(), ids]) + profiled_peak(run)
    est = vramctl.estimate(
        model, {"input_ids": ids, "attention_mask": mask}, device="cpu", mode="generate",
        max_new_tokens=new, cache=cache,
    )  # fmt: skip
    assert abs(est.peak_allocated - real) / real < 0.001, (est.peak_allocated, real)


def test_whispers_generate_is_priced_with_its_segment_copy() -> None:
    """Whisper's own generate feeds the encoder a copy of the features (its segment)."""
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=1000, d_model=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
        decoder_ffn_dim=128, num_mel_bins=80, decoder_start_token_id=1, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    features = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(1))

    def run() -> None:
        with torch.no_grad():
            model.generate(input_features=features, max_new_tokens=16, do_sample=False)

    run()
    real = storages_bytes([*model.parameters(), *model.buffers(), features]) + profiled_peak(run)
    est = vramctl.estimate(
        model, {"input_features": features}, device="cpu", mode="generate", max_new_tokens=16
    )
    assert abs(est.peak_allocated - real) / real < 0.001, (est.peak_allocated, real)


@pytest.mark.parametrize("kv_dtype", [None, "int2"])
def test_a_quantized_cache_is_priced_as_its_steps_leave_it(kv_dtype: str | None) -> None:
    """transformers' QuantizedCache (optimum-quanto, 4 bits or 2): the prompt quantized, each
    new token kept unquantized until 128 are, then all quantized again; every step
    dequantizes the whole cache for its attention. Quanto's operators' scratch is measured
    on the CPU."""
    pytest.importorskip("optimum.quanto")
    batch, length, new = 2, 64, 160
    model = llama().eval()
    model.generation_config.eos_token_id = None
    ids = prompt(batch, length)
    bits = {"cache_config": {"nbits": 2}} if kv_dtype == "int2" else {}
    real = generate_peak(model, ids, new, "quantized", **bits)
    est = vramctl.estimate(
        model, ids, device="cpu", mode="generate", max_new_tokens=new, cache="quantized",
        kv_dtype=kv_dtype,
    )  # fmt: skip
    # the peak is the step that quantizes all 191 tokens again, in quanto's operator
    assert est.peak_op == "quantize_affine"
    assert abs(est.peak_allocated - real) / real < 0.01, (est.peak_allocated, real)
    assert est.breakdown["kv_cache"] > 0
    if kv_dtype == "int2":
        four = vramctl.estimate(
            model, ids, device="cpu", mode="generate", max_new_tokens=new, cache="quantized"
        )
        assert est.breakdown["kv_cache"] < four.breakdown["kv_cache"]
        assert any("(quantized cache, int2)" in n for n in est.notes)


def test_a_kv_dtype_is_the_quantized_caches_width() -> None:
    kw: dict[str, Any] = dict(mode="generate", batch_size=1, seq_len=8, max_new_tokens=4)
    with pytest.raises(EstimateError, match=r"kv_dtype='int2' is the quantized cache's width"):
        vramctl.estimate(OFFLOAD_CONFIG, **kw, kv_dtype="int2", device="cpu")
    with pytest.raises(EstimateError, match="kv_dtype must be one of int4, int2"):
        vramctl.estimate(OFFLOAD_CONFIG, **kw, cache="quantized", kv_dtype="fp8", device="cpu")
    result = CliRunner().invoke(app, ["estimate", "llama-1b", "--kv-dtype", "int2"])
    assert result.exit_code != 0 and "go with --mode generate" in result.output


def test_an_encoder_decoder_by_its_config_generates() -> None:
    est = vramctl.estimate(
        t5().config, device="cpu", mode="generate", max_new_tokens=32, batch_size=2, seq_len=64
    )
    assert est.mode == "generate" and est.peak_allocated > 0


def test_the_command_line_estimates_a_generation(tmp_path: Path) -> None:
    CONFIG.to_json_file(tmp_path / "config.json")
    args = ["estimate", str(tmp_path), "--device", "cpu", "--batch", "2"]
    gen = [*args, "--mode", "generate", "--prompt-len", "32", "--max-new-tokens", "16"]
    result = CliRunner().invoke(app, [*gen, "--cache", "static", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["inputs"]["max_new_tokens"] == 16 and doc["inputs"]["cache"] == "static"
    assert doc["inputs"]["seq_len"] == 32
    assert doc["estimates"][0]["breakdown_bytes"]["kv_cache"] > 0
    table = CliRunner().invoke(app, gen)
    assert table.exit_code == 0 and "kv_cache" in table.output, table.output
    bad = CliRunner().invoke(app, [*args, "--max-new-tokens", "16"])
    assert bad.exit_code != 0 and "go with --mode generate" in bad.output


# -- the offloaded cache ----------------------------------------------------------------------

OFFLOAD_CONFIG = transformers.LlamaConfig(
    vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def test_an_offloaded_cache_holds_two_or_three_layers_on_the_device() -> None:
    """transformers' offloaded cache brings a layer's keys and values to the device for its
    update and sends them back after: during layer i's attention the device holds layer i
    (grown by one token) and layer i+1 (prefetched), and for the moment of the
    concatenation layer i's old copy too. The other layers are in host memory."""
    b, prompt_len, new = 4, 16, 512
    kw: dict[str, Any] = dict(
        mode="generate", batch_size=b, seq_len=prompt_len, max_new_tokens=new, device="L4-24GB"
    )
    dynamic = vramctl.estimate(OFFLOAD_CONFIG, **kw)
    offloaded = vramctl.estimate(OFFLOAD_CONFIG, **kw, cache="offloaded")
    # keys and values, fp32: one layer at the last step's length (every token but the last)
    head = OFFLOAD_CONFIG.hidden_size // OFFLOAD_CONFIG.num_attention_heads
    layer = 2 * b * OFFLOAD_CONFIG.num_key_value_heads * head * (prompt_len + new - 1) * 4
    layers = OFFLOAD_CONFIG.num_hidden_layers
    assert dynamic.breakdown["kv_cache"] >= layers * layer  # peaks at its last step
    assert 2 * layer <= offloaded.breakdown["kv_cache"] <= 3 * layer + 2**20
    saved = dynamic.peak_allocated - offloaded.peak_allocated
    assert (layers - 3) * layer <= saved <= (layers - 2) * layer + 2**20
    # every layer crosses the bus twice a step: the step is slower
    assert offloaded.step_seconds > dynamic.step_seconds


def test_the_offloaded_cache_needs_a_gpu_and_a_decoder_only_model() -> None:
    kw: dict[str, Any] = dict(mode="generate", batch_size=1, seq_len=8, max_new_tokens=4)
    with pytest.raises(EstimateError, match=r"host memory while a GPU computes.*'cpu'"):
        vramctl.estimate(OFFLOAD_CONFIG, **kw, cache="offloaded", device="cpu")
    t5 = transformers.T5Config(
        vocab_size=500, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4
    )
    with pytest.raises(EstimateError, match="offloaded cache is priced for decoder-only"):
        vramctl.estimate(t5, **kw, cache="offloaded", device="L4-24GB")
    # run for real, it needs the model on a CUDA device (as transformers' does)
    from vramctl.estimator._generate import run_generate

    with pytest.raises(EstimateError, match="run it with the model on a CUDA device"):
        run_generate(llama().eval(), prompt(1, 8), 4, "offloaded")


@pytest.mark.cuda
def test_an_offloaded_generate_is_priced_as_the_real_one_on_a_gpu() -> None:
    """transformers' own offloaded generate on the GPU, against the estimate; and what it
    saves against the dynamic cache, against what the estimate says it saves."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(OFFLOAD_CONFIG).cuda().eval()
    model.generation_config.eos_token_id = None
    ids = prompt(4, 16).cuda()

    def peak(cache: str) -> int:
        def run() -> None:
            with torch.no_grad():
                model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=512,
                    do_sample=False, pad_token_id=0, cache_implementation=cache,
                )  # fmt: skip

        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())

    real = {cache: peak(cache) for cache in ("dynamic", "offloaded")}
    est = {
        cache: vramctl.estimate(
            model, ids, device="cuda:0", mode="generate", max_new_tokens=512, cache=cache
        ).peak_allocated
        for cache in ("dynamic", "offloaded")
    }
    assert abs(est["offloaded"] - real["offloaded"]) / real["offloaded"] < 0.1, (est, real)
    saved_real = real["dynamic"] - real["offloaded"]
    saved_est = est["dynamic"] - est["offloaded"]
    assert abs(saved_est - saved_real) <= 0.1 * saved_real, (est, real)


def test_quanto_packs_fakes_only_while_traced_and_is_undone_on_failure() -> None:
    """quanto keeps a fake tensor's integers unpacked (two to four times their real size);
    while a quantized cache is traced it packs them as it packs plain tensors, and the
    patch is gone after, even when the trace raised."""
    pytest.importorskip("optimum.quanto")
    from optimum.quanto import MaxOptimizer, qint2, quantize_weight
    from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramctl.estimator._generate import _plain, _quanto_packs_fakes

    original = WeightQBitsTensor.__init__

    def packed_bytes() -> int:
        with FakeTensorMode() as mode:
            x = mode.from_tensor(torch.randn(600, 64))
            scale, shift = MaxOptimizer()(x, qint2, 0, 64)
            q = quantize_weight(x, qint2, 0, scale, shift, 64)
            return _plain(q)[0].untyped_storage().nbytes()

    assert packed_bytes() == 600 * 64  # unpacked: a byte an integer
    with pytest.raises(RuntimeError, match="inside"), _quanto_packs_fakes():
        with _quanto_packs_fakes():
            assert packed_bytes() == 600 * 64 // 4  # four 2-bit integers a byte
        assert WeightQBitsTensor.__init__ is not original  # the outer use still holds it
        raise RuntimeError("inside")
    assert WeightQBitsTensor.__init__ is original
