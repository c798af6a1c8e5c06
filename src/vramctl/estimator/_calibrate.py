"""Measuring a GPU's CUDA constants: the procedure behind ``vramctl calibrate``.

:func:`measure` runs in a process that has not used CUDA yet, so that what it
reads is the CUDA context and workspaces alone:

1. **Allocator.** With nothing allocated, single ``uint8`` tensors of chosen
   sizes are made one at a time, the cache emptied between them; the growth of
   ``memory_reserved`` is the segment the caching allocator made for each, and
   the growth of ``memory_allocated`` the rounded block. From them: the
   smallest block, the small and large pools' boundary, the small and large
   segment sizes, the size from which a request gets a segment of its own, and
   the rounding of such segments.
2. **cuBLAS.** The allocator bytes the first fp32 matrix multiply and the first
   bf16 linear layer with a bias (cuBLASLt) keep beyond their outputs: one
   handle's workspaces, cuBLAS's and cuBLASLt's, each read apart. Then a first
   backward, whose matrix multiplies run on autograd's device thread: what it
   keeps beyond its gradients is that thread's handles.
3. **Context.** The process's device memory (NVML's per-process figure, or the
   device's used memory against a reading taken before CUDA started) less the
   caching allocator's reserved bytes, after a small transformer's training
   step in fp32 and bf16 autocast (the kernels most steps load), and again
   after the convolutions below (cuDNN's kernels).
4. **cuDNN.** Forward and backward of convolutions shaped like those of the
   built-in models (ResNet, ConvNeXt, wav2vec2), in fp32 and bf16: the peak of
   ``memory_allocated`` during each call beyond its inputs and outputs is its
   workspace, compared with its largest output.
5. **Stream pool.** The context before and after the process's first side stream
   (``torch.cuda.Stream()``): PyTorch makes its whole pool of streams then, as NCCL's
   process group does at its first collective.

:func:`calibrate` runs :func:`measure` in a fresh Python process, fits the
constants (:func:`~vramctl.estimator._calibration.fit_constants`) and saves the
profile. Run it with the GPU otherwise idle: another process that allocates
or frees memory meanwhile moves the context reading when NVML cannot report
this process alone.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from vramctl.device import ComputeCapability, Device
from vramctl.estimator import _cuda_model
from vramctl.estimator._calibration import Calibration, CalibrationError, fit_constants
from vramctl.estimator._conv_workspace import CONVOLUTIONS, probe_keys
from vramctl.estimator._rates import measure_throughput

__all__ = ["calibrate", "measure"]

MiB = 2**20
BLOCK = 512

#: Request sizes for the allocator probes.
_SMALL_PROBES = (1, BLOCK + 1, MiB, MiB + BLOCK)
_LARGE_PROBES = (
    4 * MiB,
    8 * MiB,
    9 * MiB,
    10 * MiB - BLOCK,
    10 * MiB,
    10 * MiB + BLOCK,
    12 * MiB,
    16 * MiB,
)


def _block(nbytes: int) -> int:
    return max(BLOCK, -(-nbytes // BLOCK) * BLOCK)


def _bytes_of(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(_block(t.untyped_storage().nbytes()) for t in tensors if t is not None)


def _sync() -> None:
    torch.cuda.synchronize()


def _allocated() -> int:
    _sync()
    return int(torch.cuda.memory_allocated())


def _expandable_segments() -> bool:
    from vramctl.estimator._allocator import AllocatorConfig

    config = AllocatorConfig.from_env()
    return config is not None and config.expandable_segments


def _allocator(dev: torch.device) -> dict[str, Any]:
    """Segment and block sizes for single requests, each on an empty cache."""
    probes = []
    for n in (*_SMALL_PROBES, *_LARGE_PROBES):
        gc.collect()
        torch.cuda.empty_cache()
        r0, a0 = torch.cuda.memory_reserved(), _allocated()
        t = torch.empty(n, dtype=torch.uint8, device=dev)
        a1 = _allocated()
        r1 = torch.cuda.memory_reserved()
        del t
        torch.cuda.empty_cache()
        probes.append({"request": n, "segment": int(r1 - r0), "block": int(a1 - a0)})
    seg = {p["request"]: p["segment"] for p in probes}
    out: dict[str, Any] = {
        "probes": probes,
        "expandable_segments": _expandable_segments(),
        "min_block": next(p["block"] for p in probes if p["request"] == 1),
        "small_buffer": seg[1],
    }
    if seg[MiB] == seg[1] and seg[MiB + BLOCK] != seg[1]:
        out["small_size"] = MiB
        out["large_buffer"] = seg[MiB + BLOCK]
    own = [n for n in _LARGE_PROBES if seg[n] != out.get("large_buffer") and seg[n] >= n]
    if own and "large_buffer" in out:
        first = own[0]
        earlier = [n for n in _LARGE_PROBES if n < first]
        if all(seg[n] == out["large_buffer"] for n in earlier):
            out["min_large_alloc"] = first
            above = [n for n in _LARGE_PROBES if n > first and n % MiB]
            if above:
                n = above[0]
                rounding = seg[n] - (n - n % MiB)
                if rounding > 0 and seg[n] % rounding == 0:
                    out["round_large"] = rounding
    return out


def _cublas(dev: torch.device) -> dict[str, Any]:
    """Workspaces kept by a thread's first matrix multiplies and by a first backward.

    The backward is measured first. PyTorch gives a finished thread's cuBLAS handle back
    to a pool, and its workspace stays with it: measured after another thread's matrix
    multiplies, autograd's device thread took that handle and its workspace, and the
    backward seemed to keep nothing (H200, 2026-11-27; its recorded training steps each
    make two workspaces).
    """

    def first_matmuls() -> tuple[int, int]:
        """What a thread's first plain product and first bias product keep beyond their
        outputs, both together, and the second alone (cuBLASLt's workspace)."""
        a = torch.randn(256, 256, device=dev)
        b = torch.randn(256, 256, device=dev)
        x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
        w = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
        bias = torch.randn(256, device=dev, dtype=torch.bfloat16)
        base = _allocated()
        c = a @ b
        mid = _allocated()
        y = nn.functional.linear(x, w, bias)
        kept = _allocated() - base - _bytes_of((c, y))
        lt = _allocated() - mid - _bytes_of((y,))
        del a, b, c, x, w, bias, y
        return kept, lt

    per_handle, lt = first_matmuls()

    lin = nn.Linear(256, 256).to(dev)
    xin = torch.randn(64, 256, device=dev)
    base = _allocated()
    out = lin(xin)
    out.sum().backward()
    del out
    extra = _allocated() - base - _bytes_of(p.grad for p in lin.parameters())
    del lin, xin

    other: list[int] = []
    worker = threading.Thread(target=lambda: other.append(first_matmuls()[0]), daemon=True)
    worker.start()
    worker.join(timeout=120)
    return {
        "per_handle": max(0, per_handle),
        "lt": max(0, lt),
        "other_thread": max(0, other[0]) if other else None,
        "backward_extra": max(0, extra),
        "backward_first": True,
    }


def _transformer_steps(dev: torch.device, bf16: bool) -> None:
    """A small language model's training steps: the kernels most steps load."""
    torch.manual_seed(0)
    emb = nn.Embedding(1000, 256).to(dev)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, norm_first=True).to(dev)
    head = nn.Linear(256, 1000).to(dev)
    params = [*emb.parameters(), *layer.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    ids = torch.randint(0, 1000, (8, 128), device=dev)
    for autocast in (False, True) if bf16 else (False,):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = head(layer(emb(ids)))
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del emb, layer, head, params, opt, ids, logits, loss
    _sync()


def _convolutions(dev: torch.device, dtypes: Iterable[torch.dtype]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        for label, dims, cin, cout, k, stride, pad, groups, shape in CONVOLUTIONS:
            cls = nn.Conv1d if dims == 1 else nn.Conv2d
            conv = cls(cin, cout, k, stride=stride, padding=pad, groups=groups).to(dev, dtype)
            x = torch.randn(shape, device=dev, dtype=dtype, requires_grad=True)
            before = _allocated()
            torch.cuda.reset_peak_memory_stats()
            out = conv(x)
            _sync()
            fwd = torch.cuda.max_memory_allocated() - before - _bytes_of((out,))
            grad = torch.ones_like(out)
            wanted = [x, conv.weight, *([conv.bias] if conv.bias is not None else [])]
            before = _allocated()
            torch.cuda.reset_peak_memory_stats()
            grads = torch.autograd.grad(out, wanted, grad)
            _sync()
            bwd = torch.cuda.max_memory_allocated() - before - _bytes_of(grads)
            name = str(dtype).removeprefix("torch.")
            keys = probe_keys(label, name)
            rows.append(
                {
                    "conv": label,
                    "dtype": name,
                    "pass": "forward",
                    "key": keys["forward"] if keys else None,
                    "output_bytes": out.untyped_storage().nbytes(),
                    "workspace_bytes": max(0, int(fwd)),
                }
            )
            rows.append(
                {
                    "conv": label,
                    "dtype": name,
                    "pass": "backward",
                    "key": keys["backward"] if keys else None,
                    "output_bytes": max(g.untyped_storage().nbytes() for g in grads),
                    "workspace_bytes": max(0, int(bwd)),
                }
            )
            del conv, x, out, grad, grads
    gc.collect()
    return rows


class _Context:
    """The process's device memory outside the caching allocator."""

    def __init__(self, device: Device, index: int, before: int | None) -> None:
        self.device, self.index, self.before = device, index, before
        self.method = "unavailable"

    def read(self) -> int | None:
        _sync()
        gc.collect()
        mem = self.device.memory()
        reserved = int(torch.cuda.memory_reserved(self.index))
        if isinstance(mem.process_used, int) and mem.process_used > 0:
            self.method = "nvml process"
            return int(mem.process_used) - reserved
        if self.before is not None and isinstance(mem.used, int):
            self.method = "nvml device, against a reading before CUDA started"
            return int(mem.used) - self.before - reserved
        return None


def _stream_pool(cuda: torch.device, ctx: _Context) -> dict[str, int | None]:
    """The context before and after the process's first side stream: PyTorch makes its
    whole pool then (32 streams per priority level), outside the caching allocator."""
    before = ctx.read()
    side = torch.cuda.Stream(device=cuda)
    with torch.cuda.stream(side):
        torch.ones(1, device=cuda).add_(1)
    side.synchronize()
    after = ctx.read()
    return {"before": before, "after": after}


def _software() -> dict[str, str]:
    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn:
        out["cudnn"] = str(cudnn)
    try:
        import pynvml

        out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # NVML missing or not initialised: the driver is not reported
        pass
    return out


def _cuda_device(device: Device | str | int | None) -> Device:
    from vramctl.device import gpus, resolve

    if device is None:
        found = [d for d in gpus() if d.is_cuda and not d.is_mig]
        if not found:
            raise CalibrationError(
                "no CUDA GPU here: `vramctl calibrate` measures a GPU's CUDA context, "
                "workspaces and allocator (estimates for the CPU need no calibration)"
            )
        return found[0]
    dev = resolve(device)
    if not dev.is_cuda or dev.is_mig:
        raise CalibrationError(
            f"{dev.id} is a {dev.kind} device: calibrate a whole CUDA GPU (cuda:N); "
            "estimates for the CPU or a simulated GPU need no calibration"
        )
    return dev


def measure(
    device: Device | str | int | None = None, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Measure the CUDA constants of ``device`` in this process and return the readings.

    Call it in a process that has not used CUDA yet (:func:`calibrate` starts
    one); where CUDA has started already, the context is read from NVML's
    per-process figure alone.
    """
    say = progress or (lambda _msg: None)
    if not torch.cuda.is_available():
        raise CalibrationError("torch.cuda is not available: calibration needs a CUDA GPU")
    dev = _cuda_device(device)
    index = getattr(dev, "index", 0)
    started = torch.cuda.is_initialized()
    first = dev.memory()
    before = None if started or not isinstance(first.used, int) else int(first.used)
    torch.cuda.set_device(index)
    cuda = torch.device("cuda", index)
    warm = torch.zeros(1, device=cuda)
    del warm
    _sync()
    say("allocator segments")
    allocator = _allocator(cuda)
    ctx = _Context(dev, index, before)
    after_init = ctx.read()
    say("cuBLAS workspaces")
    cublas = _cublas(cuda)
    cc = torch.cuda.get_device_capability(index)
    bf16 = cc >= (8, 0)
    say("a transformer's training steps")
    _transformer_steps(cuda, bf16)
    after_matmul = ctx.read()
    say("cuDNN convolutions")
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    cudnn = _convolutions(cuda, dtypes)
    after_conv = ctx.read()
    say("PyTorch's stream pool")
    streams = _stream_pool(cuda, ctx)
    say("throughput: matrix multiplies, convolutions, attention, memory, launches")
    try:
        throughput: dict[str, Any] = measure_throughput(cuda, scale=4.0).to_dict()
    except Exception as exc:  # the memory constants stand without it
        throughput = {"error": f"{type(exc).__name__}: {exc}"}
    others = [p.pid for p in dev.processes() if p.pid != os.getpid()]
    return {
        "device": dev.name,
        "capability": f"{cc[0]}.{cc[1]}",
        "total_bytes": int(torch.cuda.get_device_properties(index).total_memory),
        "software": _software(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "allocator": allocator,
        "cublas": cublas,
        "context": {
            "after_init": after_init,
            "after_matmul": after_matmul,
            "after_conv": after_conv,
            "method": ctx.method,
            "other_processes": len(others),
        },
        "cudnn": cudnn,
        "streams": streams,
        "throughput": throughput,
    }


def _measure_in_child(index: int, timeout: float) -> dict[str, Any]:
    argv = [sys.executable, "-m", "vramctl.estimator._calibrate", "--device", str(index)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise CalibrationError(f"the calibration did not finish within {timeout:.0f} s") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    if done.returncode != 0 or not lines:
        detail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise CalibrationError(f"the calibration process failed: {detail[0]}")
    try:
        doc = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise CalibrationError("the calibration process printed no readings") from None
    if not isinstance(doc, dict):
        raise CalibrationError("the calibration process printed no readings")
    return doc


def calibrate(
    device: Device | str | int | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
    save: bool = True,
    fresh_process: bool = True,
    timeout: float = 600.0,
) -> Calibration:
    """Measure ``device``'s CUDA constants and save a profile later estimates use.

    The measurement runs in a fresh Python process (``fresh_process=False``
    runs it here, which needs a process that has not used CUDA yet). The
    profile is written to ``path``, else to the calibration directory under
    the GPU's name (see :func:`~vramctl.estimator.calibration_dir`).
    """
    dev = _cuda_device(device)
    index = getattr(dev, "index", 0)
    raw = measure(dev) if not fresh_process else _measure_in_child(index, timeout)
    cc_text = raw.get("capability")
    cc = ComputeCapability.parse(cc_text) if isinstance(cc_text, str) else None
    name = str(raw.get("device") or dev.name)
    cal, notes = fit_constants(raw, _cuda_model.builtin(name, cc))
    cal = replace(
        cal,
        device=name,
        capability=cc,
        software=dict(raw.get("software") or {}),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        measurements={**raw, "notes": notes},
    )
    return cal.save(path) if save else cal


def main(argv: list[str] | None = None) -> int:
    """The fresh process's entry: print the readings as one JSON line."""
    ap = argparse.ArgumentParser(prog="python -m vramctl.estimator._calibrate")
    ap.add_argument("--device", default="0", help="CUDA device index (default 0)")
    args = ap.parse_args(argv)
    try:
        doc = measure(args.device)
    except CalibrationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
