"""A convolution's cuDNN workspace on a CUDA target.

A calibration profile can carry the workspace recorded on its GPU for each convolution call
seen in a recorded corpus (``cudnn_workspaces``, keyed by :func:`conv_key`); a call in that
table takes its recorded bytes. Any other call takes a line fitted to the table's calls of
its own kind (``cudnn_workspace_lines``): the kinds differ by much (a depthwise forward
recorded no workspace on the H200 at all, a 3x3 convolution's holds about its weight, a
strided 1x1's three times its output), so one line over every call overcharges most of them.
A kind is also fitted per dtype (half precision runs on other kernels: float32's forward
dense line on the H200 has no fixed part, the kind's 3.1 MiB), and a backward that computes
no input gradient (``backward-weight``: cuDNN's weight-gradient call alone) is a kind of
its own, whose calls the whole backward's lines lie above too.
A line lies on or above every recorded call of its kind, as low as it can: ``fixed`` bytes,
plus ``per_activation`` times the largest activation the call reads or writes, plus
``per_weight`` times its weight's bytes. A kind with too few recorded calls, and a profile
without a table, take the profile's one line over its measured convolutions
(``cudnn_workspace_fixed`` plus ``cudnn_workspace_ratio`` times the call's largest output).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CONVOLUTIONS",
    "CONV_OPS",
    "MIN_LINE_POINTS",
    "ConvCall",
    "CudnnWorkspace",
    "WorkspaceLine",
    "batch_free",
    "conv_call",
    "conv_key",
    "probe_keys",
    "probe_table",
    "unbiased",
    "workspace_lines",
]

#: The operators that take a cuDNN workspace.
CONV_OPS = {
    torch.ops.aten.convolution.default,
    torch.ops.aten.convolution_backward.default,
}

#: The convolutions ``vramctl calibrate`` measures: (label, dims, in channels, out
#: channels, kernel, stride, padding, groups, input shape), each a module with a bias, run
#: forward and backward (the input's gradient too) in each dtype.
CONVOLUTIONS: tuple[tuple[str, int, int, int, int, int, int, int, tuple[int, ...]], ...] = (
    ("resnet stem 7x7/2", 2, 3, 64, 7, 2, 3, 1, (8, 3, 224, 224)),
    ("resnet 3x3", 2, 64, 64, 3, 1, 1, 1, (8, 64, 56, 56)),
    ("resnet 1x1", 2, 256, 64, 1, 1, 0, 1, (8, 256, 56, 56)),
    ("convnext depthwise 7x7", 2, 96, 96, 7, 1, 3, 96, (8, 96, 56, 56)),
    ("wav2vec2 feature conv 10/5", 1, 1, 512, 10, 5, 0, 1, (4, 1, 32000)),
    ("wav2vec2 feature conv 3/2", 1, 512, 512, 3, 2, 0, 1, (4, 512, 6399)),
    ("wav2vec2 positional conv 128, 16 groups", 1, 768, 768, 128, 1, 64, 16, (4, 768, 99)),
)

#: A kind's line is fitted only from at least this many distinct recorded calls.
MIN_LINE_POINTS = 4

#: ``(fixed bytes, per activation byte, per weight byte)``.
WorkspaceLine = tuple[int, float, float]

_TENSOR = re.compile(r"(\w+)\[([\d, ]*)\](?::channels_last)?$")


def conv_key(func: Any, args: tuple[Any, ...]) -> str:
    """What a convolution's cuDNN workspace follows: the operator, each tensor's dtype,
    shape and memory format, and the other arguments (stride, padding, groups, which
    gradients). A recorded table of workspaces is keyed by it."""

    def part(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            fmt = ""
            if (
                a.dim() == 4
                and not a.is_contiguous()
                and a.is_contiguous(memory_format=torch.channels_last)
            ):
                fmt = ":channels_last"
            return f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}{fmt}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(part(x) for x in a) + "]"
        return repr(a)

    return f"{func.overloadpacket.__name__}(" + ",".join(part(a) for a in args) + ")"


def unbiased(key: str) -> str:
    """A key as the workspace follows it: a forward's without its bias. PyTorch adds the
    bias after cuDNN's call (``_convolution``: ``output.add_(bias)``), so a convolution
    with a bias takes the workspace of the same one without. A backward's bias gradient is
    a reduction inside the call, and keeps it."""
    if not key.startswith("convolution(") or not key.endswith(")"):
        return key
    parts = _split(key[len("convolution(") : -1])
    if len(parts) < 3:
        return key
    parts[2] = "bias"
    return "convolution(" + ",".join(parts) + ")"


def probe_keys(label: str, dtype: str) -> dict[str, str] | None:
    """The :func:`conv_key` of the forward and the backward of the probe convolution
    ``label`` (:data:`CONVOLUTIONS`) in ``dtype`` (``"float32"``); None for another label."""
    spec = next((c for c in CONVOLUTIONS if c[0] == label), None)
    torch_dtype = getattr(torch, dtype, None)
    if spec is None or not isinstance(torch_dtype, torch.dtype):
        return None
    _, dims, cin, cout, k, stride, pad, groups, shape = spec

    def empty(*size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch_dtype, device="meta")

    x, w, b = empty(*shape), empty(cout, cin // groups, *[k] * dims), empty(cout)
    conv = (x, w, b, [stride] * dims, [pad] * dims, [1] * dims, False, [0] * dims, groups)
    out = torch.ops.aten.convolution.default(*conv)
    backward = (out, x, w, [cout], *conv[3:], [True, True, True])
    return {
        "forward": conv_key(torch.ops.aten.convolution.default, conv),
        "backward": conv_key(torch.ops.aten.convolution_backward.default, backward),
    }


def probe_table(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The workspace of each probe convolution a calibration measured (its ``cudnn``
    readings), by key: the one it recorded, else the one its label and dtype give."""
    table: dict[str, int] = {}
    for r in rows:
        key = r.get("key")
        if not isinstance(key, str):
            keys = probe_keys(str(r.get("conv")), str(r.get("dtype")))
            key = keys.get(str(r.get("pass"))) if keys else None
        nbytes = r.get("workspace_bytes")
        if key and isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 0:
            table[key] = max(table.get(key, 0), nbytes)
    return table


@dataclass(frozen=True)
class ConvCall:
    """What a convolution call's workspace line reads: its ``kind`` (the pass, ``forward``
    or ``backward``, and the filter, ``depthwise``, ``grouped``, ``pointwise`` (every
    kernel dimension 1, stride 1), ``pointwise-strided`` or ``dense``, as
    ``"forward:dense"``), the bytes of the largest activation it reads or writes and of
    its weight.

    ``cudnn`` is whether PyTorch runs it on cuDNN at all. It does not run a depthwise
    convolution there unless a tensor is channels-last or it is in float16
    (``ConvParams::use_cudnn_depthwise``); PyTorch's own depthwise kernels take the rest,
    and they make no workspace."""

    kind: str
    activation: int
    weight: int
    cudnn: bool = True
    dtype: str = ""

    @property
    def typed_kind(self) -> str:
        """The kind with the call's dtype, as ``"forward:dense:float32"``: a half-precision
        call runs on other cuDNN kernels (tensor cores) than a float32 one, and takes other
        workspaces. On the H200, float32's forward dense line has no fixed part, where
        bfloat16's has 2.6 MiB."""
        return f"{self.kind}:{self.dtype}" if self.dtype else self.kind

    @property
    def line_kinds(self) -> list[str]:
        """The kinds whose lines price this call, the most specific first: its kind with its
        dtype, its kind, and for a backward that computes no input gradient
        (``"backward-weight"``: cuDNN's weight-gradient call alone, as for a network's first
        convolution) the same of a whole backward, whose lines lie above its calls too."""
        kinds = [self.typed_kind, self.kind] if self.dtype else [self.kind]
        if self.kind.startswith("backward-weight:"):
            kinds += [k.replace("backward-weight:", "backward:", 1) for k in kinds]
        return kinds


def _split(text: str) -> list[str]:
    """Top-level comma-separated parts (brackets nest)."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _tensor(text: str) -> tuple[int, list[int]] | None:
    """``(element bytes, shape)`` of a key's tensor part."""
    m = _TENSOR.match(text.strip())
    dtype = getattr(torch, m.group(1), None) if m is not None else None
    if m is None or not isinstance(dtype, torch.dtype):
        return None
    return dtype.itemsize, [int(x) for x in m.group(2).split(",") if x.strip()]


def _on_cudnn_depthwise(parts: list[str]) -> bool:
    """Whether PyTorch takes a depthwise convolution to cuDNN: where a tensor is
    channels-last, or in float16 (where cuDNN's depthwise kernels take some shapes; all
    are counted, so that none is under-counted)."""
    return any(p.strip().endswith(":channels_last") for p in parts) or any(
        p.strip().startswith("float16[") for p in parts
    )


def _dtype(text: str) -> str:
    """The dtype's name of a key's tensor part (``"float32"``)."""
    return text.strip().partition("[")[0]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.strip().strip("[]").split(",") if x.strip()]


def batch_free(key: str) -> tuple[str, int] | None:
    """``(the key with its batch left out, the batch)``: the activations' leading size (a
    forward's input, a backward's output gradient and input)."""
    op, _, rest = key.partition("(")
    if op not in ("convolution", "convolution_backward") or not rest.endswith(")"):
        return None
    parts = _split(rest[:-1])
    batch = 0
    for i in range(1 if op == "convolution" else 2):
        m = re.match(r"(\w+)\[(\d+)(.*)$", parts[i].strip())
        if m is None:
            return None
        batch = int(m.group(2))
        parts[i] = f"{m.group(1)}[*{m.group(3)}"
    return op + "(" + ",".join(parts) + ")", batch


def conv_call(key: str) -> ConvCall | None:
    """The :class:`ConvCall` of a :func:`conv_key`; None where the key is not one."""
    op, _, rest = key.partition("(")
    if op not in ("convolution", "convolution_backward") or not rest.endswith(")"):
        return None
    parts = _split(rest[:-1])
    try:
        if op == "convolution":
            x, w = _tensor(parts[0]), _tensor(parts[1])
            if x is None or w is None or len(parts) < 9:
                return None
            stride, padding, dilation = _ints(parts[3]), _ints(parts[4]), _ints(parts[5])
            transposed, groups = parts[6].strip() == "True", int(parts[8])
            (size, xs), (_, ws) = x, w
            dtype = _dtype(parts[0])
            if transposed:
                out_channels = ws[1] * groups
                spatial = [
                    (i - 1) * s - 2 * p + d * (k - 1) + 1
                    for i, k, s, p, d in zip(xs[2:], ws[2:], stride, padding, dilation, strict=True)
                ]
            else:
                out_channels = ws[0]
                spatial = [
                    (i + 2 * p - d * (k - 1) - 1) // s + 1
                    for i, k, s, p, d in zip(xs[2:], ws[2:], stride, padding, dilation, strict=True)
                ]
            out = size * xs[0] * out_channels * math.prod(spatial)
            activation = max(size * math.prod(xs), out)
            in_channels = xs[1]
            pass_ = "forward"
        else:
            g, x, w = _tensor(parts[0]), _tensor(parts[1]), _tensor(parts[2])
            if g is None or x is None or w is None or len(parts) < 10:
                return None
            transposed, groups = parts[7].strip() == "True", int(parts[9])
            stride = _ints(parts[4])
            (size, gs), (_, xs), (_, ws) = g, x, w
            dtype = _dtype(parts[0])
            activation = size * max(math.prod(gs), math.prod(xs))
            in_channels = xs[1]
            mask = parts[10].strip() if len(parts) > 10 else ""
            pass_ = "backward-weight" if mask.startswith("[False") else "backward"
    except (ValueError, IndexError):
        return None
    weight = size * math.prod(ws)
    if groups > 1 and groups == in_channels and not transposed:
        kind = "depthwise"
        if not _on_cudnn_depthwise(parts):
            return ConvCall(f"{pass_}:{kind}", activation, weight, cudnn=False, dtype=dtype)
    elif groups > 1:
        kind = "grouped"
    elif all(k == 1 for k in ws[2:]):
        # strided, it reads a subsampled input (cuDNN picks other algorithms)
        kind = "pointwise" if all(v == 1 for v in stride) else "pointwise-strided"
    else:
        kind = "dense"
    return ConvCall(f"{pass_}:{kind}", activation, weight, dtype=dtype)


def _minimize(f: Callable[[float], float], hi: float, steps: int = 80) -> float:
    """Where a convex function of one variable on ``[0, hi]`` is lowest (ternary search)."""
    lo = 0.0
    for _ in range(steps):
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if f(m1) <= f(m2):
            hi = m2
        else:
            lo = m1
    return (lo + hi) / 2


def _line(points: list[tuple[int, int, int]]) -> WorkspaceLine:
    """The line ``fixed + a * activation + b * weight`` on or above every ``(activation,
    weight, workspace)`` point, all three at least 0, that minimises its total over the
    points: a linear programme in three unknowns whose objective, with ``fixed`` set to
    the least that keeps the line above the points, is convex in ``(a, b)``, so nested
    one-dimensional searches find its optimum."""
    n = len(points)
    total_a = sum(p[0] for p in points)
    total_w = sum(p[1] for p in points)

    def fixed(a: float, b: float) -> float:
        return max(0.0, max(y - a * x - b * w for x, w, y in points))

    def cost(a: float, b: float) -> float:
        return n * fixed(a, b) + a * total_a + b * total_w

    a_hi = max((y / x for x, _, y in points if x > 0), default=0.0)
    b_hi = max((y / w for _, w, y in points if w > 0), default=0.0)

    def best_a(b: float) -> float:
        return _minimize(lambda a: cost(a, b), a_hi) if a_hi > 0 else 0.0

    b = _minimize(lambda b: cost(best_a(b), b), b_hi, steps=60) if b_hi > 0 else 0.0
    a = best_a(b)
    # rounded up, and the fixed part set after, so that the line stays above every point
    a, b = math.ceil(a * 1000) / 1000, math.ceil(b * 1000) / 1000
    return math.ceil(fixed(a, b)), a, b


def workspace_lines(table: Mapping[str, int]) -> dict[str, WorkspaceLine]:
    """A line per kind of convolution (:class:`ConvCall`) over a recorded table's calls, and
    one per kind and dtype (:attr:`ConvCall.typed_kind`), for each with at least
    :data:`MIN_LINE_POINTS` distinct calls."""
    by_kind: dict[str, set[tuple[int, int, int]]] = {}
    for key, nbytes in table.items():
        call = conv_call(key)
        if call is not None and call.cudnn:
            point = (call.activation, call.weight, nbytes)
            for kind in call.line_kinds:
                by_kind.setdefault(kind, set()).add(point)
    return {
        kind: _line(sorted(points))
        for kind, points in sorted(by_kind.items())
        if len(points) >= MIN_LINE_POINTS
    }


class CudnnWorkspace:
    """A convolution's cuDNN workspace: the bytes recorded for that very call on this GPU
    (``table``, by :func:`conv_key`; a forward's with or without a bias), else its kind's
    line (``lines``), at most what the table holds for it at a smaller and a larger batch
    (:meth:`bracketed`), else
    ``fixed`` plus ``ratio`` times its largest output; at most ``cap``. A depthwise
    convolution PyTorch does not run on cuDNN makes none. ``keys`` lists each
    convolution's key in the step's order."""

    def __init__(
        self,
        ratio: float,
        cap: int,
        fixed: int = 0,
        table: Mapping[str, int] | None = None,
        lines: Mapping[str, WorkspaceLine] | None = None,
    ) -> None:
        self.ratio, self.cap, self.fixed, self.calls = ratio, cap, fixed, 0
        self.table: dict[str, int] = {}
        for k, nbytes in (table or {}).items():
            self.table[unbiased(k)] = max(self.table.get(unbiased(k), 0), nbytes)
        self.lines = lines or {}
        self.keys: list[str] = []
        self.by_batch: dict[str, dict[int, int]] = {}
        for k, nbytes in self.table.items():
            got = batch_free(k)
            if got is not None:
                self.by_batch.setdefault(got[0], {})[got[1]] = nbytes

    def bracketed(self, key: str) -> float:
        """The most a call may take whose convolution the table holds at a smaller and a
        larger batch: the larger of those two recordings (infinity where it holds no such
        pair). cuDNN's heuristics may pick another algorithm at another batch, so the call
        is given the lesser of this and its kind's line, not a recording. Of the six calls
        the H200 table holds at three batches, one took more at the middle one than at
        both others, by 272 bytes. ConvNeXt's 2x2 downsampling took its weight's bytes at
        batch 1 and 4, where its kind's line gives 7.5 MB at batch 2."""
        got = batch_free(unbiased(key))
        if got is None:
            return math.inf
        seen = self.by_batch.get(got[0], {})
        lower = [b for b in seen if b < got[1]]
        upper = [b for b in seen if b > got[1]]
        if not lower or not upper:
            return math.inf
        return max(seen[max(lower)], seen[min(upper)])

    def __call__(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
    ) -> int:
        if func not in CONV_OPS or not outs:
            return 0
        self.calls += 1
        key = conv_key(func, args)
        self.keys.append(key)
        if unbiased(key) in self.table:
            return self.table[unbiased(key)]
        call = conv_call(key)
        if call is not None and not call.cudnn:
            return 0
        line = None
        if call is not None:
            line = next((self.lines[k] for k in call.line_kinds if k in self.lines), None)
        if call is not None and line is not None:
            fixed, per_activation, per_weight = line
            nbytes = fixed + per_activation * call.activation + per_weight * call.weight
            return min(math.ceil(min(nbytes, self.bracketed(key))), self.cap)
        biggest = max(t.untyped_storage().nbytes() for t in outs)
        return min(self.fixed + int(biggest * self.ratio), self.cap)
