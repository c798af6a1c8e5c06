"""Quantized weights on the estimator's model, each linear layer holding what its library keeps.

An estimate with ``quant=`` builds its model as usual, then swaps each linear layer (but
the output head, which the libraries leave in its dtype, as they do embeddings and norms)
for a :class:`QuantLinear` on the meta device that holds exactly the storage its library
keeps, read from the libraries' sources and pinned per format by the tests against the
libraries themselves where they run:

- ``nf4`` and ``fp4`` (bitsandbytes ``Linear4bit``, blocks of 64): the 4-bit codes packed two
  to a ``uint8``, one fp32 ``absmax`` per block and the 16 fp32 values of the data type;
  with ``double_quant`` (bitsandbytes' ``compress_statistics``) the ``absmax`` are themselves
  quantized to ``uint8`` in blocks of 256 with one fp32 scale each, an fp32 offset, and a
  copy of the 256 fp32 values of the dynamic map: 4.127 bits a weight instead of 4.5;
- ``int8`` (bitsandbytes ``Linear8bitLt``, LLM.int8): ``int8`` weights and one fp32 scale per
  output row;
- ``gptq`` (``bits`` 2, 3, 4 or 8, ``group_size`` 128 by default): ``qweight`` and
  ``qzeros`` packed in ``int32``, fp16 ``scales`` per group and an ``int32`` ``g_idx`` per
  input;
- ``awq`` (4 bits, groups of 128): ``qweight`` and ``qzeros`` in ``int32``, fp16 ``scales``;
- ``int8-weight-only`` (torchao): ``int8`` weights, an fp32 scale and an ``int8`` zero
  point per output row; ``int4-weight-only`` (torchao, groups of 128): two weights a byte, a scale
  and a zero point per group in the compute dtype; ``fp8`` (torchao float8 weight-only):
  one byte a weight and an fp32 scale per output row.

A model whose layers bitsandbytes already quantized (``Linear4bit``, ``Linear8bitLt``: a
model loaded with ``BitsAndBytesConfig``, or a PEFT model over one) is priced the same way:
:func:`swap_library_layers` reads each layer's format, double quantization and dtype, and
swaps it for its :class:`QuantLinear` on a private copy, since the libraries' own weight
classes cannot hold fake tensors.

The matrix multiply dequantizes the weight into a transient in the compute dtype (the
input's), as the libraries' general paths do (bitsandbytes' ``dequantize_4bit`` then
``linear``, which it uses past 1536 rows on CUDA and always on the CPU); the backward does it
again for the input's gradient and keeps nothing else. Kernels that never materialize the
weight (bitsandbytes' small-batch CUDA kernels, torchao's int4 ``tinygemm``, Marlin and
ExLlama) use less: the estimate is their upper bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from vramctl.estimator._build import private_copy
from vramctl.estimator._spec import EstimateError

__all__ = [
    "QUANT_FORMATS",
    "QuantLinear",
    "QuantSpec",
    "apply_quant",
    "carried_quant",
    "describe_quant",
    "quant_spec",
    "quant_storage_ids",
    "storage_layout",
    "swap_library_layers",
]

#: The formats ``quant=`` takes, and the library each imitates.
QUANT_FORMATS = {
    "nf4": "bitsandbytes",
    "fp4": "bitsandbytes",
    "int8": "bitsandbytes",
    "gptq": "GPTQ",
    "awq": "AWQ",
    "int8-weight-only": "torchao",
    "int4-weight-only": "torchao",
    "fp8": "torchao",
}
#: Layers the libraries leave in their dtype, by name (transformers' defaults).
KEEP = ("lm_head", "output", "score", "classifier")
#: bitsandbytes' 4-bit block and the block its double quantization takes.
BNB_BLOCK, BNB_BLOCK2 = 64, 256


@dataclass(frozen=True)
class QuantSpec:
    """One quantization: its format, bits, group size and double quantization."""

    method: str
    bits: int = 4
    group_size: int | None = None
    double_quant: bool = False
    #: Layers left unquantized besides :data:`KEEP`, by name.
    skip: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: ``nf4 (bitsandbytes), double quantization``."""
        parts = [f"{self.method} ({QUANT_FORMATS[self.method]})"]
        if self.method in ("gptq",):
            parts.append(f"{self.bits} bits")
        if self.group_size and self.method in ("gptq", "awq", "int4-weight-only"):
            parts.append(f"groups of {self.group_size}")
        if self.double_quant:
            parts.append("double quantization")
        return ", ".join(parts)


def quant_spec(
    value: Any, *, group_size: int | None = None, double_quant: bool | None = None
) -> QuantSpec:
    """``value`` (a format's name, a :class:`QuantSpec`, or a Hugging Face
    ``quantization_config`` as a mapping or object) as a :class:`QuantSpec`."""
    if isinstance(value, QuantSpec):
        spec = value
    elif isinstance(value, str):
        method = value.strip().lower().replace("_", "-")
        if method not in QUANT_FORMATS:
            raise EstimateError(
                f"quant: unknown format {value!r}; formats: {', '.join(QUANT_FORMATS)}"
            )
        spec = QuantSpec(method, bits=8 if "8" in method else 4)
    else:
        spec = _from_hf(value)
    if group_size is not None:
        if group_size <= 0:
            raise EstimateError(f"quant: group size must be positive, got {group_size}")
        if spec.method not in ("gptq", "awq", "int4-weight-only"):
            raise EstimateError(f"quant: {spec.method} takes no group size")
        spec = dataclasses.replace(spec, group_size=group_size)
    if double_quant:
        if spec.method not in ("nf4", "fp4"):
            raise EstimateError(
                f"quant: double quantization is bitsandbytes' 4-bit only, not {spec.method}"
            )
        spec = dataclasses.replace(spec, double_quant=True)
    if spec.method in ("gptq", "awq", "int4-weight-only") and spec.group_size is None:
        spec = dataclasses.replace(spec, group_size=128)
    if spec.method == "gptq" and spec.bits not in (2, 3, 4, 8):
        raise EstimateError(f"quant: GPTQ takes 2, 3, 4 or 8 bits, not {spec.bits}")
    return spec


def _from_hf(config: Any) -> QuantSpec:
    """A transformers ``quantization_config`` (bitsandbytes, GPTQ, AWQ) as a spec."""
    doc = config if isinstance(config, Mapping) else getattr(config, "to_dict", lambda: None)()
    if not isinstance(doc, Mapping):
        raise EstimateError(f"quant: cannot read {type(config).__name__} as a quantization")
    raw = doc.get("quant_method", "")
    method = str(getattr(raw, "value", raw)).lower()  # transformers' enum, or its value
    skip = tuple(doc.get("llm_int8_skip_modules") or doc.get("modules_to_not_convert") or ())
    if method == "bitsandbytes":
        if doc.get("load_in_4bit"):
            kind = str(doc.get("bnb_4bit_quant_type", "fp4")).lower()
            return QuantSpec(kind, 4, None, bool(doc.get("bnb_4bit_use_double_quant")), skip)
        if doc.get("load_in_8bit"):
            return QuantSpec("int8", 8, skip=skip)
    if method == "gptq":
        return QuantSpec(
            "gptq", int(doc.get("bits", 4)), int(doc.get("group_size") or 128), skip=skip
        )
    if method == "awq":
        return QuantSpec(
            "awq", int(doc.get("bits", 4)), int(doc.get("group_size") or 128), skip=skip
        )
    raise EstimateError(
        f"quant: quantization_config with quant_method {method or 'missing'!r} is not "
        "supported; give one of: " + ", ".join(QUANT_FORMATS)
    )


def carried_quant(carried: Any, given: Any) -> tuple[Any, str | None]:
    """The quantization of a model whose config carries ``quantization_config``, with
    ``given`` (``quant=``) if any: ``(quantization, note)``. A format this module does not
    model leaves the weights in their dtype, with a note saying so; ``given`` that differs
    from what the config carries is an error."""
    try:
        spec = quant_spec(carried)
    except EstimateError:
        if given is not None:
            return given, None
        doc = carried if isinstance(carried, Mapping) else getattr(carried, "to_dict", dict)()
        method = doc.get("quant_method", "?") if isinstance(doc, Mapping) else "?"
        return None, (
            f"the config's quantization_config (quant_method {method!r}) is not modelled: "
            "its weights are priced in the step's dtype"
        )
    if given is None:
        return spec, None
    mine = quant_spec(given)
    if dataclasses.replace(mine, skip=spec.skip) != spec:
        raise EstimateError(
            f"quant: the model's config carries {spec.describe()}, and quant asks for "
            f"{mine.describe()}: give one of them"
        )
    return mine, None


def storage_layout(
    spec: QuantSpec, out_features: int, in_features: int, compute: torch.dtype
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What a quantized ``out x in`` linear layer holds: ``(name, shape, dtype)`` each, the
    weight's storage first. ``compute`` is the dtype of scales the library keeps in it."""
    n, o, k = out_features * in_features, out_features, in_features
    m = spec.method
    if m in ("nf4", "fp4"):
        blocks = math.ceil(n / BNB_BLOCK)
        parts = [("weight", ((n + 1) // 2, 1), torch.uint8), ("code", (16,), torch.float32)]
        if spec.double_quant:
            parts += [
                ("absmax", (blocks,), torch.uint8),
                ("absmax2", (math.ceil(blocks / BNB_BLOCK2),), torch.float32),
                ("code2", (256,), torch.float32),  # its dynamic map, a copy per layer
                ("offset", (), torch.float32),
            ]
        else:
            parts.append(("absmax", (blocks,), torch.float32))
        return parts
    if m == "int8":
        return [("weight", (o, k), torch.int8), ("SCB", (o,), torch.float32)]
    g = spec.group_size or 128
    groups = math.ceil(k / g)
    if m in ("gptq", "awq"):
        per = 32 // spec.bits if 32 % spec.bits == 0 else None
        if m == "gptq":
            rows = k // per if per else k * spec.bits // 32
            cols = o // per if per else o * spec.bits // 32
            return [
                ("weight", (rows, o), torch.int32),
                ("qzeros", (groups, cols), torch.int32),
                ("scales", (groups, o), torch.float16),
                ("g_idx", (k,), torch.int32),
            ]
        return [
            ("weight", (k, o // 8), torch.int32),
            ("qzeros", (groups, o // 8), torch.int32),
            ("scales", (groups, o), torch.float16),
        ]
    if m == "int8-weight-only":  # torchao's Int8Tensor: symmetric, a zero point all the same
        return [
            ("weight", (o, k), torch.int8),
            ("scale", (o, 1), torch.float32),
            ("zero_point", (o, 1), torch.int8),
        ]
    if m == "int4-weight-only":
        return [
            ("weight", (o, (k + 1) // 2), torch.uint8),
            ("scale", (o, groups), compute),
            ("zero_point", (o, groups), compute),
        ]
    if m == "fp8":
        return [("weight", (o, k), torch.float8_e4m3fn), ("scale", (o, 1), torch.float32)]
    raise EstimateError(f"quant: unknown format {m!r}")


#: Formats whose matrix multiply autograd sees through (torchao's int8 and float8
#: weight-only tensors: ``linear`` of the dequantized weight), where bitsandbytes' own
#: autograd function keeps nothing but the packed storage.
_AUTOGRAD_DEQUANT = ("int8-weight-only", "fp8")


class _Dequantized(torch.autograd.Function):
    """``linear`` through a dequantized transient weight, forward and backward; nothing
    kept for backward but the module's own storage."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layer: QuantLinear) -> Any:
        ctx.layer = layer
        ctx.has_bias = bias is not None
        w = layer.dequantize(x.dtype, direct=True)
        return nn.functional.linear(x, w, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = ctx.layer.dequantize(grad.dtype, direct=False)
            grad_x = torch.matmul(grad, w)
            del w
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad.sum(tuple(range(grad.dim() - 1)))
        return grad_x, grad_bias, None


class QuantLinear(nn.Linear):
    """A linear layer holding its library's quantized storage (``weight`` is the packed
    part); its matrix multiply dequantizes into a transient, as the library does."""

    def __init__(self, linear: nn.Linear, spec: QuantSpec, weight_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.spec = spec
        #: The dtype the weight had when it was quantized (bitsandbytes dequantizes to it
        #: in the backward).
        self.weight_dtype = weight_dtype
        parts = storage_layout(spec, self.out_features, self.in_features, weight_dtype)
        (_, shape, dtype), rest = parts[0], parts[1:]
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), False)
        for name, shape, dtype in rest:
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def dequantize(self, dtype: torch.dtype, direct: bool) -> torch.Tensor:
        """The transient weight in ``dtype``: bitsandbytes' forward dequantizes straight to
        it; its backward to the weight's own dtype, then casts."""
        shape = (self.out_features, self.in_features)
        device = self.weight.device
        scales = None
        if self.spec.double_quant:  # the absmax, dequantized to fp32 first
            blocks = math.ceil(self.in_features * self.out_features / BNB_BLOCK)
            scales = torch.empty(blocks, dtype=torch.float32, device=device)
        if self.spec.method == "fp8":  # torchao: the codes in fp32, times the scale, cast
            codes = torch.empty(shape, dtype=torch.float32, device=device)
            scales = torch.empty(shape, dtype=torch.float32, device=device)
            del codes
        first = dtype if direct or self.spec.method not in ("nf4", "fp4") else self.weight_dtype
        w = torch.empty(shape, dtype=first, device=device)
        del scales
        return w if w.dtype == dtype else w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bitsandbytes' Linear4bit: the input cast to the compute dtype (the weight's here,
        # as QLoRA sets it), the output back to the input's.
        given = x.dtype
        if x.is_floating_point() and x.dtype != self.weight_dtype:
            x = x.to(self.weight_dtype)
        bias: torch.Tensor | None = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if self.spec.method in _AUTOGRAD_DEQUANT:
            # torchao's weight-only tensors dequantize under autograd: the linear keeps the
            # dequantized weight for the input's gradient, from forward to backward.
            out = nn.functional.linear(x, self.dequantize(x.dtype, direct=True), bias)
        else:
            out = _Dequantized.apply(x, bias, self)  # type: ignore[no-untyped-call]
        return out if out.dtype == given else out.to(given)

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, {self.spec.describe()}"


def _linears(model: nn.Module, spec: QuantSpec) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    keep = set(KEEP) | set(spec.skip)
    out_head = getattr(model, "get_output_embeddings", lambda: None)()
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or child is out_head:
                continue
            if child_name in keep or full in keep:
                continue
            yield module, child_name, child


def apply_quant(model: nn.Module, quant: Any, dtype: torch.dtype | None) -> nn.Module:
    """A copy of ``model`` on the meta device with its linear layers quantized (``model``
    is left as it is and no weight is copied). ``dtype`` is the step's parameter dtype."""
    spec = quant_spec(quant)
    with _disable_current_modes():
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        copy = private_copy(model, {n: torch.empty_like(t, device="meta") for n, t in named})
        found = list(_linears(copy, spec))
        if not found:
            raise EstimateError(
                f"quant: {type(model).__name__} has no linear layer {spec.method} can take"
            )
        for parent, name, linear in found:
            setattr(parent, name, QuantLinear(linear, spec, dtype or linear.weight.dtype))
        copy.vramctl_quant = spec  # type: ignore[assignment]
    return copy


#: bitsandbytes' quantized linear layers, by class name (``LinearNF4`` and ``LinearFP4`` are
#: ``Linear4bit``'s subclasses).
_BNB_LAYERS = ("Linear4bit", "LinearNF4", "LinearFP4", "Linear8bitLt")


def _library_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Each of ``model``'s layers that bitsandbytes quantized, by name."""
    return {
        name: m
        for name, m in model.named_modules()
        if type(m).__name__ in _BNB_LAYERS
        and type(m).__module__.startswith("bitsandbytes")
        and isinstance(m, nn.Linear)
    }


def _library_spec(layer: nn.Linear) -> tuple[QuantSpec, torch.dtype]:
    """The format of a bitsandbytes layer and the dtype its weight had before."""
    weight = layer.weight
    if type(layer).__name__ == "Linear8bitLt":
        bias = layer.bias
        return QuantSpec("int8", bits=8), bias.dtype if bias is not None else torch.float16
    block = getattr(weight, "blocksize", BNB_BLOCK)
    if block != BNB_BLOCK:
        raise EstimateError(
            f"quant: a bitsandbytes 4-bit layer in blocks of {block}: only blocks of "
            f"{BNB_BLOCK} (bitsandbytes' default) are modelled"
        )
    state = getattr(weight, "quant_state", None)
    dtype = getattr(state, "dtype", None) or getattr(layer, "compute_dtype", None)
    spec = QuantSpec(
        str(getattr(weight, "quant_type", "fp4")),
        double_quant=bool(getattr(weight, "compress_statistics", False)),
    )
    return spec, dtype if isinstance(dtype, torch.dtype) else torch.float16


def swap_library_layers(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` on the meta device with each layer bitsandbytes quantized
    swapped for its :class:`QuantLinear` (``model`` is left as it is, and neither its
    weights nor their quantization states are copied); None where it has none."""
    layers = _library_layers(model)
    if not layers:
        return None
    specs = {name: _library_spec(layer) for name, layer in layers.items()}
    # the libraries' quantization states hold real tensors: not copied
    held = [
        obj
        for layer in layers.values()
        for obj in (
            getattr(layer.weight, "quant_state", None),
            getattr(layer, "quant_state", None),
            getattr(layer, "state", None),
        )
        if obj is not None
    ]
    with _disable_current_modes():
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        state = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in named}
        copy = private_copy(model, state, drop=held)
        for name, layer in _library_layers(copy).items():
            parent_name, _, child = name.rpartition(".")
            spec, dtype = specs[name]
            setattr(copy.get_submodule(parent_name), child, QuantLinear(layer, spec, dtype))
        if len({spec for spec, _ in specs.values()}) == 1:
            copy.vramctl_quant = next(iter(specs.values()))[0]  # type: ignore[assignment]
    return copy


def quant_storage_ids(model: nn.Module) -> set[int]:
    """The ids of the quantized layers' tensors, which keep their dtype when the rest of
    the model is cast (fp32 ``absmax``, fp16 ``scales``)."""
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            ids.update(id(t) for n, t in module.named_parameters(recurse=False) if n != "bias")
            ids.update(id(t) for t in module.buffers(recurse=False))
    return ids


def describe_quant(model: nn.Module) -> str | None:
    """One line: the format, how many layers, and their storage against 16-bit weights."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return None
    spec = layers[0].spec
    held = 0
    seen: set[int] = set()
    for m in layers:
        for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if n != "bias" and id(t) not in seen:
                seen.add(id(t))
                held += t.numel() * t.element_size()
    weights = sum(m.in_features * m.out_features for m in layers)
    return (
        f"{spec.describe()}: {len(layers)} linear layers, {held / weights * 8:.3f} bits a "
        f"weight ({held:,} bytes for {weights:,} weights)"
    )
