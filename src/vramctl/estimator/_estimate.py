"""``vramctl.estimate``: a step's peak memory on a device, from a trace on fake tensors."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from vramctl.device import Device
from vramctl.estimator._allocator import (
    AllocatorConfig,
)
from vramctl.estimator._calibration import CalibrationSource
from vramctl.estimator._parallel import Parallel
from vramctl.estimator._rates import RATES
from vramctl.estimator._request import STEP_FIELDS, Step, step_request
from vramctl.estimator._result import Estimate
from vramctl.estimator._session import (
    Session,
    open_session,
)
from vramctl.estimator._spec import (
    BatchSource,
    ModelSource,
)
from vramctl.estimator._target import Target
from vramctl.estimator._timing import Throughput

__all__ = ["estimate", "estimate_step"]


def estimate(
    model: ModelSource,
    batch: BatchSource = None,
    *,
    mode: str = "train",
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = "adamw",
    precision: str = "fp32",
    batch_size: int | None = None,
    seq_len: int | None = None,
    seconds: float | None = None,
    device: Target | Device | str | int | None = None,
    checkpointing: bool = False,
    target_utilization: float = 0.9,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    allocator_config: AllocatorConfig | None = None,
    calibration: CalibrationSource = None,
    safe: bool = True,
    task: str | None = None,
    image_size: int | tuple[int, int] | None = None,
    trust_remote_code: bool = False,
    offload_activations: bool = False,
    offload_optimizer: bool = False,
    grad_accumulation: bool = False,
    keep_output: bool = True,
    parallel: Parallel | str | None = None,
    tf32: bool | None = None,
    throughput: Throughput | None = None,
    adapter: Any = None,
    quant: Any = None,
    kbit_prep: bool = False,
    max_new_tokens: int | None = None,
    cache: str = "dynamic",
    kv_dtype: str | None = None,
    side_streams: bool = False,
    step: Step | None = None,
) -> Estimate:
    """Predict a step's peak memory on ``device`` without running it.

    ``model`` is an ``nn.Module``, a built-in name (see
    :func:`vramctl.estimator.zoo.names`), a Hugging Face model by its config (a Hub
    id such as ``"Qwen/Qwen2.5-0.5B"``, a folder with a ``config.json``, the JSON file,
    or a ``transformers.PretrainedConfig``), ``"package.module:factory"``, or a
    zero-argument factory. ``batch`` is a tensor, a tuple or dict of tensors
    (what the model's forward takes), or a callable ``batch_size -> batch``;
    built-in and config models build their own from ``batch_size`` and ``seq_len``,
    ``seconds`` or ``image_size``.

    A model named by its config is built from it with no weights (only
    ``config.json`` is fetched from the Hub, where it is not in the local cache);
    the head is the config's ``architectures`` or ``task`` (one of
    :data:`vramctl.estimator.TASKS`); ``trust_remote_code=True`` lets a model with
    its own code on the Hub build.

    The step runs on fake tensors: no real memory, no real compute. Training
    is forward, loss, backward and an optimizer step, with the optimizer's state
    already made (a steady-state step); inference is the forward under
    ``no_grad``.

    For a GPU, the CUDA constants (context, workspaces, allocator) come from a
    profile made by ``vramctl calibrate`` on that GPU or one of its compute
    capability, where there is one; ``calibration=False`` uses the built-in ones,
    and a :class:`~vramctl.estimator.Calibration` or a profile's path picks one.

    ``offload_activations=True`` prices the step with the tensors saved for backward
    kept in host memory (``torch.autograd.graph.save_on_cpu``): they leave the device
    after forward and are copied back when backward needs them. ``offload_optimizer=True``
    prices it with the optimizer's state and step in host memory
    (:class:`vramctl.optimize.OffloadedOptimizer`): no state on the device, the gradients
    copied to the host and the parameters back each step, the step at the host CPU's rate.
    ``grad_accumulation=True`` prices a micro-batch of gradient accumulation after the
    first: the gradients are already there through forward and backward, which add into
    them. ``keep_output=False`` prices a loop that lets go of the model's output before
    backward (Lightning's, the Hugging Face Trainer's: the step returns the loss alone);
    by default the output is held until backward is done, as ``out = model(x);
    loss = f(out); loss.backward()`` holds it.

    The caching allocator is replayed over the steps of a loop, not one: the blocks a step
    frees stay cached and split, and the next step is served from them, until the
    allocator's layout after a step repeats. The peaks are the loop's, and so is
    ``fits``: a size whose first step fits and whose second does not, does not fit.

    ``parallel`` estimates one rank of a distributed step (a :class:`Parallel`, or its
    text such as ``"fsdp:8"``): DDP, FSDP2, ZeRO stages 1 to 3 or tensor parallel over
    ``world_size`` ranks, each with ``batch_size`` samples (the micro-batch per rank). The
    peaks and breakdown are one rank's (``unsharded``: parameters gathered in flight;
    ``buckets``: gradient buckets and reduction buffers); ``host_per_rank`` and
    ``host_per_node`` are what offloading keeps in host memory. It runs in this process
    on fake tensors; FSDP and tensor parallel need it to have no process group yet.

    The estimate also predicts the step's time (``step_seconds``, from its FLOPs and
    bytes per operator and the target's rates: the CPU's measured here, a GPU's from
    ``vramctl calibrate`` or its data sheet; ``throughput`` gives others). ``tf32``: fp32
    matrix multiplies run on a GPU's TF32 tensor cores (None: as this process is set).

    ``adapter`` adds a PEFT adapter to the model before the step, as PEFT's own
    ``get_peft_model`` does (LoRA: a ``LoraConfig``, ``{"r": 16, "targets": ["q_proj",
    "v_proj"]}``, ``"r=16,targets=q_proj,v_proj"`` or a saved adapter's folder): the base
    is frozen (no gradients, no optimizer state), the adapters stay fp32 under a 16-bit
    base. Needs ``pip install 'vramctl[finetune]'``. A model that already is a PEFT
    model is estimated as it is.

    ``quant`` quantizes the model's linear layers (not its output head, embeddings or
    norms, which the libraries leave in their dtype) to a format's exact storage:
    ``"nf4"``/``"fp4"`` (bitsandbytes 4-bit; ``QuantSpec("nf4", double_quant=True)`` for
    its double quantization), ``"int8"`` (LLM.int8), ``"gptq"``, ``"awq"``, or torchao's
    ``"int8-weight-only"``, ``"int4-weight-only"`` and ``"fp8"``; or a Hugging Face
    ``quantization_config``. Each matrix multiply dequantizes its weight into a transient
    in the compute dtype, forward and backward. With ``adapter`` it is QLoRA.
    ``kbit_prep`` keeps every parameter not quantized in fp32, as PEFT's
    ``prepare_model_for_kbit_training`` casts them (it also turns on checkpointing:
    give ``checkpointing=True`` for that).

    ``mode="generate"`` estimates a greedy ``generate`` of ``max_new_tokens`` tokens after
    the prompt (the batch's token ids, or ``seq_len`` tokens for a named model) by a causal
    language model: the prefill and the last decode step are traced, with the model's own
    cache class (``cache="dynamic"``, transformers' default, ``"static"``, ``"quantized"``
    or ``"offloaded"``, which keeps the layers it is not using in host memory; ``kv_dtype``
    ``"int2"`` halves the quantized cache's ``"int4"``), and the
    peak is the larger. ``breakdown["kv_cache"]`` is the cache in device memory at that
    peak.

    ``side_streams=True`` prices a loop that takes a stream from PyTorch's pool (a
    loader copying the next batch on a side stream): the process's first one makes the
    whole pool, outside the caching allocator, in ``breakdown["context"]``. A step over
    more than one GPU (``parallel``) has it anyway, for NCCL's streams.

    ``step`` gives all of these options at once as a :class:`~vramctl.estimator.Step`
    (then give none of them one by one): the request this call makes of its options,
    which a caller that prices many steps builds once and varies with ``step.replace``.
    Nothing else of this process's state is read, so two threads may estimate at once.

    Those constants differ by driver, CUDA version, module loading and
    ``cudnn.benchmark``, so ``nvidia-smi`` may read up to ``device_uncertainty``
    more than ``peak_device`` (1 GiB or more without a profile of the GPU; see
    :class:`~vramctl.estimator.Estimate`). ``fits`` judges at that safe end;
    ``safe=False`` judges at the point estimate ``peak_device`` instead.
    """
    request = step_request(step, {k: v for k, v in locals().items() if k in STEP_FIELDS})
    return estimate_step(model, request, batch, batch_size, seq_len, seconds)


class StepSessions:
    """Sessions of one model kept open across batch sizes, one per request: the model is
    built on fake tensors once per request, not once per batch (the planner prices a
    combination at several micro-batches). Close it (or use it as a context manager)."""

    def __init__(self, model: ModelSource) -> None:
        self.model = model
        #: (request, its session): a list, since a request's fields need not hash
        self._open: list[tuple[Step, Session]] = []

    def estimate(self, step: Step, batch: BatchSource, batch_size: int | None) -> Estimate:
        """:func:`estimate` of ``step`` on ``batch`` (a callable of the batch size)."""
        t0 = time.perf_counter()
        session = next((s for k, s in self._open if k == step), None)
        if session is None:
            session = open_session(self.model, step, RATES)
            self._open.append((step, session))
        est = session.estimate(batch, batch_size, None, None)
        return dataclasses.replace(est, elapsed=time.perf_counter() - t0)

    def close(self) -> None:
        while self._open:
            self._open.pop()[1].close()

    def __enter__(self) -> StepSessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def estimate_step(
    model: ModelSource,
    step: Step,
    batch: BatchSource = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    seconds: float | None = None,
) -> Estimate:
    """:func:`estimate` of one request (what :func:`estimate` calls once it has made it)."""
    t0 = time.perf_counter()
    session = open_session(model, step, RATES)
    try:
        est = session.estimate(batch, batch_size, seq_len, seconds)
    finally:
        session.close()
    return dataclasses.replace(est, elapsed=time.perf_counter() - t0)
