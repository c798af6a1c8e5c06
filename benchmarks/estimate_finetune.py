"""Fine-tuning estimates (LoRA built by PEFT, QLoRA on bitsandbytes' 4-bit layers) against
real training steps on the CPU.

Rows: shrunk decoder configs (Llama, Qwen2, Mistral, Gemma-style) x adapters (LoRA on q and v,
on every linear layer with dropout, with gradient checkpointing, with a trainable ``lm_head``,
on a bf16 base; QLoRA on nf4, on nf4 with double quantization after
``prepare_model_for_kbit_training``, and on fp4 on every linear layer; LoRA on torchao's
int8 and float8 weight-only layers) x train (and, in the full run, inference): the estimate of
``vramctl.estimate(model, batch, adapter=..., quant=...)`` against the real step's peak on the CPU
(PyTorch's profiler, after a warm-up step). Goals: median error <= 1%, max <= 3%, worst
under-estimate <= 2%.

The full run also prints, for full-size configs (Llama-3.1-8B, Qwen2.5-7B, Mistral-7B,
Llama-3.1-70B), the estimated peak of full fine-tuning (amp-bf16, AdamW), of LoRA (r=16 on
every linear layer, a bf16 base) and of QLoRA (the same on nf4 with double quantization) with
gradient checkpointing at batch 1 x 1024 tokens on an 80 GB and a 24 GB GPU, beside
Accelerate's ``estimate-memory`` figure for the same model (its own functions on the same
empty model).

    python benchmarks/estimate_finetune.py --quick
"""

from __future__ import annotations

import gc
import sys
import time
import warnings
from typing import Any

import _common

QUICK = "two configs, six adapters (one QLoRA, one torchao int8), train only; under a minute"

#: Shrunk decoder configs: small enough for a real CPU step in about a second.
SMALL = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "gemma": ("GemmaConfig", {"head_dim": 32}),
}
_SHRUNK = {
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
QV = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
#: name -> (LoRA settings, precision, gradient checkpointing, quantization, kbit prep)
#: (quantization: bitsandbytes 4-bit ``(kind, double quantization)``, run for real on the CPU)
ADAPTERS: dict[str, tuple[dict[str, Any], str, bool, tuple[str, bool] | None, bool]] = {
    "lora-qv": (QV, "fp32", False, None, False),
    "lora-all-dropout": (
        {"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "lora_dropout": 0.05},
        "fp32",
        False,
        None,
        False,
    ),
    "lora-qv-ckpt": (QV, "fp32", True, None, False),
    "lora-qv-lm-head": ({**QV, "modules_to_save": ["lm_head"]}, "fp32", False, None, False),
    "lora-qv-bf16": (QV, "bf16", False, None, False),
    "qlora-nf4": (QV, "bf16", False, ("nf4", False), False),
    "qlora-nf4-dq-kbit": (QV, "bf16", False, ("nf4", True), True),
    "qlora-fp4-all": (
        {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        "bf16",
        False,
        ("fp4", False),
        False,
    ),
}
#: torchao's weight-only formats, quantized for real by ``quantize_`` (they run on the CPU).
TORCHAO = {"int8-weight-only": "Int8WeightOnlyConfig", "fp8": "Float8WeightOnlyConfig"}
ADAPTERS["lora-qv-int8wo"] = (QV, "bf16", False, ("int8-weight-only", False), False)
ADAPTERS["lora-qv-fp8wo"] = (QV, "bf16", False, ("fp8", False), False)
QUICK_ROWS = (
    ("llama", "qwen2"),
    (
        "lora-qv",
        "lora-all-dropout",
        "lora-qv-ckpt",
        "lora-qv-bf16",
        "qlora-nf4-dq-kbit",
        "lora-qv-int8wo",
    ),
)

#: Full-size configs (their published config.json values that set the memory).
FULL_SIZE = {
    "Llama-3.1-8B": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
        ),
    ),
    "Qwen2.5-7B": (
        "Qwen2Config",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
        ),
    ),
    "Mistral-7B-v0.3": (
        "MistralConfig",
        dict(
            vocab_size=32768,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            sliding_window=None,
        ),
    ),
    "Llama-3.1-70B": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=131072,
        ),
    ),
}
FULL_SIZE_LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
GPUS = ("H100-80GB", "L4-24GB")


def config(kind: str, extra: dict[str, Any]) -> Any:
    import transformers

    return getattr(transformers, kind)(**{**_SHRUNK, **extra})


def build(cfg: Any) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def batch(cfg: Any, size: int = 4, length: int = 64) -> dict[str, Any]:
    import torch

    ids = torch.randint(
        0, cfg.vocab_size, (size, length), generator=torch.Generator().manual_seed(1)
    )
    return {"input_ids": ids, "labels": ids}


def quantize(model: Any, kind: str, double: bool) -> int:
    """Quantize ``model``'s linear layers but its output head (``lm_head``, ``classifier``,
    ``score``, as transformers leaves them) with bitsandbytes 4-bit, in place; the bytes of
    their quantization states (not parameters or buffers)."""
    import bitsandbytes as bnb
    import torch
    from torch import nn

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name not in ("lm_head", "classifier", "score"):
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.bfloat16,
                    quant_type=kind,
                    compress_statistics=double,
                )
                # The weight is quantized as it moves (Params4bit.to), on its own: moving the
                # module may keep the old parameter and take only the new data, without its
                # quantization state. module= lets the layer recover that state, as
                # transformers' loading sets it.
                weight = bnb.nn.Params4bit(
                    child.weight.data,
                    requires_grad=False,
                    quant_type=kind,
                    compress_statistics=double,
                    blocksize=64,
                    module=q,
                )
                q.weight = weight.to("cpu")
                setattr(module, name, q)
    model.is_loaded_in_4bit = True  # as transformers marks a model it quantized
    held: dict[int, int] = {}
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            parts = [state.absmax, state.code]
            if state.nested:
                parts += [state.state2.absmax, state.state2.code, state.offset]
            for t in parts:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(held.values())


def measure(
    cfg: Any,
    lora: dict[str, Any],
    precision: str,
    ckpt: bool,
    mode: str,
    quant: tuple[str, bool] | None = None,
    kbit: bool = False,
) -> int:
    """The real peak of a PEFT step on the CPU (on bitsandbytes' quantized layers with
    ``quant``, after ``prepare_model_for_kbit_training`` with ``kbit``)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from vramctl.estimator._spec import StepSpec, prepare_model, warm_optimizer

    model = build(cfg)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    states = 0
    if quant and quant[0] in TORCHAO:
        import torchao.quantization as tq

        def linear(module: Any, fqn: str) -> bool:
            return isinstance(module, torch.nn.Linear) and not fqn.endswith("lm_head")

        tq.quantize_(model, getattr(tq, TORCHAO[quant[0]])(), filter_fn=linear)
    elif quant:
        states = quantize(model, *quant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kbit:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = get_peft_model(model, LoraConfig(**lora))
    spec = StepSpec(mode=mode, precision=precision, checkpointing=ckpt)
    prepare_model(model, spec)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = spec.make_optimizer(params) if mode == "train" else None
    if opt is not None:
        warm_optimizer(opt, params)
    data = batch(cfg)
    peak = _common.cpu_step_peak(model, data, spec, opt) + states
    del model, opt
    gc.collect()
    return peak


def estimate(
    cfg: Any,
    lora: dict[str, Any],
    precision: str,
    ckpt: bool,
    mode: str,
    quant: tuple[str, bool] | None = None,
    kbit: bool = False,
) -> int:
    import vramctl
    from vramctl.estimator._shared import quant_spec

    est = vramctl.estimate(
        build(cfg),
        batch(cfg),
        device="cpu",
        mode=mode,
        precision=precision,
        checkpointing=ckpt,
        adapter=lora,
        quant=quant_spec(quant[0], double_quant=quant[1]) if quant else None,
        kbit_prep=kbit,
    )
    return int(est.peak_allocated)


def full_size_table() -> list[dict[str, Any]]:
    """Full fine-tuning against LoRA for the full-size configs, and Accelerate's figure."""
    import torch
    import transformers
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    import vramctl
    from vramctl.estimator import QuantSpec

    rows = []
    for name, (kind, fields) in FULL_SIZE.items():
        cfg = getattr(transformers, kind)(**fields)
        with torch.device("meta"):  # no weights: what Accelerate's command builds
            empty = transformers.AutoModelForCausalLM.from_config(cfg)
        total, _ = calculate_maximum_sizes(empty)
        accelerate_train = int(max(estimate_training_usage(total, "bfloat16").values()))
        row: dict[str, Any] = {
            "model": name,
            "parameters": sum(p.numel() for p in empty.parameters()),
            "accelerate_training_bytes": accelerate_train,
        }
        qlora = {"adapter": FULL_SIZE_LORA, "quant": QuantSpec("nf4", double_quant=True)}
        for method, options in (
            ("full", {"precision": "amp-bf16"}),
            ("lora", {"precision": "bf16", "adapter": FULL_SIZE_LORA}),
            ("qlora", {"precision": "bf16", **qlora}),
        ):
            for gpu in GPUS:
                t0 = time.perf_counter()
                est = vramctl.estimate(
                    cfg, batch_size=1, seq_len=1024, device=gpu, checkpointing=True, **options
                )
                row[f"{method}_{gpu}"] = {
                    "peak_device_bytes": est.peak_device,
                    "peak_device_high_bytes": est.peak_device_high,
                    "fits": est.fits,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
        rows.append(row)
        print(_full_line(row), flush=True)
    return rows


def _full_line(row: dict[str, Any]) -> str:
    from vramctl import format_bytes

    cells = [f"{row['model']}: accelerate {format_bytes(row['accelerate_training_bytes'])}"]
    for method in ("full", "lora", "qlora"):
        for gpu in GPUS:
            r = row[f"{method}_{gpu}"]
            cells.append(
                f"{method} on {gpu} {format_bytes(r['peak_device_bytes'])}"
                f" ({'fits' if r['fits'] else 'does not fit'})"
            )
    return "; ".join(cells)


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(__doc__, quick=QUICK)
    args = _common.parse(ap, argv)
    t0 = time.perf_counter()
    kinds, adapters = QUICK_ROWS if args.quick else (tuple(SMALL), tuple(ADAPTERS))
    modes = ("train",) if args.quick else ("train", "infer")
    rows = []
    with _common.quiet():
        for kind in kinds:
            name, extra = SMALL[kind]
            cfg = config(name, extra)
            for adapter in adapters:
                lora, precision, ckpt, quant, kbit = ADAPTERS[adapter]
                for mode in modes:
                    if mode == "infer" and ckpt:
                        continue  # checkpointing changes nothing without backward
                    real = measure(cfg, lora, precision, ckpt, mode, quant, kbit)
                    est = estimate(cfg, lora, precision, ckpt, mode, quant, kbit)
                    err = round(100.0 * (est - real) / real, 3)
                    rows.append(
                        {
                            "config": kind,
                            "adapter": adapter,
                            "mode": mode,
                            "estimate": est,
                            "measured": real,
                            "error_pct": err,
                        }
                    )
                    print(
                        f"{kind:8s} {adapter:18s} {mode:5s} estimate {est:>10,} "
                        f"measured {real:>10,} error {err:+.3f}%",
                        flush=True,
                    )
    figures, ok = _common.accuracy_figures([(r["estimate"], r["measured"]) for r in rows])
    table = [] if args.quick else full_size_table()
    summary = {
        "benchmark": "estimate_finetune",
        "quick": args.quick,
        "machine": _common.machine(False),
        "peft": _common.version("peft"),
        "transformers": _common.version("transformers"),
        **figures,
        "by_row": {f"{r['config']} {r['adapter']} {r['mode']}": r["error_pct"] for r in rows},
        "full_size": table,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    return _common.finish(summary, ok)


if __name__ == "__main__":
    sys.exit(main())
