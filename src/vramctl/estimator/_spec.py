"""The step an estimate is for (:class:`StepSpec`), the model sources, and running a real step
the same way (:func:`run_step`, which the estimator's own checks and benchmarks use)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramctl._errors import VramctlError
from vramctl._step import call_model, model_loss
from vramctl._tensors import tensors
from vramctl.estimator import zoo
from vramctl.estimator._hub import config_model, is_config_source

__all__ = [
    "MODES",
    "OPTIMIZERS",
    "PRECISIONS",
    "BatchSource",
    "EstimateError",
    "ModelSource",
    "ResolvedSource",
    "StepSpec",
    "import_factory",
    "load_model_source",
    "prepare_model",
    "resolve_source",
    "run_step",
    "warm_optimizer",
]

MODES = ("train", "infer", "generate")
PRECISIONS = ("fp32", "bf16", "fp16", "amp-bf16", "amp-fp16")
OPTIMIZERS = (
    "adamw",
    "adamw-fused",
    "adam",
    "sgd",
    "sgd-momentum",
    "rmsprop",
    "adagrad",
    "adamw-8bit",
    "paged-adamw",
    "paged-adamw-8bit",
    "none",
)
ModelSource = nn.Module | str | Callable[[], nn.Module]
BatchSource = Any


class EstimateError(VramctlError):
    """A model, batch or step that cannot be estimated; the message says what to supply."""


# -- the step -----------------------------------------------------------------------


@dataclass(frozen=True)
class StepSpec:
    """What one step does: the same for a traced and a real run."""

    mode: str = "train"
    precision: str = "fp32"
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = "adamw"
    checkpointing: bool = False
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    #: ``torch.autocast`` device type for the amp precisions.
    autocast_device: str = "cpu"
    #: Use the multi-tensor (foreach) optimizer kernels, as PyTorch does on CUDA.
    foreach: bool | None = None
    #: Keep the tensors saved for backward in host memory between forward and backward
    #: (``torch.autograd.graph.save_on_cpu``), copied back when backward needs them.
    offload_activations: bool = False
    #: Keep the optimizer's state (and its step) in host memory: the gradients go to the
    #: host and the updated parameters come back each step (ZeRO-Offload's trade).
    offload_optimizer: bool = False
    #: A micro-batch of gradient accumulation: the gradients of the earlier micro-batches
    #: are held through this one's forward and backward, which add into them.
    grad_accumulation: bool = False
    #: The loop holds the model's output through backward (False: only the loss does).
    keep_output: bool = True
    #: mode="generate": the tokens generated after the prompt, and the cache class.
    max_new_tokens: int = 0
    cache: str = "dynamic"
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise EstimateError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.precision not in PRECISIONS:
            raise EstimateError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if isinstance(self.optimizer, str) and self.optimizer not in OPTIMIZERS:
            raise EstimateError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)} or a callable taking the "
                f"parameters, got {self.optimizer!r}"
            )

    @property
    def param_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(self.precision)

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
        opt = self.optimizer
        if self.mode != "train" or opt is None or opt == "none" or not params:
            return None
        if callable(opt):
            return opt(params)
        kw: dict[str, Any] = {} if self.foreach is None else {"foreach": self.foreach}
        if opt == "adamw":
            return torch.optim.AdamW(params, lr=1e-4, **kw)
        if opt == "adamw-fused":
            return torch.optim.AdamW(params, lr=1e-4, fused=True)
        if opt == "adam":
            return torch.optim.Adam(params, lr=1e-4, **kw)
        if opt == "sgd":
            return torch.optim.SGD(params, lr=1e-3, **kw)
        if opt == "sgd-momentum":
            return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kw)
        if opt == "rmsprop":
            return torch.optim.RMSprop(params, lr=1e-4, **kw)
        if opt in ("adamw-8bit", "paged-adamw", "paged-adamw-8bit"):
            # bitsandbytes' state layout (its kernels cannot run on fake tensors)
            from vramctl.estimator._optim8bit import Blockwise8bitAdamW

            return Blockwise8bitAdamW(
                params, eight_bit=opt.endswith("8bit"), paged=opt.startswith("paged")
            )
        return torch.optim.Adagrad(params, lr=1e-3, **kw)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        if self.mode != "train":
            stack.enter_context(torch.no_grad())
        dtype = self.autocast_dtype
        if dtype is not None:
            stack.enter_context(torch.autocast(self.autocast_device, dtype=dtype))
        return stack

    def loss(self, out: Any, batch: Any) -> torch.Tensor:
        loss = model_loss(out, batch, self.loss_fn)
        if loss is not None:
            return loss
        first = next(iter(flat_tensors(out)), None)
        if first is None:
            raise EstimateError(
                "the model's output has no tensor to take a loss from; pass loss_fn=(output, batch)"
            )
        # A typical loss: it holds about as much as MSE or cross-entropy over the output
        # (an output-sized result and output-sized gradients), where a bare mean holds none.
        return first.float().square().mean()


def prepare_model(model: nn.Module, spec: StepSpec) -> None:
    """Put a model in the state the step needs (train or eval, checkpointing)."""
    model.train(spec.mode == "train")
    if spec.checkpointing:
        # transformers 5 renames it activation_checkpointing_enable (the old name warns).
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
            return
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise EstimateError(
                f"{type(model).__name__} has no gradient_checkpointing_enable(); wrap its blocks "
                "in torch.utils.checkpoint yourself and pass checkpointing=False"
            )
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})


#: Attributes ``gradient_checkpointing_enable()`` sets on a module (Hugging Face).
_CHECKPOINT_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")


@contextlib.contextmanager
def step_mode(model: nn.Module, spec: StepSpec) -> Iterator[None]:
    """The model in the step's mode (train or eval, checkpointing) for a while.

    The user's module is theirs: its modules' training flags and checkpointing
    settings are put back afterwards.
    """
    saved = [
        (m, m.training, {a: m.__dict__[a] for a in _CHECKPOINT_ATTRS if a in m.__dict__})
        for m in model.modules()
    ]
    try:
        prepare_model(model, spec)
        yield
    finally:
        for m, training, attrs in saved:
            m.training = training
            for a in _CHECKPOINT_ATTRS:
                if a in attrs:
                    m.__dict__[a] = attrs[a]
                else:
                    m.__dict__.pop(a, None)


def warm_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Take one step on zero gradients so the optimizer's state exists (steady state)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_step(
    model: nn.Module,
    batch: Any,
    spec: StepSpec,
    optimizer: torch.optim.Optimizer | None,
    phase: Callable[[str], None] = lambda _: None,
) -> None:
    """One step: forward (and loss, backward and optimizer step when training), or a whole
    ``generate`` (mode="generate")."""
    if spec.mode == "generate":
        from vramctl.estimator._generate import run_generate

        with spec.forward_context():
            run_generate(
                model, batch, spec.max_new_tokens, spec.cache, phase=phase, kv_dtype=spec.kv_dtype
            )
        return
    phase("forward")
    with spec.forward_context():
        out = call_model(model, batch)
        loss = spec.loss(out, batch) if spec.mode == "train" else None
    if loss is None:
        del out
        return
    if not spec.keep_output:
        out = None
    phase("backward")
    loss.backward()
    del out, loss
    if optimizer is not None:
        phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# -- sources ------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedSource:
    """A model source made concrete: its display name, the module or its builder, and
    for a named model (built-in, or from a Hugging Face config) how its batches are made
    (``entry``: a :class:`~vramctl.estimator.zoo.ZooModel` or a ``ConfigModel``)."""

    name: str
    model: Callable[[], nn.Module] | nn.Module
    entry: Any = None
    #: Notes on what was asked for and not used (an image size for a text model ...).
    notes: tuple[str, ...] = ()


def resolve_source(
    source: ModelSource | Any,
    *,
    task: str | None = None,
    image_size: int | tuple[int, int] | None = None,
    trust_remote_code: bool = False,
) -> ResolvedSource:
    """What ``source`` names: a module, a factory, ``'package.module:factory'``, a built-in
    name, or a model by its Hugging Face config (a Hub id, a folder with ``config.json``,
    the file itself, or a ``PretrainedConfig``).

    ``task``, ``image_size`` and ``trust_remote_code`` apply to a model named by its
    config (``image_size`` also to the built-in image models).
    """
    own = _unused_by_own_model(image_size=image_size, task=task)
    if isinstance(source, nn.Module):
        return ResolvedSource(type(source).__name__, source, notes=own)
    if isinstance(source, str) and ":" in source:
        obj = import_factory(source, error=EstimateError)
        if not isinstance(obj, nn.Module) and not callable(obj):
            raise EstimateError(f"{source!r} is neither an nn.Module nor a factory")
        return ResolvedSource(source, obj, notes=own)
    if isinstance(source, str) and source.lower() in zoo.names():
        entry = zoo.get(source)
        unused = []
        if image_size is not None and entry.inputs == "images":
            entry = dataclasses.replace(entry, image_size=image_size)
        elif image_size is not None:
            unused.append(
                f"image_size={image_size} was given but not used: {entry.name}'s inputs take "
                "no images"
            )
        if task is not None:
            unused.append(
                f"task={task!r} was given but not used: {entry.name} is a built-in model with "
                "its own head"
            )
        return ResolvedSource(entry.name, entry.build, entry, tuple(unused))
    if isinstance(source, str):
        _refuse_builtin_typo(source)
    if is_config_source(source):
        try:
            model = config_model(
                source, task=task, image_size=image_size, trust_remote_code=trust_remote_code
            )
        except VramctlError as exc:
            if isinstance(source, str) and "/" not in source and not os.path.exists(source):
                close = difflib.get_close_matches(source.lower(), zoo.names(), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise EstimateError(
                    f"{source!r} is not a built-in model ({', '.join(zoo.names())}{hint}), "
                    f"and as a Hub id: {exc}"
                ) from exc
            raise EstimateError(str(exc)) from exc
        return ResolvedSource(model.name, model.build, model)
    if callable(source):
        return ResolvedSource(getattr(source, "__name__", "model"), source, notes=own)
    if isinstance(source, str):
        raise EstimateError(
            f"unknown model {source!r}: not a built-in model ({', '.join(zoo.names())}), a "
            "Hugging Face Hub id like openai-community/gpt2, a folder or file with a "
            "config.json, or 'package.module:factory'"
        )
    raise EstimateError(
        f"cannot estimate a {type(source).__name__}: give an nn.Module, a built-in name "
        f"({', '.join(zoo.names())}), a Hub id or config.json, 'package.module:factory' or "
        "a factory"
    )


def _unused_by_own_model(**given: Any) -> tuple[str, ...]:
    """Notes for options that only a named model (built-in, or by its config) uses."""
    return tuple(
        f"{k}={v!r} was given but not used: the model is your own module, and its batch is "
        "what was passed"
        for k, v in given.items()
        if v is not None
    )


def _refuse_builtin_typo(source: str) -> None:
    """A bare name one slip from a built-in one (``gtp2``, ``llama1b``) is a typo: say so
    at once, rather than ask the Hub for it (Hub ids are ``owner/name``, but for a few old
    ones such as ``gpt2``, none of them this close to a built-in name)."""
    if "/" in source or "\\" in source or source.endswith(".json"):
        return
    if os.path.exists(os.path.expanduser(source)):
        return
    typed = _plain(source)
    slips = {n: _slips(typed, _plain(n)) for n in zoo.names()}
    fewest = min(slips.values())
    near = [n for n, k in slips.items() if k == fewest <= 1]
    if near:
        raise EstimateError(
            f"unknown model {source!r}: did you mean {' or '.join(near)}? It is not a built-in "
            f"model ({', '.join(zoo.names())}); a Hub model is named by its id, owner/name"
        )


def _plain(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _slips(a: str, b: str) -> int:
    """Edits from ``a`` to ``b``: insertions, deletions, substitutions and swaps of two
    neighbours (the optimal string alignment distance)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def load_model_source(source: ModelSource) -> tuple[str, Callable[[], nn.Module] | nn.Module]:
    """A display name and a builder (or the module) for a model source."""
    resolved = resolve_source(source)
    return resolved.name, resolved.model


def import_factory(spec: str, *, error: type[VramctlError] = VramctlError) -> Any:
    """The object ``'package.module:name'`` names, imported as ``python -m`` would find it.

    The current directory comes first on the import path (as for ``python -m``), so a
    ``mymodel.py`` in the folder the command runs from is found. A failing import is one
    ``error`` that names the module, the folders searched and the fix.
    """
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise error(f"cannot load {spec!r}: give 'package.module:factory'")
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and mod_name.split(".")[0] == exc.name.split(".")[0]:
            raise error(
                f"cannot load {spec!r}: no module named {exc.name!r} in {here} (the current"
                " directory) or on the Python path; run the command from the folder that"
                f" holds {mod_name.split('.')[0]}.py (or its package), or add that folder"
                " to PYTHONPATH"
            ) from exc
        raise error(
            f"cannot load {spec!r}: importing {mod_name!r} failed: {exc}; install what it imports"
        ) from exc
    except Exception as exc:
        raise error(f"cannot load {spec!r}: importing {mod_name!r} failed: {exc!r}") from exc
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(here)
    try:
        return getattr(module, attr)
    except AttributeError:
        names = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
        raise error(
            f"cannot load {spec!r}: module {mod_name!r} ({getattr(module, '__file__', '?')})"
            f" has no {attr!r}; it defines {', '.join(names) or 'nothing public'}"
        ) from None


def flat_tensors(tree: Any) -> Iterator[torch.Tensor]:
    return tensors(unpack_output(tree))


def unpack_output(tree: Any) -> Any:
    """A model's output with its dataclasses (a ``ModelOutput`` too) opened into tuples."""
    if hasattr(tree, "to_tuple"):  # transformers ModelOutput
        tree = tree.to_tuple()
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = tuple(getattr(tree, f.name) for f in dataclasses.fields(tree))
    if isinstance(tree, tuple | list):
        return [unpack_output(x) for x in tree]
    if isinstance(tree, Mapping):
        return [unpack_output(x) for x in tree.values()]
    return tree
