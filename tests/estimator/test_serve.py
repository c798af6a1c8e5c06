"""serve_plan: vLLM's and SGLang's KV budget, their rules and the figures they have logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import vramctl
from vramctl import VramctlError
from vramctl.cli._app import app
from vramctl.estimator._serve import (
    BLOCK_SIZE,
    CUDA_GRAPHS,
    NON_TORCH,
    kv_shape,
    rank_config,
    sglang_defaults,
    vllm_defaults,
    with_capacity,
)
from vramctl.estimator._target import resolve_target

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = str(ROOT / "docs" / "examples" / "llama-3.1-8b" / "config.json")
GiB = 1 << 30
MiB = 1 << 20


def llama_8b() -> object:
    return transformers.AutoConfig.from_pretrained(str(Path(LLAMA_8B).parent))


def qwen3_235b() -> object:
    """Qwen3-235B-A22B's attention, as its published config.json gives it."""
    return transformers.Qwen3MoeConfig(
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        hidden_size=4096,
        max_position_embeddings=40960,
    )


def small(**kw: object) -> object:
    """The shrunk Llama of the fine-tuning tests, with 4096 positions."""
    from tests.estimator.small_llama import CONFIG

    return transformers.LlamaConfig(**{**CONFIG.to_dict(), "max_position_embeddings": 4096, **kw})


# -- the cache's shape, by the engines' rules ----------------------------------------------------


def test_a_llama_token_is_its_layers_keys_and_values() -> None:
    kv = kv_shape(llama_8b())
    # 2 (K, V) x 8 KV heads x 128 x 2 bytes x 32 layers
    assert kv.token_bytes() == 131072
    assert kv.page_bytes() == 2 * BLOCK_SIZE * 8 * 128 * 2
    assert kv_shape(llama_8b(), tp=2).token_bytes() == 65536
    assert kv_shape(llama_8b(), tp=4, dtype_bytes=1).token_bytes() == 16384
    # fewer KV heads than ranks: each rank keeps one
    assert kv_shape(llama_8b(), tp=16).heads == 1


def test_tensor_parallel_sizes_the_engines_refuse_are_refused_in_one_line() -> None:
    with pytest.raises(VramctlError, match="does not divide the 32 attention heads"):
        kv_shape(llama_8b(), tp=3)
    with pytest.raises(VramctlError, match="not a multiple of the 2 KV heads"):
        kv_shape(small(num_attention_heads=12, num_key_value_heads=2, hidden_size=96), tp=3)
    with pytest.raises(VramctlError, match="at least 1"):
        kv_shape(llama_8b(), tp=0)


def test_mla_keeps_one_latent_a_token_on_every_rank() -> None:
    config = transformers.DeepseekV3Config(
        num_hidden_layers=4, kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16
    )
    kv = kv_shape(config, tp=8)
    assert kv.mla and kv.heads == 1
    assert kv.token_bytes() == (512 + 64) * 2 * 4


def test_sliding_window_layers_hold_a_window_a_request() -> None:
    config = transformers.Gemma2Config(
        num_hidden_layers=4, sliding_window=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, hidden_size=256,
    )  # fmt: skip
    kv = kv_shape(config)
    assert (kv.full_layers, kv.sliding_layers, kv.window) == (2, 2, 256)
    # 4096 tokens: the full layers 256 blocks each, the sliding ones 17 (256 tokens and one
    # block more for the token being written)
    assert kv.request_blocks(4096) == 2 * 256 + 2 * 17
    assert kv.request_blocks(100) == 4 * 7


def test_vllm_logged_blocks_and_concurrency_follow_from_its_logged_memory() -> None:
    """vllm#10517: Llama-3.1-8B on an RTX 3090, kv_cache_size 3.81 GiB -> 1,952 blocks,
    "Maximum concurrency for 20000 tokens per request: 1.56x"; 2.89 GiB -> 1,478 blocks,
    23,648 tokens."""
    kv = kv_shape(llama_8b())
    per_block = kv.page_bytes() * kv.layers
    # the logged memory is rounded to 0.01 GiB: the logged blocks' pages round to it
    assert f"{1952 * per_block / GiB:.2f}" == "3.81"
    assert int(3.81 * GiB) // per_block in (1950, 1951, 1952)
    assert f"{1952 / kv.request_blocks(20000) * kv.layers:.2f}" == "1.56"
    assert f"{1478 * per_block / GiB:.2f}" == "2.89"
    assert 1478 * BLOCK_SIZE == 23648
    assert f"{1478 / kv.request_blocks(29000) * kv.layers:.2f}" == "0.82"


def test_sglang_logged_pool_follows_from_its_cell() -> None:
    """vllm#21348: SGLang logs '#tokens: 367404, K size: 8.23 GB' for Qwen3-235B-A22B with
    tp 4 (its GB are GiB)."""
    kv = kv_shape(qwen3_235b(), tp=4)
    assert kv.token_bytes() == 1 * (128 + 128) * 2 * 94
    k_size = 367404 * kv.token_bytes() / 2 / GiB
    assert f"{k_size:.2f}" == "8.23"


# -- the engines' defaults -------------------------------------------------------------------


def test_vllm_serve_defaults_by_gpu() -> None:
    assert vllm_defaults(80 * GiB, "H100-80GB") == (8192, 1024)
    assert vllm_defaults(80 * GiB, "A100-80GB") == (2048, 256)
    assert vllm_defaults(24 * GiB, "L4-24GB") == (2048, 256)


def test_sglang_default_fraction_by_gpu() -> None:
    # 80 GB: chunk 8192, graphs to 256; reserved 512 + 12288 + 512 + 128 MiB
    chunk, bs, f = sglang_defaults(81008 * MiB, tp=1)
    assert (chunk, bs) == (8192, 256)
    assert f == round((81008 - 13440) / 81008, 3)
    # 24 GB: chunk 2048, graphs to 24; reserved 512 + 3072 + 48 + 128 MiB
    chunk, bs, f = sglang_defaults(22558 * MiB, tp=1)
    assert (chunk, bs) == (2048, 24)
    assert f == round((22558 - 3760) / 22558, 3)
    # from tp 4 the graphs go to 80 on a 24 GB GPU
    assert sglang_defaults(22558 * MiB, tp=4)[1] == 80


# -- the whole plan --------------------------------------------------------------------------


def test_a_plan_adds_up_by_each_engines_rule() -> None:
    plan = vramctl.serve_plan(LLAMA_8B, "H100-80GB", max_model_len=8192)
    vllm, sglang = plan.engine("vllm"), plan.engine("sglang")
    assert plan.kv.token_bytes() == 131072
    # weights: Llama-3.1-8B in bf16 (vLLM logs 14.99 GiB with its rotary tables)
    assert abs(vllm.weights / GiB - 14.958) < 0.01
    assert vllm.budget == int(vllm.capacity * 0.9)
    assert vllm.non_torch == NON_TORCH and vllm.cuda_graphs == CUDA_GRAPHS
    assert vllm.kv_bytes == (
        vllm.budget - vllm.weights - vllm.activation - vllm.non_torch - vllm.cuda_graphs
    )
    assert vllm.blocks == vllm.kv_bytes // (plan.kv.page_bytes() * 32)
    assert vllm.kv_tokens == vllm.blocks * 16
    assert vllm.concurrency == pytest.approx(vllm.blocks / 512)
    assert vllm.starts and vllm.error is None
    assert vllm.settings["max_num_batched_tokens"] == 8192
    assert sglang.kv_tokens == sglang.kv_bytes // plan.kv.token_bytes()
    assert sglang.settings["mem_fraction_static"] == sglang_defaults(vllm.capacity)[2]
    assert sglang.starts
    # the two engines' budgets differ, as their logs do (vllm#21348)
    assert sglang.kv_tokens != vllm.kv_tokens
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["engines"][0]["kv_tokens"] == vllm.kv_tokens


def test_an_fp8_cache_holds_twice_the_tokens() -> None:
    bf16 = vramctl.serve_plan(LLAMA_8B, "H100-80GB", max_model_len=8192, engine="vllm")
    fp8 = vramctl.serve_plan(
        LLAMA_8B, "H100-80GB", max_model_len=8192, engine="vllm", kv_dtype="fp8"
    )
    assert fp8.engines[0].blocks in (2 * bf16.engines[0].blocks, 2 * bf16.engines[0].blocks + 1)


def test_a_context_that_does_not_fit_fails_as_vllm_does_and_names_what_fits() -> None:
    plan = vramctl.serve_plan(LLAMA_8B, "L4-24GB", max_model_len=131072, engine="vllm")
    e = plan.engines[0]
    assert not e.starts
    assert "estimated maximum model length is" in (e.error or "")
    longest = int((e.error or "").rsplit(" ", 1)[1])
    assert 0 < longest < 131072
    assert any("--max-model-len" in s for s in e.suggestions)
    # and what it names fits
    again = vramctl.serve_plan(LLAMA_8B, "L4-24GB", max_model_len=longest, engine="vllm")
    assert again.engines[0].starts


def test_the_settings_for_a_target_concurrency_reach_it() -> None:
    plan = vramctl.serve_plan(
        LLAMA_8B, "A100-80GB", max_model_len=32768, target_concurrency=14, engine="vllm"
    )
    e = plan.engines[0]
    assert e.concurrency < 14
    u = float(e.suggestions[0].split()[1])
    better = vramctl.serve_plan(
        LLAMA_8B, "A100-80GB", max_model_len=32768, gpu_memory_utilization=u, engine="vllm"
    )
    assert better.engines[0].concurrency >= 14
    # beyond the GPU: the most it holds, and the length at which the target fits
    far = vramctl.serve_plan(
        LLAMA_8B, "A100-80GB", max_model_len=32768, target_concurrency=40, engine="vllm"
    )
    assert "the most this GPU can" in far.engines[0].suggestions[0]
    assert "--max-model-len" in far.engines[0].suggestions[1]
    plan = vramctl.serve_plan(
        LLAMA_8B, "A100-80GB", max_model_len=32768, target_concurrency=14, engine="sglang"
    )
    assert plan.engines[0].concurrency < 14
    f = float(plan.engines[0].suggestions[0].split()[1])
    better = vramctl.serve_plan(
        LLAMA_8B, "A100-80GB", max_model_len=32768, mem_fraction_static=f, engine="sglang"
    )
    assert better.engines[0].concurrency >= 14


def test_tensor_parallel_ranks_hold_a_share_of_the_weights() -> None:
    one = vramctl.serve_plan(LLAMA_8B, "H100-80GB", max_model_len=8192, engine="vllm")
    two = vramctl.serve_plan(LLAMA_8B, "H100-80GB", max_model_len=8192, engine="vllm", tp=2)
    # vLLM logs 14.96 and 7.48 GiB for Llama-3-8B at tp 1 and 2 (vllm#10511)
    assert abs(two.engines[0].weights / GiB - 7.48) < 0.01
    assert two.engines[0].blocks > 2 * one.engines[0].blocks
    config = rank_config(llama_8b(), 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 4, 128)


def test_bad_input_is_one_line() -> None:
    for kw, match in (
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.5}, r"\(0, 1\]"),
        ({"mem_fraction_static": 0}, r"mem_fraction_static must be in"),
        ({"kv_dtype": "int3"}, "kv_dtype must be one of"),
        ({"engine": "tgi"}, "engine must be one of"),
        ({"max_model_len": 0}, "max_model_len must be at least 1"),
    ):
        with pytest.raises(VramctlError, match=match):
            vramctl.serve_plan(small(), "L4-24GB", **kw)
    with pytest.raises(VramctlError, match="priced for a GPU"):
        vramctl.serve_plan(small(), "cpu")


def test_a_length_beyond_the_configs_positions_is_warned_and_still_priced() -> None:
    plan = vramctl.serve_plan(small(), "L4-24GB", max_model_len=8192)
    assert plan.max_model_len == 8192
    assert any("beyond the 4096 positions" in n for n in plan.notes)
    # a learned position table: the profiling forward is traced as sequences it takes
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000)
    plan = vramctl.serve_plan(gpt2, "L4-24GB", max_model_len=4096, engine="vllm")
    assert plan.engines[0].starts
    assert any("beyond the 1024 positions" in n for n in plan.notes)


def test_a_logged_gpu_total_can_be_given() -> None:
    """With the total a log gives, the budget is the engine's: vllm#10517's RTX 3090 logs
    total_gpu_memory 23.58 GiB, x 0.90 = 21.22 GiB."""
    target = with_capacity(resolve_target("RTX3090-24GB"), int(23.58 * GiB))
    plan = vramctl.serve_plan(small(), target, max_model_len=2048, engine="vllm")
    assert plan.engines[0].budget == int(int(23.58 * GiB) * 0.9)


def test_the_command_prints_both_engines_and_json() -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["serve-plan", LLAMA_8B, "-d", "L4-24GB", "--max-model-len", "16384"]
    )
    assert result.exit_code == 0, result.output
    assert "vllm" in result.output and "sglang" in result.output
    assert "KV tokens" in result.output and "requests of 16,384" in result.output
    result = runner.invoke(
        app,
        ["serve-plan", LLAMA_8B, "-d", "L4-24GB", "--max-model-len", "16384", "--engine",
         "vllm", "--kv-dtype", "fp8", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["schema"] == "vramctl.serve-plan/1"
    assert [e["engine"] for e in doc["engines"]] == ["vllm"]
    assert doc["kv"]["bytes_per_token"] == 65536
    bad = runner.invoke(app, ["serve-plan", LLAMA_8B, "--gpu-memory-utilization", "0"])
    assert bad.exit_code != 0
    assert "(0, 1]" in bad.output


def test_a_quantized_checkpoint_frees_room_for_the_cache() -> None:
    """Llama-3.1-8B in AWQ int4 and in fp8: the linear layers in their libraries' storage,
    the embeddings and output head in 16 bits (vLLM logs about 5.4 and 8.5 GiB)."""
    base = vramctl.serve_plan(LLAMA_8B, "L4-24GB", max_model_len=8192, engine="vllm")
    awq = vramctl.serve_plan(LLAMA_8B, "L4-24GB", max_model_len=8192, engine="vllm", quant="awq")
    fp8 = vramctl.serve_plan(LLAMA_8B, "L4-24GB", max_model_len=8192, engine="vllm", quant="fp8")
    assert awq.quant == "awq" and fp8.quant == "fp8"
    assert 5.2 < awq.engines[0].weights / GiB < 5.5
    assert 8.3 < fp8.engines[0].weights / GiB < 8.6
    assert awq.engines[0].kv_tokens > fp8.engines[0].kv_tokens > base.engines[0].kv_tokens


def test_compare_prices_each_weight_and_cache_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(
        app,
        ["serve-plan", "docs/examples/llama-3.1-8b", "-d", "L4-24GB", "--max-model-len",
         "32768", "--compare", "--engine", "vllm", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    rows = {v["variant"]: v for v in doc["variants"]}
    assert list(rows) == ["16-bit", "16-bit + fp8 KV", "fp8", "fp8 + fp8 KV", "AWQ int4",
                          "AWQ + fp8 KV"]  # fmt: skip
    tokens = {k: v["engines"][0]["kv_tokens"] for k, v in rows.items()}
    assert tokens["16-bit + fp8 KV"] == 2 * tokens["16-bit"]
    assert tokens["AWQ + fp8 KV"] == 2 * tokens["AWQ int4"]
    assert not rows["16-bit"]["engines"][0]["starts"]
    bad = CliRunner().invoke(app, ["serve-plan", LLAMA_8B, "--compare", "--kv-dtype", "fp8"])
    assert bad.exit_code != 0 and "--compare prices its own" in bad.output


def test_mamba_and_linear_attention_layers_keep_a_state_a_request() -> None:
    """A request's fixed state: the convolution's last kernel - 1 inputs and the recurrent
    state, in the model's dtype, split over the ranks."""
    qwen_next = transformers.Qwen3NextConfig(
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        hidden_size=2048, linear_num_value_heads=32, linear_num_key_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        full_attention_interval=4,
    )  # fmt: skip
    kv = kv_shape(qwen_next, tp=2)
    assert (kv.full_layers, kv.state_layers) == (2, 6)
    conv, state = 3 * (2 * 16 * 128 + 32 * 128), 32 * 128 * 128
    assert kv.state_layer_bytes == (conv + state) * 2 // 2
    assert kv.token_bytes() == 1 * 512 * 2 * 2
    # its pages: the attention's blocks and the state in pages of their size
    assert kv.request_blocks(32) == 2 * 2 + -(-kv.state_bytes() // kv.page_bytes())
    jamba = transformers.JambaConfig(
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, hidden_size=256,
        mamba_expand=2, mamba_d_state=16, mamba_d_conv=4, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    kv = kv_shape(jamba)
    assert (kv.full_layers, kv.state_layers) == (2, 2)
    assert kv.state_layer_bytes == (3 * 512 + 512 * 16) * 2
    mamba2 = transformers.Mamba2Config(
        num_hidden_layers=2, hidden_size=256, num_heads=8, head_dim=64, state_size=16,
        n_groups=1, conv_kernel=4, expand=2,
    )  # fmt: skip
    kv = kv_shape(mamba2)
    assert (kv.layers, kv.state_layers) == (0, 2)
    assert kv.state_layer_bytes == (3 * (512 + 2 * 16) + 8 * 64 * 16) * 2
    assert kv.request_blocks(100_000) == 1  # a state, whatever the length


def test_a_hybrid_models_requests_hold_their_state_too() -> None:
    config = transformers.Qwen3NextConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        full_attention_interval=2, max_position_embeddings=4096,
    )  # fmt: skip
    plan = vramctl.serve_plan(config, "L4-24GB", max_model_len=4096)
    vllm, sglang = plan.engines
    kv = plan.kv
    assert kv.state_layers == 2 and not kv.unpriced
    assert vllm.concurrency == pytest.approx(vllm.blocks * kv.layers / kv.request_blocks(4096))
    per_request = 4096 * kv.token_bytes() + kv.state_bytes()
    assert sglang.concurrency == pytest.approx(
        (sglang.budget - sglang.weights) / per_request, rel=0.01
    )
    assert any("of state a request" in n for n in plan.notes)
