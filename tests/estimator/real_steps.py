"""A real training step on the GPU, as the estimator describes it, and its measured peaks."""

from __future__ import annotations

import torch
from torch import nn

from vramctl.estimator import StepSpec
from vramctl.estimator._estimate import prepare_model, run_step, warm_optimizer


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
    params = list(model.parameters())
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
