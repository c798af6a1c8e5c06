"""The cases a capture records, in priority order, and how each is built and estimated.

A case's spec is plain JSON, so that the offline check can rebuild exactly what ran:

- ``kind``: ``zoo`` (a built-in model by ``model``), ``hf`` (a transformers class from
  ``config``, a config's ``to_dict()``, with ``model_type`` and ``task``), ``torchvision`` or
  ``timm`` (a CNN by ``model``), ``rnn`` (an LSTM or GRU by ``model``), ``attention`` (one
  attention block on ``F.scaled_dot_product_attention``);
- ``mode``, ``precision``, ``batch_size``, ``lengths`` (``seq_len``, ``seconds`` or
  ``image_size``) and ``checkpointing``, as :func:`vramctl.estimate` takes them;
- ``max_new_tokens`` and ``cache`` for ``mode="generate"`` (a greedy ``generate`` after a
  prompt of ``seq_len`` tokens, as :func:`vramctl.estimate` takes them);
- ``options``: what the estimator has no argument for: ``sdpa_backend`` (``flash``,
  ``efficient``, ``math``), ``grad_scaler``, ``expandable_segments``, ``prefetch_stream``
  (the next batch copied on a second stream during the step) and ``cudnn_tf32`` (False:
  TF32 off for cuDNN).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ZOO = [
    # (model, lengths): the same lengths as estimate_accuracy's rows
    ("gpt2", {"seq_len": 128}),
    ("bert-base", {"seq_len": 128}),
    ("t5-small", {"seq_len": 128}),
    ("whisper-base", {"seq_len": 64}),
    ("wav2vec2-base", {"seconds": 2.0}),
    ("hubert-base", {"seconds": 2.0}),
    ("vit-base", {}),
    ("resnet-50", {}),
    ("convnext-tiny", {}),
    ("lstm", {"seq_len": 128}),
]
#: The zoo's large models: a capture runs them last (each case builds 1-7 billion weights).
ZOO_LARGE = [
    ("llama-1b", {"seq_len": 128}),
    ("llama-7b", {"seq_len": 128}),
]
BATCHES = (1, 4)
MODES = ("train", "infer")
PRECISIONS = ("fp32", "amp-bf16")
#: transformers classes: (task, model type), shrunk as estimate_coverage shrinks them.
HF = [
    ("causal-lm", "gpt2"),
    ("causal-lm", "llama"),
    ("causal-lm", "mistral"),
    ("causal-lm", "qwen2"),
    ("causal-lm", "qwen3"),
    ("causal-lm", "gemma"),
    ("causal-lm", "phi"),
    ("causal-lm", "opt"),
    ("causal-lm", "gpt_neox"),
    ("causal-lm", "falcon"),
    ("causal-lm", "mixtral"),
    ("causal-lm", "qwen3_moe"),
    ("causal-lm", "mamba"),
    ("causal-lm", "bloom"),
    ("masked-lm", "bert"),
    ("masked-lm", "roberta"),
    ("masked-lm", "distilbert"),
    ("masked-lm", "electra"),
    ("masked-lm", "deberta-v2"),
    ("seq-classification", "albert"),
    ("seq2seq-lm", "t5"),
    ("seq2seq-lm", "bart"),
    ("seq2seq-lm", "pegasus"),
    ("seq2seq-lm", "mt5"),
    ("speech-seq2seq", "whisper"),
    ("speech-seq2seq", "speech_to_text"),
    ("ctc", "wav2vec2"),
    ("ctc", "hubert"),
    ("ctc", "wavlm"),
    ("image-classification", "vit"),
    ("image-classification", "convnext"),
    ("image-classification", "resnet"),
    ("image-classification", "swin"),
    ("image-classification", "deit"),
]
HF_BATCH = 2
HF_LENGTHS = {"seq_len": 32, "seconds": 1.0}
TORCHVISION = ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "densenet121"]
TIMM = ["resnet26d", "efficientnet_b0", "convnext_atto"]
CNN_BATCH = 8
CNN_SIZE = 224
#: generate cases: a shrunk Llama's greedy generate, (precision, cache) each; the offloaded
#: cache needs a GPU.
GENERATE = [("fp32", "dynamic"), ("fp32", "static"), ("bf16", "dynamic"), ("fp32", "offloaded")]
GENERATE_BATCH = 4
GENERATE_LENGTHS = {"seq_len": 128}
GENERATE_NEW = 64


def case_id(spec: dict[str, Any]) -> str:
    """``kind/model/mode/precision/bN`` and the options that differ from the default."""
    parts = [spec["kind"], spec["model"], spec["mode"], spec["precision"], f"b{spec['batch_size']}"]
    if spec.get("checkpointing"):
        parts.append("ckpt")
    if spec["mode"] == "generate":
        parts.append(f"{spec['cache']}-new{spec['max_new_tokens']}")
    for key, value in sorted((spec.get("options") or {}).items()):
        parts.append(key if value is True else f"{key}-{value}")
    return "/".join(parts)


def _spec(kind: str, model: str, mode: str, precision: str, batch: int, **extra: Any) -> dict:
    spec = {
        "kind": kind,
        "model": model,
        "mode": mode,
        "precision": precision,
        "batch_size": batch,
        "lengths": extra.pop("lengths", {}),
        "checkpointing": extra.pop("checkpointing", False),
        "options": extra.pop("options", {}),
        **extra,
    }
    spec["id"] = case_id(spec)
    return spec


def all_cases(cuda: bool = True) -> list[dict[str, Any]]:
    """Every case, in the order a capture runs them (the most valuable first).

    The zoo comes first (its 1B and 7B models last of all), then what only a GPU shows,
    then transformers classes and CNNs. Without ``cuda`` (a simulated capture) the cases
    that only mean something on a GPU (the SDPA backends, a second stream, fp16 with a
    scaler) are left out; expandable segments are simulated by the allocator model.
    """
    out = _zoo(ZOO)
    for cell in ("lstm", "gru"):
        for mode in MODES:
            for b in (1, 16):
                out.append(_spec("rnn", cell, mode, "fp32", b, lengths={"seq_len": 128}))
    if cuda:
        # the same GRU with TF32 off for cuDNN: whether its fp32 workspace still holds the
        # weights' bytes (estimator/_cuda_rnn.py)
        for mode in MODES:
            no_tf32 = {"cudnn_tf32": False}
            out.append(
                _spec("rnn", "gru", mode, "fp32", 16, lengths={"seq_len": 128}, options=no_tf32)
            )
        for backend in ("flash", "efficient", "math"):
            for mode in MODES:
                sdpa = {"sdpa_backend": backend}
                long = {"seq_len": 1024}
                out.append(
                    _spec("attention", "sdpa", mode, "amp-bf16", 4, lengths=long, options=sdpa)
                )
        out.append(_gpt2("train", "amp-fp16", options={"grad_scaler": True}))
    out.append(_gpt2("train", checkpointing=True))
    out.append(
        _spec("zoo", "bert-base", "train", "fp32", 4, lengths={"seq_len": 128}, checkpointing=True)
    )
    # (simulated: through the allocator model's expandable segments)
    out += [_gpt2(mode, options={"expandable_segments": True}) for mode in MODES]
    if cuda:
        out.append(_gpt2("train", options={"prefetch_stream": True}))
    for precision, cache in GENERATE:
        if cache != "offloaded" or cuda:
            kw = {"max_new_tokens": GENERATE_NEW, "cache": cache, "task": "causal-lm"}
            lengths = dict(GENERATE_LENGTHS)
            out.append(
                _spec("hf", "llama", "generate", precision, GENERATE_BATCH, lengths=lengths, **kw)
            )
    for task, model_type in HF:
        for mode in MODES:
            out.append(
                _spec("hf", model_type, mode, "fp32", HF_BATCH, task=task, lengths=dict(HF_LENGTHS))
            )
    for lib, names in (("torchvision", TORCHVISION), ("timm", TIMM)):
        for name in names:
            for mode in MODES:
                out.append(
                    _spec(lib, name, mode, "fp32", CNN_BATCH, lengths={"image_size": CNN_SIZE})
                )
    out += _zoo(ZOO_LARGE)
    return out


def _gpt2(mode: str, precision: str = "fp32", **extra: Any) -> dict[str, Any]:
    """A zoo GPT-2 case at batch 4 of 128 tokens, the one each GPU-only option is tried on."""
    return _spec("zoo", "gpt2", mode, precision, 4, lengths={"seq_len": 128}, **extra)


def _zoo(models: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [
        _spec("zoo", name, mode, precision, b, lengths=lengths)
        for name, lengths in models
        for mode in MODES
        for precision in PRECISIONS
        for b in BATCHES
    ]


# -- building a case ----------------------------------------------------------------------


class Attention(nn.Module):
    """One attention block on ``F.scaled_dot_product_attention`` (16 heads of 64)."""

    def __init__(self, dim: int = 1024, heads: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Recurrent(nn.Module):
    """A two-layer LSTM or GRU of 512 over 256-wide inputs, batch first."""

    def __init__(self, cell: str) -> None:
        super().__init__()
        kind = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = kind(256, 512, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def hf_config(spec: dict[str, Any]) -> Any:
    """The transformers config of an ``hf`` case: the recorded one, or a shrunk default."""
    import transformers

    cls = transformers.CONFIG_MAPPING[spec["model"]]
    if spec.get("config"):
        return cls.from_dict(spec["config"])
    from estimate_coverage import shrink  # benchmarks/ is on sys.path

    return shrink(cls(), "hidden")


def import_vision(name: str) -> Any:
    """Import torchvision or timm (``name``), also where torchvision's C++ operators do not load.

    The only torchvision wheel for some PyTorch releases is built against PyTorch's CUDA build;
    beside the CPU build its C++ library does not load, and its import then fails registering
    fake kernels for operators that do not exist (``operator torchvision::nms does not exist``).
    Those are detection operators (NMS, RoI align, deformable convolution), which no
    classification model calls, so torchvision is imported again without those registrations.
    """
    try:
        return importlib.import_module(name)
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[key]
    sys.modules["torchvision._meta_registrations"] = types.ModuleType(
        "torchvision._meta_registrations"
    )
    return importlib.import_module(name)


def vision_ready() -> None:
    """Import torchvision first where it is installed (see :func:`import_vision`):
    transformers imports it too, for its image models, and takes a failed import as a
    missing module for every model class."""
    if importlib.util.find_spec("torchvision") is not None:
        import_vision("torchvision")


def module_factory(spec: dict[str, Any]) -> tuple[Callable[[], nn.Module], Callable[[int], Any]]:
    """``(build, batch_of)`` for a case that is not a zoo or config model."""
    kind, name = spec["kind"], spec["model"]
    lengths = spec.get("lengths") or {}
    if kind == "attention":
        t = int(lengths.get("seq_len", 1024))
        return Attention, lambda b: torch.randn(b, t, 1024)
    if kind == "rnn":
        t = int(lengths.get("seq_len", 128))
        return (lambda: Recurrent(name)), lambda b: torch.randn(b, t, 256)
    side = int(lengths.get("image_size", CNN_SIZE))
    if kind == "torchvision":
        models = import_vision("torchvision.models")
        fn = getattr(models, name)
        return (lambda: fn(weights=None)), lambda b: torch.randn(b, 3, side, side)
    if kind == "timm":
        timm = import_vision("timm")
        return (lambda: timm.create_model(name, pretrained=False)), (
            lambda b: torch.randn(b, 3, side, side)
        )
    raise ValueError(f"unknown case kind {kind!r}")


def _output_loss(out: Any, batch: Any) -> torch.Tensor:
    t = out if isinstance(out, torch.Tensor) else out[0]
    return t.float().square().mean()


@dataclass
class Built:
    model: nn.Module
    batch: Any
    #: What ``estimate`` needs besides the model: ``batch`` and ``loss_fn`` or lengths.
    estimate_kwargs: dict[str, Any]


def build(spec: dict[str, Any], device: str) -> Built:
    """The case's model and a batch on ``device`` (weights random, seed 0)."""
    from vramctl.estimator import zoo
    from vramctl.estimator._hub import config_model

    vision_ready()
    torch.manual_seed(0)
    kind, b = spec["kind"], spec["batch_size"]
    lengths = dict(spec.get("lengths") or {})
    with torch.device(device):
        if kind == "zoo":
            model = zoo.build(spec["model"])
            batch = zoo.make_batch(spec["model"], b, labels=spec["mode"] == "train", **lengths)
            kwargs: dict[str, Any] = {"batch_size": b, **lengths}
        elif kind == "hf":
            cfg = hf_config(spec)
            # What ran, whatever this transformers release's defaults are: the offline
            # check rebuilds the model from it.
            spec.setdefault("config", json.loads(cfg.to_json_string(use_diff=False)))
            cm = config_model(cfg, task=spec["task"], image_size=lengths.get("image_size"))
            model = cm.build()
            sizes = {} if cm.inputs == "images" else lengths
            batch = cm.make_batch(b, labels=spec["mode"] == "train", **sizes)
            kwargs = {"batch_size": b, "task": spec["task"], **sizes}
        else:
            make, batch_of = module_factory(spec)
            model = make()
            batch = batch_of(b)
            kwargs = {"batch": batch_of, "batch_size": b, "loss_fn": _output_loss}
    if getattr(getattr(model, "config", None), "layerdrop", 0.0):
        model.config.layerdrop = 0.0
    batch = _fill(batch, device)
    return Built(model, batch, kwargs)


def _fill(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: _fill(v, device) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device)
        if batch.is_floating_point():
            batch.normal_()
    return batch


def estimate_args(spec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """``(model source, batch, lengths, options)`` as :func:`vramctl.estimate` takes them."""
    vision_ready()
    kind = spec["kind"]
    lengths = {k: v for k, v in (spec.get("lengths") or {}).items() if v is not None}
    opts: dict[str, Any] = {
        "mode": spec["mode"],
        "precision": spec["precision"],
        "checkpointing": bool(spec.get("checkpointing")),
    }
    if spec["mode"] == "generate":
        opts.update(max_new_tokens=spec["max_new_tokens"], cache=spec["cache"])
    if (spec.get("options") or {}).get("prefetch_stream"):
        opts["side_streams"] = True  # the case copies its next batch on a side stream
    if kind == "zoo":
        return spec["model"], None, lengths, opts
    if kind == "hf":
        if "image_size" in lengths:
            lengths = {"image_size": lengths["image_size"]}
        image = lengths.pop("image_size", None)
        if image is not None:
            opts["image_size"] = image
        return hf_config(spec), None, lengths, {**opts, "task": spec["task"]}
    make, batch_of = module_factory(spec)
    return make, batch_of, {}, {**opts, "loss_fn": _output_loss}


def estimate_case(
    spec: dict[str, Any],
    device: Any,
    calibration: Any = False,
    allocator_config: Any = None,
    recorded: bool = False,
) -> Any:
    """The estimator's prediction for a case, on ``device`` (a GPU's name or a Target).

    ``recorded``: the case's figures come from a step recorded operator by operator (under
    a ``TorchDispatchMode``), where autograd sums every gradient out of place; the estimate
    models that step rather than a plain one (see :func:`recorded_per_call`)."""
    from vramctl.estimator import estimate
    from vramctl.estimator._trace import sums_out_of_place

    source, batch, lengths, opts = estimate_args(spec)
    if allocator_config is None:
        allocator_config = case_allocator(spec)  # as the case ran
    # under the case's options, as a user who forced an attention backend estimates
    with (
        options_applied(spec, "cpu"),
        sums_out_of_place() if recorded else contextlib.nullcontext(),
    ):
        return estimate(
            source,
            batch,
            batch_size=spec["batch_size"],
            device=device,
            calibration=calibration,
            allocator_config=allocator_config,
            **lengths,
            **opts,
        )


def case_allocator(spec: dict[str, Any]) -> Any:
    """The caching allocator's configuration a case ran under: expandable segments where
    its options say so, else PyTorch's defaults (None)."""
    from vramctl.estimator import AllocatorConfig

    if (spec.get("options") or {}).get("expandable_segments"):
        return AllocatorConfig.from_conf("expandable_segments:True")
    return None


def recorded_per_call(index: dict[str, Any]) -> bool:
    """Whether a corpus' figures come from steps recorded operator by operator.

    ``capture`` records each step under a ``TorchDispatchMode`` that numbers the operator
    calls, and the step's peaks are read around that recorded step. While any such mode is
    active ATen takes every tensor for a subclass, and autograd's engine then sums two
    gradients for one input out of place (``InputBuffer::accumulate``), where a plain step
    adds the second into the first: a tied embedding's gradient, or an activation's with
    two consumers, is held once more at that moment. Corpora from ``capture`` (``cuda``,
    ``simulated``) were recorded so; a ``summary`` corpus says so in ``recorded_per_call``
    (the suite's capture step did; the first H200 run, measured plainly, did not)."""
    return bool(index.get("recorded_per_call", index.get("source") in ("cuda", "simulated")))


@contextlib.contextmanager
def options_applied(spec: dict[str, Any], device: str) -> Iterator[dict[str, Any]]:
    """The case's options around its steps: the SDPA backend, cuDNN's TF32, expandable
    segments."""
    opts = spec.get("options") or {}
    with contextlib.ExitStack() as stack:
        backend = opts.get("sdpa_backend")
        if backend:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            pick = {
                "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH,
            }[backend]
            stack.enter_context(sdpa_kernel(pick))
        if opts.get("cudnn_tf32") is False:
            was = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False
            stack.callback(setattr, torch.backends.cudnn, "allow_tf32", was)
        if opts.get("expandable_segments") and device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            stack.callback(torch.cuda.memory._set_allocator_settings, "expandable_segments:False")
            stack.callback(torch.cuda.empty_cache)
        yield opts
