"""Real steps as the estimator describes them (on the GPU or the CPU), and their measured peaks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vramctl._tensors import tensors
from vramctl.estimator._spec import StepSpec, prepare_model, run_step, warm_optimizer


def cuda_step_peaks(model: nn.Module, batch: torch.Tensor, *, cold_cache: bool) -> tuple[int, int]:
    """Peak allocated and reserved bytes of a steady-state AdamW step of ``model`` on cuda:0.

    A warm-up step makes the optimizer's state, cuBLAS handles and cuDNN plans first.
    ``cold_cache`` empties the allocator's cache before the measured step, so its reserved
    peak starts from the live tensors, as the estimator's replay does.
    """
    model = model.cuda()
    x = batch.cuda()
    spec = StepSpec(autocast_device="cuda", foreach=True)
    prepare_model(model, spec)
    params: list[torch.Tensor] = list(model.parameters())
    opt = spec.make_optimizer(params)
    assert opt is not None
    warm_optimizer(opt, params)
    run_step(model, x, spec, opt)
    torch.cuda.synchronize()
    if cold_cache:
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run_step(model, x, spec, opt)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())


def profiled_peak(run: Callable[[], Any]) -> int:
    """The peak of PyTorch's profiler memory timeline (CREATE and DESTROY events) while
    ``run()`` runs on the CPU: what it allocates at most, kernels' scratch included."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        run()
    live = peak = 0
    for _t, action, _k, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def cpu_step_peak(model: nn.Module, batch: Any, spec: StepSpec | None = None) -> int:
    """Peak live tensor bytes of a real steady-state step on the CPU, by the profiler.

    What the step holds before it starts (parameters, buffers, the batch, the optimizer's
    state) plus the peak of what it allocates, each storage counted once.
    """
    spec = spec or StepSpec()
    prepare_model(model, spec)
    params: list[torch.Tensor] = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    opt = spec.make_optimizer(params)
    if opt is not None:
        warm_optimizer(opt, params)
    held = [*model.parameters(), *model.buffers(), *tensors(batch)]
    if opt is not None:
        held += [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    return storages_bytes(held) + profiled_peak(lambda: run_step(model, batch, spec, opt))


def storages_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a wrapper subclass, such as
    torchao's quantized weights, by the plain tensors it holds)."""
    seen: dict[int, int] = {}
    todo = list(tensors)
    while todo:
        t = todo.pop()
        if hasattr(type(t), "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
            todo += [getattr(t, n) for n in names]
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def cpu_infer_peak(model: nn.Module, batch: torch.Tensor) -> int:
    """Peak bytes of a real forward under ``no_grad`` on the CPU, by the profiler: the
    parameters, buffers and batch, plus the peak of what the forward allocates (after one
    forward for one-off caches, as the estimator's own kernel probes leave them)."""
    held = [*model.parameters(), *model.buffers(), batch]
    base = sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}.values()
    )
    with torch.no_grad():
        model(batch)
        return base + profiled_peak(lambda: model(batch))
