"""A convolution's cuDNN workspace: the recorded table, a line per kind of convolution fitted
to it, and the depthwise convolutions PyTorch does not run on cuDNN."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import vramctl
from vramctl.estimator import Calibration, CalibrationError, load_calibration
from vramctl.estimator._conv_workspace import (
    ConvCall,
    CudnnWorkspace,
    batch_free,
    conv_call,
    conv_key,
    workspace_lines,
)
from vramctl.estimator._cuda_model import builtin

MiB = 2**20
FWD = torch.ops.aten.convolution.default
BWD = torch.ops.aten.convolution_backward.default


def fwd_key(x: torch.Tensor, w: torch.Tensor, stride: int = 1, groups: int = 1) -> str:
    n = x.dim() - 2
    return conv_key(FWD, (x, w, None, [stride] * n, [0] * n, [1] * n, False, [0] * n, groups))


def test_a_key_gives_the_calls_kind_and_sizes() -> None:
    x, w = torch.empty(8, 64, 56, 56), torch.empty(128, 64, 3, 3)
    key = conv_key(FWD, (x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1))
    out = 8 * 128 * 28 * 28 * 4  # (56 + 2 - 2 - 1) // 2 + 1 = 28
    assert conv_call(key) == ConvCall(
        "forward:dense", max(x.nbytes, out), w.nbytes, dtype="float32"
    )
    # a transposed convolution's output is larger than its input
    wt = torch.empty(64, 32, 4, 4)
    key = conv_key(FWD, (x, wt, None, [2, 2], [1, 1], [1, 1], True, [0, 0], 1))
    assert conv_call(key) == ConvCall(
        "forward:dense", 8 * 32 * 112 * 112 * 4, wt.nbytes, dtype="float32"
    )
    # pointwise, with and without a stride; grouped; a backward reads its output gradient
    assert conv_call(fwd_key(x, torch.empty(32, 64, 1, 1))).kind == "forward:pointwise"
    assert (
        conv_call(fwd_key(x, torch.empty(32, 64, 1, 1), stride=2)).kind
        == "forward:pointwise-strided"
    )
    assert conv_call(fwd_key(x, torch.empty(64, 16, 3, 3), groups=4)).kind == "forward:grouped"
    g = torch.empty(8, 256, 56, 56)
    bkey = conv_key(
        BWD,
        (g, x, torch.empty(256, 64, 1, 1), [0], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
         [True, True, False]),
    )  # fmt: skip
    assert conv_call(bkey) == ConvCall(
        "backward:pointwise", g.nbytes, 256 * 64 * 4, dtype="float32"
    )
    assert conv_call("convolution(other)") is None
    assert conv_call("matmul(float32[2, 2],float32[2, 2])") is None


def test_a_depthwise_convolution_is_on_cudnn_only_channels_last_or_in_half() -> None:
    x, w = torch.empty(8, 96, 56, 56), torch.empty(96, 1, 3, 3)
    plain = conv_call(fwd_key(x, w, groups=96))
    assert plain is not None and plain.kind == "forward:depthwise" and not plain.cudnn
    # a 1-d one too (a Mamba block's causal convolution)
    assert not conv_call(fwd_key(torch.empty(2, 64, 100), torch.empty(64, 1, 4), groups=64)).cudnn
    cl = x.to(memory_format=torch.channels_last)
    assert conv_call(fwd_key(cl, w, groups=96)).cudnn
    assert conv_call(fwd_key(x.half(), w.half(), groups=96)).cudnn
    # no workspace for PyTorch's own depthwise kernels, whatever the line says
    ws = CudnnWorkspace(3.0, 2**30, MiB, lines={"forward:depthwise": (MiB, 1.0, 1.0)})
    out = [torch.empty(8, 96, 56, 56)]
    assert ws(FWD, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 96), {}, out) == 0
    args = (cl, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 96)
    assert ws(FWD, args, {}, out) == MiB + cl.nbytes + w.nbytes


def test_a_kinds_line_lies_on_or_above_each_call_and_as_low_as_it_can() -> None:
    def key(n: int, c: int) -> str:
        return fwd_key(torch.empty(n, c, 8, 8), torch.empty(c, c, 3, 3))

    # points on one line, fixed 1 MiB + 2 x activation + 3 x weight: the fit is that line
    table: dict[str, int] = {}
    for n, c in ((1, 64), (4, 64), (2, 128), (8, 32), (3, 96)):
        call = conv_call(key(n, c))
        assert call is not None
        table[key(n, c)] = MiB + 2 * call.activation + 3 * call.weight
    fixed, per_act, per_weight = workspace_lines(table)["forward:dense"]
    assert per_act == pytest.approx(2, abs=0.002)
    assert per_weight == pytest.approx(3, abs=0.002)
    assert fixed == pytest.approx(MiB, rel=0.05)
    # scattered points: every one on or below the line
    table = {key(n, c): (n * c * 7919) % (5 * MiB) for n in (1, 2, 4, 8) for c in (16, 64, 96)}
    line = workspace_lines(table)["forward:dense"]
    for k, nbytes in table.items():
        call = conv_call(k)
        assert call is not None
        assert line[0] + line[1] * call.activation + line[2] * call.weight >= nbytes
    # too few calls of a kind give it no line; calls PyTorch runs off cuDNN give none
    assert workspace_lines(dict(list(table.items())[:3])) == {}
    dw = {
        fwd_key(torch.empty(n, 32, 8, 8), torch.empty(32, 1, 3, 3), groups=32): MiB
        for n in range(1, 9)
    }
    assert workspace_lines(dw) == {}


def test_a_calls_dtype_and_a_weight_only_backward_take_lines_of_their_own() -> None:
    """cuDNN runs a half-precision convolution on other kernels (tensor cores) than a
    float32 one, and a backward that computes no input gradient (a network's first
    convolution) as its weight-gradient call alone: each gets its own line where the table
    holds enough of its calls, and a call takes the most specific line there is. On the
    H200 float32's forward dense line had no fixed part, where the kind's had 3.1 MiB (the
    bfloat16 patch embeddings'); shrunk ViT inference went from 11.7% over to 3.6%."""

    def key(n: int, c: int, dtype: torch.dtype) -> str:
        return fwd_key(torch.empty(n, c, 8, 8, dtype=dtype), torch.empty(c, c, 3, 3, dtype=dtype))

    sizes = ((1, 64), (4, 64), (2, 128), (8, 32))
    table: dict[str, int] = {}
    for n, c in sizes:
        fp32, bf16 = conv_call(key(n, c, torch.float32)), conv_call(key(n, c, torch.bfloat16))
        assert fp32 is not None and bf16 is not None and fp32.dtype == "float32"
        assert bf16.typed_kind == "forward:dense:bfloat16"
        table[key(n, c, torch.float32)] = fp32.activation  # no fixed part
        table[key(n, c, torch.bfloat16)] = 3 * MiB + bf16.activation
    lines = workspace_lines(table)
    assert lines["forward:dense:float32"][0] == 0
    assert lines["forward:dense:bfloat16"][0] == pytest.approx(3 * MiB, rel=0.01)
    assert lines["forward:dense"][0] >= lines["forward:dense:bfloat16"][0]
    ws = CudnnWorkspace(0.0, 2**40, lines={k: lines[k] for k in ("forward:dense:float32",)})
    x = torch.empty(2, 64, 8, 8)
    conv = (x, torch.empty(64, 64, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    out = [torch.empty(2, 64, 6, 6)]
    fixed, per_act, per_weight = lines["forward:dense:float32"]
    call = conv_call(conv_key(FWD, conv))
    assert call is not None
    want = fixed + per_act * call.activation + per_weight * call.weight
    assert ws(FWD, conv, {}, out) == pytest.approx(want, abs=1)
    # a bfloat16 call with no line of its dtype takes its kind's; with neither, the one line
    half = tuple(a.bfloat16() if isinstance(a, torch.Tensor) else a for a in conv)
    assert ws(FWD, half, {}, out) == 0  # ratio 0 and no fixed part: the one line gives 0
    ws.lines = {**ws.lines, "forward:dense": (7 * MiB, 0.0, 0.0)}
    assert ws(FWD, half, {}, out) == 7 * MiB

    # a backward without the input's gradient: its own kind, priced by the whole
    # backward's lines where it has none of its own
    g = torch.empty(2, 64, 6, 6)
    weight_only = (g, x, conv[1], [0], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                   [False, True, False])  # fmt: skip
    both = (*weight_only[:10], [True, True, False])
    wcall, bcall = conv_call(conv_key(BWD, weight_only)), conv_call(conv_key(BWD, both))
    assert wcall is not None and bcall is not None
    assert wcall.kind == "backward-weight:dense" and bcall.kind == "backward:dense"
    assert wcall.line_kinds == [
        "backward-weight:dense:float32",
        "backward-weight:dense",
        "backward:dense:float32",
        "backward:dense",
    ]
    ws = CudnnWorkspace(0.0, 2**40, lines={"backward:dense": (5 * MiB, 0.0, 0.0)})
    assert ws(BWD, weight_only, {}, [g]) == 5 * MiB
    ws.lines = {**ws.lines, "backward-weight:dense": (MiB, 0.0, 0.0)}
    assert ws(BWD, weight_only, {}, [g]) == MiB
    assert ws(BWD, both, {}, [g]) == 5 * MiB
    # the whole backward's line is fitted over the weight-only calls too
    table = {}
    for n, c in sizes:
        for mask in ([False, True, False], [True, True, False]):
            gk = torch.empty(n, c, 6, 6)
            args = (gk, torch.empty(n, c, 8, 8), torch.empty(c, c, 3, 3), [0], [1, 1], [0, 0],
                    [1, 1], False, [0, 0], 1, mask)  # fmt: skip
            table[conv_key(BWD, args)] = (9 if mask[0] else 1) * MiB
    lines = workspace_lines(table)
    assert lines["backward-weight:dense"][0] == pytest.approx(MiB, rel=0.01)
    assert lines["backward:dense"][0] == pytest.approx(9 * MiB, rel=0.01)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 64, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_an_unrecorded_convolution_takes_its_kinds_line_before_the_one_line(
    tmp_path: Path,
) -> None:
    """Through an estimate: the recorded call's bytes, else the kind's line, else the one
    line; the lines are saved and read back with the profile."""
    x = torch.randn(8, 16, 64, 64)
    w = Conv().conv.weight
    key = conv_key(FWD, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
    call = conv_call(key)
    assert call is not None and call.kind == "forward:dense"
    base = replace(
        builtin("NVIDIA A10G", None), cudnn_workspace_ratio=3.0, cudnn_workspace_fixed=6 * MiB
    )

    def run(cal: Calibration) -> int:
        est = vramctl.estimate(Conv(), x, mode="infer", device="A10G-24GB", calibration=cal)
        return est.peak_allocated

    none = run(replace(base, cudnn_workspace_ratio=0.0, cudnn_workspace_fixed=0))
    out = 8 * 64 * 64 * 64 * 4
    assert run(base) - none == 6 * MiB + 3 * out
    lined = replace(base, cudnn_workspace_lines={"forward:dense": (MiB, 0.5, 2.0)})
    assert run(lined) - none == MiB + call.activation // 2 + 2 * call.weight
    # another kind's line leaves it on the one line; a recorded call takes its bytes
    other = replace(base, cudnn_workspace_lines={"forward:pointwise": (0, 0.0, 0.0)})
    assert run(other) == run(base)
    recorded = replace(lined, cudnn_workspaces={key: 5 * MiB})
    assert run(recorded) - none == 5 * MiB
    back = load_calibration(lined.save(tmp_path / "p.json").path or "")
    assert back.cudnn_workspace_lines == {"forward:dense": (MiB, 0.5, 2.0)}
    for bad in ({"forward:dense": [1, 2]}, {"forward:dense": [-1, 0, 0]}, [1, 2, 3]):
        doc = lined.to_dict()
        doc["constants"]["cudnn_workspace_lines"] = bad
        with pytest.raises(CalibrationError, match="cudnn_workspace_lines"):
            Calibration.from_dict(doc)


def test_the_probes_keys_are_the_keys_of_its_calls() -> None:
    """``probe_keys`` gives the keys the calibration's convolutions are called with, so that
    a profile's measured calls join its table (run here on meta tensors: same calls)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vramctl.estimator._conv_workspace import CONVOLUTIONS, probe_keys

    class Keys(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.keys: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in (FWD, BWD):
                self.keys.append(conv_key(func, args))
            return func(*args, **(kwargs or {}))

    for label, dims, cin, cout, k, stride, pad, groups, shape in CONVOLUTIONS:
        cls = nn.Conv1d if dims == 1 else nn.Conv2d
        conv = cls(cin, cout, k, stride=stride, padding=pad, groups=groups, device="meta")
        x = torch.empty(shape, device="meta", requires_grad=True)
        with Keys() as mode:
            out = conv(x)
            torch.autograd.grad(out, [x, conv.weight, conv.bias], torch.ones_like(out))
        assert mode.keys == list((probe_keys(label, "float32") or {}).values()), label
    assert probe_keys("no such probe", "float32") is None


def test_a_forward_takes_its_recorded_workspace_with_or_without_a_bias() -> None:
    """PyTorch adds a convolution's bias after cuDNN's call: a forward recorded with a bias
    gives its workspace to the same call without one (the calibration's probes have one, a
    ResNet's convolutions none). A backward's bias gradient is part of its call."""
    from vramctl.estimator._conv_workspace import unbiased

    x, w, b = torch.empty(8, 3, 224, 224), torch.empty(64, 3, 7, 7), torch.empty(64)
    conv = ([2, 2], [3, 3], [1, 1], False, [0, 0], 1)
    with_bias, without = conv_key(FWD, (x, w, b, *conv)), conv_key(FWD, (x, w, None, *conv))
    assert with_bias != without and unbiased(with_bias) == unbiased(without)
    ws = CudnnWorkspace(3.0, 2**30, MiB, table={with_bias: 7 * MiB})
    assert ws(FWD, (x, w, None, *conv), {}, [torch.empty(8, 64, 112, 112)]) == 7 * MiB
    g = torch.empty(8, 64, 112, 112)
    bwd = conv_key(BWD, (g, x, w, [64], *conv, [True, True, True]))
    assert unbiased(bwd) == bwd


def test_a_calibration_puts_its_measured_convolutions_in_the_table() -> None:
    """``fit_constants``: each measured call by its key (recorded, or given by its label
    and dtype in profiles from before keys were recorded), and a line per kind with four
    calls or more (the probe's dense convolutions, in two dtypes)."""
    from vramctl.estimator._calibration import fit_constants
    from vramctl.estimator._conv_workspace import CONVOLUTIONS, probe_keys

    rows = []
    for dtype in ("float32", "bfloat16"):
        for i, spec in enumerate(CONVOLUTIONS):
            for p in ("forward", "backward"):
                rows.append(
                    {
                        "conv": spec[0],
                        "dtype": dtype,
                        "pass": p,
                        "output_bytes": MiB,
                        "workspace_bytes": (i + 1) * MiB,
                    }
                )
    rows[0]["key"] = "convolution(recorded)"
    cal, _ = fit_constants({"cudnn": rows}, builtin("NVIDIA A10G", None))
    stem = probe_keys(CONVOLUTIONS[0][0], "bfloat16")
    assert stem is not None and cal.cudnn_workspaces[stem["forward"]] == MiB
    assert cal.cudnn_workspaces["convolution(recorded)"] == MiB
    assert len(cal.cudnn_workspaces) == len(rows)
    assert {"forward:dense", "backward:dense"} <= set(cal.cudnn_workspace_lines)
    assert cal.cudnn_workspace_lines == workspace_lines(cal.cudnn_workspaces)


def test_a_call_recorded_at_a_smaller_and_a_larger_batch_takes_no_more_than_both() -> None:
    """Between two recorded batches a call takes the lesser of its kind's line and the
    larger recording; outside them, or with one side only, its kind's line."""
    w = torch.empty(64, 16, 3, 3)

    def key(batch: int) -> str:
        return fwd_key(torch.empty(batch, 16, 32, 32), w)

    assert batch_free(key(2)) == (key(2).replace("float32[2,", "float32[*,"), 2)
    g, x = torch.empty(4, 64, 30, 30), torch.empty(4, 16, 32, 32)
    bkey = conv_key(
        BWD, (g, x, w, [0], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
    )
    free = batch_free(bkey)
    assert free is not None and free[1] == 4 and free[0].count("[*,") == 2
    assert batch_free("matmul(float32[2, 2])") is None

    line = (MiB, 1.0, 1.0)
    ws = CudnnWorkspace(
        0.0, 1 << 30, table={key(1): 1000, key(4): 3000}, lines={"forward:dense": line}
    )

    def charged(cw: CudnnWorkspace, batch: int) -> int:
        x = torch.empty(batch, 16, 32, 32, device="meta")
        out = torch.empty(batch, 64, 30, 30, device="meta")
        return cw(FWD, (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}, [out])

    def on_line(batch: int) -> int:
        call = conv_call(key(batch))
        assert call is not None
        return MiB + call.activation + call.weight

    assert charged(ws, 1) == 1000 and charged(ws, 4) == 3000  # recorded
    assert charged(ws, 2) == charged(ws, 3) == 3000 < on_line(2)  # bracketed
    assert charged(ws, 8) == on_line(8)  # no larger recording
    none = CudnnWorkspace(0.0, 1 << 30, table={key(1): 0, key(4): 0}, lines={"forward:dense": line})
    assert charged(none, 2) == 0
    # the line stays where it is lower than the recordings
    big = CudnnWorkspace(
        0.0, 1 << 30, table={key(1): 1 << 29, key(4): 1 << 29}, lines={"forward:dense": line}
    )
    assert charged(big, 2) == on_line(2)


def test_a_key_in_any_dtype_gives_its_element_size() -> None:
    x = torch.empty(2, 16, 8, 8, dtype=torch.float8_e4m3fnuz, device="meta")
    w = torch.empty(32, 16, 3, 3, dtype=torch.float8_e4m3fnuz, device="meta")
    call = conv_call(fwd_key(x, w))
    assert call is not None and call.weight == 32 * 16 * 9
    assert conv_call("convolution(notadtype[2, 3],notadtype[2, 3])") is None
