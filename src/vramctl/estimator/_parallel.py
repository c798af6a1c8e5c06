"""How a training step is spread over ranks (:class:`Parallel`), and applying it to a model.

The same :func:`parallelize` wraps a real model on a real process group (a measured run)
and the estimator's model on fake tensors, so what is estimated is what runs:

- ``ddp``: ``DistributedDataParallel`` (gradient buckets of ``bucket_cap_mb``, gradients
  as views into them with ``gradient_as_bucket_view``);
- ``fsdp``: FSDP2's ``fully_shard`` on each repeated block (:func:`vramctl.optimize.find_blocks`)
  and on the root, with ``reshard_after_forward``, a mixed-precision policy and CPU offload;
- ``zero1``, ``zero2``, ``zero3``: DeepSpeed's ZeRO stages, priced by their definitions
  (no wrapper runs: DeepSpeed's engine needs its own launcher);
- ``tp``: tensor parallel on a 1-D mesh with the model's plan (``parallelize_module``).

>>> Parallel.parse("fsdp:8").world_size
8
>>> Parallel.parse("ddp:4,bucket_cap_mb=50,gradient_as_bucket_view").describe()
'ddp over 4 ranks (bucket_cap_mb=50, gradient_as_bucket_view)'
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vramctl._blocks import find_blocks
from vramctl.estimator._spec import EstimateError

__all__ = [
    "STRATEGIES",
    "Parallel",
    "ParallelError",
    "parallelize",
]

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "tp")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ParallelError(EstimateError):
    """A parallel layout that cannot be estimated or applied; the message says why."""


@dataclass(frozen=True)
class Parallel:
    """How one training step is spread over ``world_size`` ranks.

    ``ranks_per_node`` (default: all ranks on one node) sets the host memory a node needs
    where state is offloaded to it. The other fields belong to one strategy each and are
    ignored by the rest.
    """

    strategy: str
    world_size: int = 2
    ranks_per_node: int | None = None
    # DDP
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    # FSDP2
    reshard_after_forward: bool = True
    #: FSDP2's ``MixedPrecisionPolicy``: the dtype parameters are gathered in for compute
    #: and the dtype gradients are reduced in ("bf16", "fp16", "fp32"; None: as stored).
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    #: FSDP2's ``CPUOffloadPolicy`` or ZeRO's offload: sharded parameters, gradients and
    #: optimizer state in host memory (ZeRO: ``offload_optimizer``, plus ``offload_param``
    #: for stage 3).
    offload: bool = False
    # ZeRO (DeepSpeed's defaults)
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    # tensor parallel: module name -> a ParallelStyle (or "colwise", "rowwise")
    plan: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ParallelError(
                f"parallel strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise ParallelError(f"world_size must be an integer, got {self.world_size!r}")
        if self.world_size < 1:
            raise ParallelError(f"world_size must be at least 1, got {self.world_size}")
        rpn = self.ranks_per_node
        if rpn is not None and (rpn < 1 or self.world_size % rpn):
            raise ParallelError(
                f"ranks_per_node must divide world_size ({self.world_size}), got {rpn}"
            )
        if self.bucket_cap_mb <= 0:
            raise ParallelError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None and v not in _DTYPES:
                raise ParallelError(f"{name} must be one of bf16, fp16, fp32, got {v!r}")
        if self.strategy == "tp" and not self.plan:
            raise ParallelError(
                "tensor parallel needs the model's plan: {module name: 'colwise' | 'rowwise' "
                "| a ParallelStyle}"
            )
        for name, style in (self.plan or {}).items():
            if isinstance(style, str) and style.lower() not in ("colwise", "rowwise"):
                raise ParallelError(
                    f"tensor-parallel style for {name} must be colwise, rowwise or a "
                    f"ParallelStyle, got {style!r}"
                )
        if self.offload and self.strategy in ("ddp", "tp", "zero1"):
            raise ParallelError(f"offload applies to fsdp, zero2 and zero3, not {self.strategy}")

    @property
    def nodes(self) -> int:
        return self.world_size // (self.ranks_per_node or self.world_size)

    @property
    def zero_stage(self) -> int | None:
        return int(self.strategy[-1]) if self.strategy.startswith("zero") else None

    def mp_dtype(self, which: str) -> torch.dtype | None:
        v = getattr(self, which)
        return None if v is None else _DTYPES[v]

    def describe(self) -> str:
        """One line: the strategy, the ranks and the options that differ from the defaults."""
        default = Parallel(self.strategy, plan=self.plan)
        opts = []
        for f in dataclasses.fields(self):
            if f.name in ("strategy", "world_size", "plan"):
                continue
            v = getattr(self, f.name)
            if v != getattr(default, f.name):
                if v is True:
                    opts.append(f.name)
                elif v is False:
                    opts.append(f"no {f.name}")
                else:
                    opts.append(f"{f.name}={_short(v)}")
        more = f" ({', '.join(opts)})" if opts else ""
        return f"{self.strategy} over {self.world_size} ranks{more}"

    @classmethod
    def parse(cls, text: str, **overrides: Any) -> Parallel:
        """``"STRATEGY[:WORLD][,option=value|option|no_option]..."``, e.g. ``"fsdp:8"``,
        ``"ddp:4,bucket_cap_mb=50"``, ``"fsdp:8,no_reshard_after_forward,param_dtype=bf16"``.
        """
        head, *rest = [p.strip() for p in text.split(",") if p.strip()] or [""]
        strategy, _, world = head.partition(":")
        kwargs: dict[str, Any] = {}
        if world:
            try:
                kwargs["world_size"] = int(world)
            except ValueError:
                raise ParallelError(f"world size must be an integer, got {world!r}") from None
        names = {f.name: f for f in dataclasses.fields(cls)}
        for item in rest:
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            negated = not eq and key.startswith("no_") and key[3:] in names
            name = key[3:] if negated else key
            if name not in names or name in ("strategy", "plan"):
                known = ", ".join(n for n in names if n not in ("strategy", "plan"))
                raise ParallelError(f"unknown parallel option {key!r}; known: {known}")
            kwargs[name] = _value(name, getattr(cls(strategy="ddp"), name), value, eq, negated)
        kwargs.update(overrides)
        return cls(strategy.strip().lower(), **kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        if self.plan is not None:
            d["plan"] = {k: _short(v) for k, v in self.plan.items()}
        return d


def _short(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, str | int | float):
        return str(v)
    return type(v).__name__


def _value(name: str, default: Any, value: str, eq: str, negated: bool) -> Any:
    if not eq:
        if isinstance(default, bool):
            return not negated
        raise ParallelError(f"parallel option {name} needs a value ({name}=...)")
    value = value.strip()
    if isinstance(default, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ParallelError(f"parallel option {name} takes true or false, got {value!r}")
    if name in ("param_dtype", "reduce_dtype"):
        return None if value.lower() in ("none", "") else value.lower()
    try:
        return float(value) if isinstance(default, float) else int(float(value))
    except ValueError:
        raise ParallelError(f"parallel option {name} takes a number, got {value!r}") from None


# -- applying a layout to a model -----------------------------------------------------------


def parallelize(model: nn.Module, parallel: Parallel, mesh: Any = None) -> nn.Module:
    """Apply ``parallel`` to ``model`` on a process group that is already initialized.

    ``ddp``: returns ``DistributedDataParallel(model, ...)``; ``fsdp``: shards each
    repeated block and then the root with ``fully_shard`` (in place; returns ``model``);
    ``tp``: ``parallelize_module`` with ``parallel.plan`` (in place). ``mesh`` is a 1-D
    ``DeviceMesh`` (default: every rank, on the device type of the model's parameters).
    ZeRO stages have no wrapper here: DeepSpeed's engine wraps the model itself.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ParallelError("parallelize needs an initialized process group")
    if parallel.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # PyTorch 2.13 renamed broadcast_buffers (deprecated) to forward_sync_buffers.
        sync = (
            "forward_sync_buffers"
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else "broadcast_buffers"
        )
        options: dict[str, Any] = {
            "bucket_cap_mb": parallel.bucket_cap_mb,
            "gradient_as_bucket_view": parallel.gradient_as_bucket_view,
            sync: parallel.broadcast_buffers,
        }
        return DistributedDataParallel(model, **options)
    if mesh is None:
        mesh = default_mesh(model, parallel.world_size)
    if parallel.strategy == "fsdp":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": parallel.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=parallel.mp_dtype("param_dtype"),
                reduce_dtype=parallel.mp_dtype("reduce_dtype"),
            ),
        }
        if parallel.offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for block in find_blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model
    if parallel.strategy == "tp":
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh, tp_plan(parallel.plan or {}))
        return model
    raise ParallelError(
        f"{parallel.strategy} is priced by its definition; DeepSpeed's engine applies it"
    )


def default_mesh(model: nn.Module, world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    first = next(model.parameters(), None)
    kind = "cpu" if first is None else first.device.type
    return init_device_mesh(kind, (world_size,))


def tp_plan(plan: Mapping[str, Any]) -> dict[str, Any]:
    """A plan with ``"colwise"``/``"rowwise"`` names turned into PyTorch's styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    out: dict[str, Any] = {}
    for name, style in plan.items():
        if isinstance(style, str):
            if style.lower() not in styles:
                raise ParallelError(
                    f"tensor-parallel style for {name} must be colwise, rowwise or a "
                    f"ParallelStyle, got {style!r}"
                )
            style = styles[style.lower()]()
        out[name] = style
    return out
