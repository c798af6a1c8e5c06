"""Quantized weights (``quant=``, ``--quant``): each format's storage against its library,
and QLoRA against a real bitsandbytes and PEFT step on the CPU."""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vramctl
from tests.estimator.real_steps import cpu_step_peak
from vramctl import format_bytes
from vramctl.estimator import EstimateError, QuantSpec
from vramctl.estimator._quant import QuantLinear, quant_spec, storage_layout
from vramctl.estimator._spec import StepSpec

transformers = pytest.importorskip("transformers")

from tests.estimator.small_llama import CONFIG, QV, batch, llama  # noqa: E402

OUT, IN = 256, 512
BENCH = Path(__file__).parents[2] / "benchmarks"


def layout(spec: QuantSpec, compute: torch.dtype = torch.bfloat16) -> dict[str, tuple]:
    return {name: (shape, dtype) for name, shape, dtype in storage_layout(spec, OUT, IN, compute)}


def described(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(t.shape), t.dtype


# -- each format's storage, against its library ----------------------------------------------


def bnb_4bit(kind: str, double: bool) -> Any:
    bnb = pytest.importorskip("bitsandbytes")
    weight = nn.Linear(IN, OUT, bias=False).to(torch.bfloat16).weight.data
    layer = bnb.nn.Linear4bit(
        IN, OUT, bias=False, compute_dtype=torch.bfloat16, quant_type=kind,
        compress_statistics=double,
    )  # fmt: skip
    param = bnb.nn.Params4bit(
        weight, requires_grad=False, quant_type=kind, compress_statistics=double, blocksize=64,
        module=layer,
    )  # fmt: skip
    layer.weight = param.to("cpu")  # bitsandbytes quantizes as it moves the weight
    return layer


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True], ids=["plain", "double-quant"])
def test_bitsandbytes_4bit_storage_is_the_librarys(kind: str, double: bool) -> None:
    real = bnb_4bit(kind, double)
    state = real.weight.quant_state
    got = {"weight": real.weight, "absmax": state.absmax, "code": state.code}
    if double:
        got |= {
            "absmax2": state.state2.absmax,
            "code2": state.state2.code,
            "offset": state.offset,
        }
    assert {k: described(v) for k, v in got.items()} == layout(
        quant_spec(kind, double_quant=double)
    )
    if double:  # each layer has its own copy of the second quantization's dynamic map
        other = bnb_4bit(kind, double).weight.quant_state.state2.code
        assert other.data_ptr() != state.state2.code.data_ptr()
        # 4 bits, an 8-bit absmax per 64, an fp32 scale per 256 absmax: 4.127 bits a weight
        bits = (IN * OUT / 2 + IN * OUT / 64 + 4 * IN * OUT / 64 / 256) * 8 / (IN * OUT)
        assert bits == pytest.approx(4.127, abs=0.001)


def test_llm_int8_storage_is_the_librarys() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    weight = nn.Linear(IN, OUT, bias=False).weight.data.half()
    layer = bnb.nn.Linear8bitLt(IN, OUT, bias=False, has_fp16_weights=False)
    layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    layer = layer.to("cpu")
    got = {"weight": layer.weight, "SCB": layer.weight.SCB}
    assert {k: described(v) for k, v in got.items()} == layout(quant_spec("int8"))


@pytest.mark.parametrize("method", ["int8-weight-only", "fp8"])
def test_torchao_storage_is_the_librarys(method: str) -> None:
    quantization = pytest.importorskip("torchao.quantization")
    config = {
        "int8-weight-only": quantization.Int8WeightOnlyConfig,
        "fp8": quantization.Float8WeightOnlyConfig,
    }[method]()
    model = nn.Sequential(nn.Linear(IN, OUT, bias=False)).to(torch.bfloat16)
    quantization.quantize_(model, config)
    weight = model[0].weight
    names, _ = weight.__tensor_flatten__()
    got = {"weight" if n == "qdata" else n: described(getattr(weight, n)) for n in names}
    assert got == layout(quant_spec(method))


def test_gptq_and_awq_storage_follow_their_kernels_layouts() -> None:
    """GPTQ's and AWQ's kernels do not run on a CPU here: the layouts are pinned to their
    sources (AutoGPTQ/GPTQModel ``QuantLinear``, AutoAWQ ``WQLinear_GEMM``) for a 4096 x
    4096 layer at 4 bits in groups of 128."""
    n = 4096

    def nbytes(spec: QuantSpec) -> dict[str, int]:
        return {
            name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for name, shape, dtype in storage_layout(spec, n, n, torch.float16)
        }

    assert nbytes(quant_spec("gptq")) == {
        "weight": n // 8 * n * 4,  # qweight: (in // 32 * bits, out) int32
        "qzeros": 32 * (n // 8) * 4,  # (in / group, out // 32 * bits) int32
        "scales": 32 * n * 2,  # (in / group, out) fp16
        "g_idx": n * 4,  # one int32 group index per input
    }
    assert nbytes(quant_spec("awq")) == {
        "weight": n * (n // 8) * 4,  # qweight: (in, out // 8) int32
        "qzeros": 32 * (n // 8) * 4,
        "scales": 32 * n * 2,
    }
    # 8-bit GPTQ packs 4 to an int32; a group size of 64 doubles the scales
    assert nbytes(quant_spec("gptq", group_size=64))["scales"] == 64 * n * 2
    assert nbytes(QuantSpec("gptq", bits=8, group_size=128))["weight"] == n // 4 * n * 4


# -- QLoRA against a real step ---------------------------------------------------------------


def quantized_llama(kind: str, double: bool) -> tuple[nn.Module, int]:
    """A bf16 Llama whose linear layers (not ``lm_head``) bitsandbytes quantized, and the
    bytes of their quantization states (which are not parameters or buffers)."""
    pytest.importorskip("bitsandbytes")
    sys.path.insert(0, str(BENCH))
    try:
        from estimate_finetune import quantize  # the benchmark's real QLoRA rows do the same
    finally:
        sys.path.remove(str(BENCH))
    model = llama().to(torch.bfloat16)
    return model, quantize(model, kind, double)


@pytest.mark.parametrize(
    ("kind", "double", "within"),
    [("nf4", False, 1e-4), ("fp4", False, 1e-4), ("nf4", True, 1e-4)],
    ids=["nf4", "fp4", "nf4-double-quant"],
)
def test_qlora_is_priced_as_a_real_bitsandbytes_and_peft_step(
    kind: str, double: bool, within: float
) -> None:
    peft = pytest.importorskip("peft")
    model, states = quantized_llama(kind, double)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = peft.get_peft_model(model, peft.LoraConfig(**QV))
    real = cpu_step_peak(adapted, batch(), StepSpec(precision="bf16")) + states
    spec = QuantSpec(kind, double_quant=double)
    est = vramctl.estimate(llama(), batch(), device="cpu", precision="bf16", adapter=QV, quant=spec)
    assert abs(est.peak_allocated - real) / real < within, (est.peak_allocated, real)
    plain = vramctl.estimate(llama(), batch(), device="cpu", precision="bf16", adapter=QV)
    assert est.peak_allocated < plain.peak_allocated
    assert est.quant is not None and est.quant.startswith(kind)


@pytest.mark.parametrize(
    ("method", "config"),
    [("int8-weight-only", "Int8WeightOnlyConfig"), ("fp8", "Float8WeightOnlyConfig")],
)
def test_lora_on_torchao_weights_is_priced_as_a_real_step(method: str, config: str) -> None:
    """torchao's weight-only layers dequantize under autograd: the dequantized weight is
    kept from forward to backward, which a LoRA step on them holds at its peak."""
    peft = pytest.importorskip("peft")
    tq = pytest.importorskip("torchao.quantization")
    model = llama().to(torch.bfloat16)

    def linear(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and not fqn.endswith("lm_head")

    tq.quantize_(model, getattr(tq, config)(), filter_fn=linear)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = peft.get_peft_model(model, peft.LoraConfig(**QV))
    real = cpu_step_peak(adapted, batch(), StepSpec(precision="bf16"))
    est = vramctl.estimate(
        llama(), batch(), device="cpu", precision="bf16", adapter=QV, quant=method
    )
    assert abs(est.peak_allocated - real) / real < 1e-3, (est.peak_allocated, real)


def test_a_model_bitsandbytes_quantized_is_priced_as_its_real_step() -> None:
    """The user's own QLoRA model (PEFT over bitsandbytes' layers), estimated as it is: its
    layers' format read from them, and the step's peak that of the real one."""
    peft = pytest.importorskip("peft")
    bnb = pytest.importorskip("bitsandbytes")
    model, states = quantized_llama("nf4", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = peft.get_peft_model(model, peft.LoraConfig(**QV))
    layers = [m for m in adapted.modules() if isinstance(m, bnb.nn.Linear4bit)]
    est = vramctl.estimate(adapted, batch(), device="cpu", precision="bf16")
    # the user's layers are left as they were: bitsandbytes' own, with their states
    assert [m for m in adapted.modules() if isinstance(m, bnb.nn.Linear4bit)] == layers
    assert all(m.weight.quant_state is not None for m in layers)
    assert est.quant is not None and est.quant.startswith("nf4") and "double" in est.quant
    assert est.adapter is not None
    spec = QuantSpec("nf4", double_quant=True)
    built = vramctl.estimate(
        llama(), batch(), device="cpu", precision="bf16", adapter=QV, quant=spec
    )
    assert est.peak_allocated == built.peak_allocated
    real = cpu_step_peak(adapted, batch(), StepSpec(precision="bf16")) + states
    assert abs(est.peak_allocated - real) / real < 1e-4, (est.peak_allocated, real)
    with pytest.raises(EstimateError, match="already quantized by bitsandbytes"):
        vramctl.estimate(adapted, batch(), device="cpu", precision="bf16", quant="nf4")


def test_fit_batch_size_of_a_bitsandbytes_qlora_model() -> None:
    """fit_batch_size seeds its search of a real QLoRA model with the estimate, and leaves
    its weights (trained and 4-bit) as they were."""
    peft = pytest.importorskip("peft")
    bnb = pytest.importorskip("bitsandbytes")
    from vramctl.fit import fit_batch_size

    def make(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(
            0, CONFIG.vocab_size, (n, 64), generator=torch.Generator().manual_seed(n)
        )
        return {"input_ids": ids, "labels": ids}

    with vramctl.simulate("24MiB") as gpu:
        model, _ = quantized_llama("nf4", True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adapted = peft.get_peft_model(model, peft.LoraConfig(**QV))
        gpu.adopt(adapted)
        trained = [p for p in adapted.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in trained]
        packed = [
            m.weight.detach().clone() for m in adapted.modules() if isinstance(m, bnb.nn.Linear4bit)
        ]
        opt = torch.optim.AdamW(trained)

        def step(b: dict[str, torch.Tensor]) -> None:
            adapted(**b).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        fit = fit_batch_size(step, make, model=adapted, optimizer=opt, cache=False)
        after = [m.weight for m in adapted.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert all(torch.equal(a, b) for a, b in zip(before, trained, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(packed, after, strict=True))
        assert all(
            m.weight.quant_state is not None
            for m in adapted.modules()
            if isinstance(m, bnb.nn.Linear4bit)
        )
    assert fit.predicted is not None and fit.batch_size >= 4
    assert 0.75 * fit.batch_size <= fit.predicted <= fit.batch_size, fit
    assert len(fit.probes) <= 3


def test_the_dequantized_weight_is_a_transient_in_the_compute_dtype() -> None:
    """One big layer: the forward holds its packed weight and, for the matrix multiply, the
    whole weight in bf16; after the step nothing of it stays."""
    model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 16, bias=False))
    x = torch.randn(2, 4096)
    est = vramctl.estimate(
        model, x, device="cpu", precision="bf16", mode="infer", quant=QuantSpec("nf4", skip=("1",))
    )
    packed = 4096 * 4096 // 2
    assert est.peak_allocated > packed + 4096 * 4096 * 2  # the bf16 transient
    assert est.peak_allocated < packed + 4096 * 4096 * 2 + 4096 * 4096 // 64 * 4 + 10**6
    assert est.quant is not None and "1 linear layers" in est.quant


def test_the_users_model_is_left_as_it_was() -> None:
    model = llama()
    before = {n: (p.dtype, p.shape) for n, p in model.named_parameters()}
    vramctl.estimate(model, batch(), device="cpu", quant="nf4")
    assert {n: (p.dtype, p.shape) for n, p in model.named_parameters()} == before
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_a_hugging_face_quantization_config_is_read() -> None:
    bnb4 = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
    }
    assert quant_spec(bnb4) == QuantSpec("nf4", 4, None, True)
    assert quant_spec({"quant_method": "bitsandbytes", "load_in_8bit": True}).method == "int8"
    gptq = quant_spec({"quant_method": "gptq", "bits": 4, "group_size": 32})
    assert (gptq.method, gptq.bits, gptq.group_size) == ("gptq", 4, 32)
    assert quant_spec(transformers.BitsAndBytesConfig(load_in_4bit=True)).method == "fp4"


@pytest.mark.parametrize(
    ("value", "options", "message"),
    [
        ("int3", {}, "unknown format 'int3'"),
        ("int8", {"double_quant": True}, "double quantization is bitsandbytes' 4-bit only"),
        ("nf4", {"group_size": 64}, "nf4 takes no group size"),
        ({"quant_method": "hqq"}, {}, "quant_method 'hqq' is not supported"),
        (QuantSpec("gptq", bits=5), {}, "GPTQ takes 2, 3, 4 or 8 bits"),
    ],
)
def test_bad_quantizations_are_one_clear_line(value: Any, options: dict, message: str) -> None:
    with pytest.raises(EstimateError, match=message):
        quant_spec(value, **options)


def test_a_model_without_linear_layers_cannot_be_quantized() -> None:
    with pytest.raises(EstimateError, match="no linear layer nf4 can take"):
        vramctl.estimate(nn.Conv2d(3, 8, 3), torch.randn(1, 3, 8, 8), device="cpu", quant="nf4")


def test_the_json_names_the_quantization() -> None:
    est = vramctl.estimate(llama(), batch(), device="cpu", quant="int8", adapter=QV)
    doc = json.loads(json.dumps(est.to_dict()))
    assert doc["quant"].startswith("int8 (bitsandbytes): 14 linear layers")
    assert doc["adapter"].startswith("LORA r=8")


def test_the_command_line_takes_quant(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from vramctl.cli._app import app

    config = tmp_path / "config.json"
    config.write_text(CONFIG.to_json_string())
    args = ["estimate", str(config), "--batch", "2", "--seq-len", "32", "--device", "cpu"]
    qlora = ["--quant", "nf4", "--double-quant", "--kbit-prep", "--lora", "r=8,targets=q_proj"]
    result = CliRunner().invoke(app, [*args, *qlora, "--precision", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert (doc["inputs"]["quant"], doc["inputs"]["double_quant"]) == ("nf4", True)
    assert doc["inputs"]["kbit_prep"] is True
    assert doc["inputs"]["quantization"].startswith("nf4 (bitsandbytes), double quantization")
    text = CliRunner().invoke(app, [*args, "--quant", "gptq", "--group-size", "32"])
    assert text.exit_code == 0, text.output
    assert "quantized: gptq (GPTQ), 4 bits, groups of 32" in " ".join(text.output.split())
    for bad, message in [
        (["--quant", "int3"], "unknown format 'int3'"),
        (["--group-size", "64"], "--group-size and --kbit-prep go with --quant"),
        (["--quant", "int8", "--double-quant"], "bitsandbytes' 4-bit only"),
    ]:
        out = CliRunner().invoke(app, [*args, *bad])
        assert out.exit_code != 0 and message in " ".join(out.output.split()), out.output


def test_kbit_prep_keeps_what_is_not_quantized_in_fp32_as_peft_does() -> None:
    """``prepare_model_for_kbit_training`` (without its checkpointing) on a bitsandbytes nf4
    Llama, then LoRA: the norms, embeddings and ``lm_head`` in fp32, the activations
    between layers too."""
    peft = pytest.importorskip("peft")
    model, states = quantized_llama("nf4", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        adapted = peft.get_peft_model(model, peft.LoraConfig(**QV))
    real = cpu_step_peak(adapted, batch(), StepSpec(precision="bf16")) + states
    kw: dict[str, Any] = {"device": "cpu", "precision": "bf16", "adapter": QV, "quant": "nf4"}
    est = vramctl.estimate(llama(), batch(), kbit_prep=True, **kw)
    assert abs(est.peak_allocated - real) / real < 1e-4, (est.peak_allocated, real)
    assert est.peak_allocated > vramctl.estimate(llama(), batch(), **kw).peak_allocated
    with pytest.raises(EstimateError, match="kbit_prep goes with quant"):
        vramctl.estimate(llama(), batch(), device="cpu", kbit_prep=True)


def _llama_1b_width(layers: int) -> Any:
    """A Llama config of a 1B model's widths (2048 wide, 32k words) with ``layers`` layers."""
    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
    )


def test_the_largest_batch_of_a_quantized_model_is_larger() -> None:
    """``max_batch_size`` takes ``quant`` as ``estimate`` does: on a 16 GB GPU a Llama
    config of 16 layers in QLoRA (nf4) fits a larger batch than in LoRA on a bf16 base (50
    against 46). With 8 layers the weights nf4 saves are worth a few samples, and a loop's
    second step bounds both at 81: there the cached blocks are split otherwise (the bf16
    logits land in the block the fp32 logits had), and a new 1.2 GiB segment follows."""
    config = _llama_1b_width(layers=16)
    kw: dict[str, Any] = {"seq_len": 128, "device": "T4-16GB", "precision": "bf16", "adapter": QV}
    lora = vramctl.max_batch_size(config, **kw)
    qlora = vramctl.max_batch_size(config, quant="nf4", **kw)
    assert qlora.estimate is not None and qlora.estimate.quant is not None
    assert qlora.batch_size > lora.batch_size > 0


def test_a_config_that_carries_a_quantization_config_is_quantized() -> None:
    """A quantized checkpoint's config.json carries its ``quantization_config``: estimated by
    its config, the model is quantized as it says; ``quant=`` may repeat it, not contradict
    it; a format not modelled leaves the weights in their dtype, with a note."""
    config = transformers.LlamaConfig(**CONFIG.to_dict())
    config.quantization_config = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
    }
    kw: dict[str, Any] = {"batch_size": 4, "seq_len": 64, "device": "cpu", "precision": "bf16"}
    carried = vramctl.estimate(config, **kw)
    assert carried.quant is not None and carried.quant.startswith("nf4 (bitsandbytes), double")
    same = vramctl.estimate(config, quant=QuantSpec("nf4", double_quant=True), **kw)
    assert same.peak_allocated == carried.peak_allocated
    with pytest.raises(EstimateError, match=r"config carries nf4 .* quant asks for int8"):
        vramctl.estimate(config, quant="int8", **kw)
    config.quantization_config = {"quant_method": "mxfp4"}
    plain = vramctl.estimate(config, **kw)
    assert plain.quant is None
    assert any("quant_method 'mxfp4'" in n for n in plain.notes)


def test_the_fine_tuning_pages_qlora_answer_holds() -> None:
    """docs/finetune.md's QLoRA command for Llama-3.1-8B on an L4, run as written: it fits,
    at the 8.8 GiB the page gives."""
    from typer.testing import CliRunner

    from vramctl.cli._app import app

    root = Path(__file__).parents[2]
    page = (root / "docs" / "finetune.md").read_text()
    lines = [
        "vramctl estimate docs/examples/llama-3.1-8b --lora r=16,alpha=32,targets=all-linear",
        "    --quant nf4 --double-quant --precision bf16 --checkpointing --batch 1 --seq-len 1024",
        "    --device L4-24GB",
    ]
    command = " \\\n".join(lines)
    assert command in page
    args = command.replace("\\\n", " ").split()[1:]
    args[1] = str(root / args[1])
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    est = json.loads(result.output)["estimates"][0]
    assert est["fits"] is True
    assert f"{est['peak_device_bytes'] / 2**30:.1f} GiB: fits" in page


def test_a_loop_whose_later_steps_split_cached_blocks_says_so() -> None:
    """QLoRA on a 16 GB GPU at batch 76: the second step is served from the blocks the
    first step (which made its cuBLAS workspaces at their first products) left cached and
    split, and a new 1.2 GiB segment follows. The estimate is the loop's, says by how much
    its later steps reserve more, and names the remedy, which the allocator model prices:
    with max_split_size_mb:1024 no large block is split."""
    from vramctl.estimator import AllocatorConfig

    config = _llama_1b_width(layers=8)
    kw: dict[str, Any] = {
        "batch_size": 76,
        "seq_len": 128,
        "device": "T4-16GB",
        "precision": "bf16",
        "adapter": QV,
        "quant": "nf4",
    }
    split = vramctl.estimate(config, **kw)
    [note] = [n for n in split.notes if "later steps" in n]
    assert "1.16 GiB more than its first" in note and "max_split_size_mb" in note
    whole = vramctl.estimate(
        config, allocator_config=AllocatorConfig.from_conf("max_split_size_mb:1024"), **kw
    )
    assert not any("later steps" in n for n in whole.notes)
    assert whole.peak_reserved < split.peak_reserved - 2**29
    # The note prices the other remedy too: what the loop reserves with expandable segments.
    grown = vramctl.estimate(
        config, allocator_config=AllocatorConfig.from_conf("expandable_segments:True"), **kw
    )
    assert grown.peak_reserved < split.peak_reserved
    saved = format_bytes(split.peak_reserved - grown.peak_reserved)
    assert note.endswith(f"with expandable_segments:True the loop would reserve {saved} less")
    assert not any("later steps" in n for n in grown.notes)
