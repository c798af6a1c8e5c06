"""``vramctl.Step``: one step to estimate, as one value.

:func:`vramctl.estimate` and :func:`vramctl.max_batch_size` take its fields as keyword
arguments, build the value once and pass only it inward; a caller that prices many
steps (a fit, a plan, the job queue) builds one and changes what it varies
(``step.replace(precision="bf16")``). Everything an estimate depends on is a field here:
nothing is read from this process's global state while it runs (TF32 and the throughput
its time is predicted with included), so two threads may estimate at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vramctl.device import Device
from vramctl.estimator._allocator import AllocatorConfig
from vramctl.estimator._calibration import CalibrationSource
from vramctl.estimator._parallel import Parallel
from vramctl.estimator._spec import EstimateError
from vramctl.estimator._target import Target
from vramctl.estimator._timing import Throughput, tf32_matmul

__all__ = ["STEP_FIELDS", "Step", "step_request"]


@dataclass(frozen=True)
class Step:
    """What one estimated step runs, how, and on what device (the model and its batch
    aside). The fields are :func:`vramctl.estimate`'s options, with their defaults.

    >>> import vramctl
    >>> step = vramctl.Step(device="A10G-24GB", precision="bf16")
    >>> step.replace(mode="inference").mode, step.precision
    ('inference', 'bf16')
    """

    mode: str = "train"
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = "adamw"
    precision: str = "fp32"
    device: Target | Device | str | int | None = None
    checkpointing: bool = False
    target_utilization: float = 0.9
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    allocator_config: AllocatorConfig | None = None
    calibration: CalibrationSource = None
    safe: bool = True
    task: str | None = None
    image_size: int | tuple[int, int] | None = None
    trust_remote_code: bool = False
    offload_activations: bool = False
    offload_optimizer: bool = False
    grad_accumulation: bool = False
    #: Training: the loop holds the model's output until backward is done
    #: (``out = model(x); loss = f(out); loss.backward()``). False: it lets go of it first,
    #: as Lightning's and the Hugging Face Trainer's loops do (the step returns the loss
    #: alone), so of the output only what the loss saved for backward stays.
    keep_output: bool = True
    parallel: Parallel | str | None = None
    #: fp32 matrix multiplies on a GPU's TF32 tensor cores (its time; memory is the same).
    #: None: as this process is set (``torch.backends.cuda.matmul.allow_tf32``, or a
    #: ``float32_matmul_precision`` other than ``"highest"``), read when the step is made.
    tf32: bool | None = None
    #: The rates its time is predicted with; None: its device's (the CPU's measured here,
    #: a GPU's calibrated profile or data sheet).
    throughput: Throughput | None = None
    #: An adapter PEFT adds to the model before the step (LoRA ...): a PEFT config, a
    #: mapping of LoRA's settings (``{"r": 16, "targets": ["q_proj", "v_proj"]}``), the
    #: same as ``"r=16,targets=q_proj,v_proj"``, or a saved adapter's folder.
    adapter: Any = None
    #: Quantized weights for the model's linear layers: a format's name (``"nf4"``,
    #: ``"int8"``, ``"gptq"``, ``"awq"``, ``"int8-weight-only"`` ...), a
    #: :class:`~vramctl.estimator.QuantSpec`, or a Hugging Face ``quantization_config``.
    quant: Any = None
    #: With ``quant``: what PEFT's ``prepare_model_for_kbit_training`` does to the weights,
    #: every parameter not quantized (norms, embeddings, the output head) kept in fp32.
    kbit_prep: bool = False
    #: mode="generate": the tokens generated after the prompt (the batch's, or
    #: ``seq_len`` tokens for a named model), greedily, one at a time.
    max_new_tokens: int | None = None
    #: mode="generate": the cache class, ``"dynamic"`` (transformers' default: it grows by
    #: concatenation), ``"static"`` (allocated at its whole length on the first step),
    #: ``"quantized"`` (optimum-quanto's) or ``"offloaded"`` (in host memory between uses).
    cache: str = "dynamic"
    #: mode="generate", with ``cache="quantized"``: the cache's integer width, ``"int4"``
    #: (transformers' default) or ``"int2"`` (None: the cache's default; the other caches
    #: keep keys and values in the model's dtype).
    kv_dtype: str | None = None
    #: The step's loop takes a stream from PyTorch's pool (``torch.cuda.Stream()``: a
    #: loader that copies the next batch on a side stream ...). The first such stream makes
    #: the whole pool, outside the caching allocator (the calibration's
    #: ``stream_pool_bytes``). A step over more than one GPU has it anyway: NCCL's process
    #: group takes its streams from the pool.
    side_streams: bool = False

    def __post_init__(self) -> None:
        if self.tf32 is None:
            object.__setattr__(self, "tf32", tf32_matmul())

    def replace(self, **changes: Any) -> Step:
        """This step with ``changes`` (field names as for the constructor)."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def split(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``options`` as (the fields of a :class:`Step`, the rest): the rest are a search's
        own arguments (``max_batch_size``'s ``seq_len``, ``limit`` ...).

        >>> import vramctl
        >>> vramctl.Step.split({"precision": "bf16", "seq_len": 128})
        ({'precision': 'bf16'}, {'seq_len': 128})
        """
        fields = {k: v for k, v in options.items() if k in STEP_FIELDS}
        return fields, {k: v for k, v in options.items() if k not in STEP_FIELDS}

    @classmethod
    def of(cls, options: Step | Mapping[str, Any] | None, **defaults: Any) -> Step:
        """The step ``options`` asks for, with ``defaults`` where it asks nothing.

        ``options`` is a :class:`Step`, or a mapping of some of its fields (as
        ``fit_batch_size``'s ``estimate_options`` were given before). A mapping's keys
        are taken as given; of a :class:`Step`, the fields it sets to something other
        than ``Step()``'s default. ``defaults`` fill the rest: what the caller knows
        (a fit: its device, target, the mode and optimizer it found).

        >>> import vramctl
        >>> vramctl.Step.of({"precision": "bf16"}, mode="inference").mode
        'inference'
        >>> vramctl.Step.of(vramctl.Step(mode="train", precision="bf16"), safe=False).safe
        False

        Raises :class:`~vramctl.estimator.EstimateError` for a name that is no field.
        """
        unknown = sorted(set(defaults) - STEP_FIELDS)
        if unknown:
            raise EstimateError(f"not a field of vramctl.Step: {', '.join(unknown)}")
        if options is None:
            return cls(**defaults)
        if isinstance(options, Step):
            base = cls(tf32=options.tf32)  # tf32 set from the process when each was made
            given = {
                f.name: getattr(options, f.name)
                for f in dataclasses.fields(cls)
                if getattr(options, f.name) is not getattr(base, f.name)
                and getattr(options, f.name) != getattr(base, f.name)
            }
            return options.replace(**{k: v for k, v in defaults.items() if k not in given})
        if not isinstance(options, Mapping):
            raise EstimateError(
                f"estimate options must be a vramctl.Step or a mapping of its fields, "
                f"got {type(options).__name__}"
            )
        unknown = sorted(set(options) - STEP_FIELDS)
        if unknown:
            raise EstimateError(
                f"not an option of an estimate: {', '.join(map(str, unknown))} "
                f"(the options are vramctl.Step's fields)"
            )
        return cls(**{**defaults, **options})


#: The fields and their defaults, as ``estimate``'s keyword arguments have them.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Step)}
#: The names of the fields (the options of ``estimate`` that make its request).
STEP_FIELDS = frozenset(_DEFAULTS)


def step_request(step: Step | None, options: dict[str, Any]) -> Step:
    """The request of a call given ``step=`` or the options one by one (``options``:
    the call's values of :class:`Step`'s fields): not both.

    Raises :class:`~vramctl.estimator.EstimateError` for a step given with options too.
    """
    if step is None:
        return Step(**options)
    if not isinstance(step, Step):
        raise EstimateError(f"step must be a vramctl.Step, got {type(step).__name__}")
    given = sorted(k for k, v in options.items() if v is not _DEFAULTS[k] and v != _DEFAULTS[k])
    if given:
        raise EstimateError(
            f"give the step's options in step= or as arguments, not both: {', '.join(given)} "
            f"(use step.replace({given[0]}=...))"
        )
    return step
