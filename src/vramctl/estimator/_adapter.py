"""Adapters (LoRA and the other PEFT methods) on the estimator's model, as PEFT builds them.

An estimate with ``adapter=`` builds its model as usual, then has PEFT's own
``get_peft_model`` wrap a copy of it on the meta device (PEFT refuses fake parameters; the
session gives every parameter a fresh fake tensor afterwards anyway). What PEFT does is then
what is traced: a frozen base (no gradients, no optimizer state), the adapters' parameters,
the inputs of the targeted layers kept for backward, dropout's copy. The adapters' own
parameters stay fp32 when the base is cast to 16 bits, as PEFT's ``autocast_adapter_dtype``
keeps them (:func:`adapter_parameters`).

``adapter`` is a PEFT config (``LoraConfig(...)``), a mapping of LoRA's settings
(``{"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"], "dropout": 0.05}``; PEFT's own
names ``lora_alpha``, ``target_modules``, ``lora_dropout`` too), the same as one string
(``"r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05"``, as ``vramctl estimate --lora``
takes it), or a saved adapter's folder or its ``adapter_config.json``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from vramctl._optional import require
from vramctl.estimator._build import private_copy
from vramctl.estimator._spec import EstimateError

__all__ = ["LORA_KEYS", "adapter_parameters", "apply_adapter", "describe_adapter", "lora_config"]

#: The settings of ``--lora`` (and of an adapter given as a mapping), by their short names,
#: and PEFT's ``LoraConfig`` field each sets.
LORA_KEYS = {
    "r": "r",
    "alpha": "lora_alpha",
    "targets": "target_modules",
    "dropout": "lora_dropout",
    "bias": "bias",
    "dora": "use_dora",
    "rslora": "use_rslora",
    "save": "modules_to_save",
}
_LISTS = ("target_modules", "modules_to_save")


def _peft() -> Any:
    return require("peft", extra="finetune", what="an estimate with an adapter")


def _parse(text: str) -> dict[str, Any]:
    """``"r=16,alpha=32,targets=q_proj,v_proj"`` as a mapping: a bare word after a list's
    key (``targets``, ``save``) is one more item of it."""
    out: dict[str, Any] = {}
    last: str | None = None
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        key, eq, value = word.partition("=")
        if not eq:
            if last is None:
                raise EstimateError(
                    f"adapter: {word!r} is not key=value (keys: {', '.join(LORA_KEYS)})"
                )
            out[last].append(word)
            continue
        key = key.strip()
        field = LORA_KEYS.get(key, key if key in LORA_KEYS.values() else None)
        if field is None:
            raise EstimateError(f"adapter: unknown key {key!r} (keys: {', '.join(LORA_KEYS)})")
        if field in _LISTS:
            out[field] = [value.strip()] if value.strip() else []
            last = field
        else:
            out[field] = value.strip()
            last = None
    return out


def _number(field: str, value: Any, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise EstimateError(f"adapter: {field} must be a number, got {value!r}") from None


def lora_config(adapter: Any) -> Any:
    """The PEFT config ``adapter`` stands for (see the module)."""
    peft = _peft()
    if isinstance(adapter, peft.PeftConfig):
        return adapter
    if isinstance(adapter, str | os.PathLike) and (
        Path(adapter).is_dir() or str(adapter).endswith(".json")
    ):
        path = Path(adapter)
        file = path / "adapter_config.json" if path.is_dir() else path
        try:
            doc = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise EstimateError(f"adapter: cannot read {file}: {exc}") from None
        if not isinstance(doc, dict) or "peft_type" not in doc:
            raise EstimateError(f"adapter: {file} is not a PEFT adapter_config.json")
        config_class = peft.PEFT_TYPE_TO_CONFIG_MAPPING.get(str(doc["peft_type"]))
        if config_class is None:
            raise EstimateError(f"adapter: {file}: unknown peft_type {doc['peft_type']!r}")
        known = set(config_class.__dataclass_fields__)
        return config_class(**{k: v for k, v in doc.items() if k in known})
    if isinstance(adapter, str):
        adapter = _parse(adapter)
    if not isinstance(adapter, Mapping):
        raise EstimateError(
            "adapter must be a PEFT config, a mapping of LoRA's settings, 'r=16,alpha=32,"
            f"targets=q_proj,v_proj' or an adapter's folder; got {type(adapter).__name__}"
        )
    fields: dict[str, Any] = {}
    for key, value in adapter.items():
        field = LORA_KEYS.get(key, key if key in LORA_KEYS.values() else None)
        if field is None:
            raise EstimateError(f"adapter: unknown key {key!r} (keys: {', '.join(LORA_KEYS)})")
        fields[field] = value
    if "r" in fields:
        fields["r"] = _number("r", fields["r"], int)
    if "lora_alpha" in fields:
        fields["lora_alpha"] = _number("alpha", fields["lora_alpha"], float)
    if "lora_dropout" in fields:
        fields["lora_dropout"] = _number("dropout", fields["lora_dropout"], float)
    for flag in ("use_dora", "use_rslora"):
        if isinstance(fields.get(flag), str):
            fields[flag] = fields[flag].lower() in ("1", "true", "yes", "on")
    for name in _LISTS:
        if isinstance(fields.get(name), str):
            fields[name] = [fields[name]]
    if fields.get("target_modules") == ["all-linear"]:
        fields["target_modules"] = "all-linear"  # PEFT's word for every linear layer
    try:
        return peft.LoraConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise EstimateError(f"adapter: {exc}") from None


def _leaf_names(model: nn.Module) -> list[str]:
    """The names a target may take: each layer with weights, by its last name."""
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if name and any(True for _ in module.parameters(recurse=False))
    }
    return sorted(names)


def apply_adapter(model: nn.Module, adapter: Any) -> nn.Module:
    """``model`` wrapped by PEFT with ``adapter``: a copy on the meta device (``model`` is
    left as it is and no weight is copied)."""
    config = lora_config(adapter)
    peft = _peft()
    with _disable_current_modes():
        # The copy PEFT changes: its parameters and buffers on the meta device, no weight copied.
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        base = private_copy(model, {n: torch.empty_like(t, device="meta") for n, t in named})
        try:
            with torch.device("meta"), warnings.catch_warnings():
                # transformers' deprecation of a name PEFT still reads: not the user's.
                warnings.simplefilter("ignore", FutureWarning)
                return peft.get_peft_model(base, config)  # type: ignore[no-any-return]
        except ValueError as exc:
            if "not found in the base model" in str(exc) or "Target module" in str(exc):
                targets = sorted(config.target_modules or [])
                raise EstimateError(
                    f"adapter: target modules {', '.join(targets)} are not in "
                    f"{type(model).__name__}; its layers are: {', '.join(_leaf_names(model))}"
                ) from None
            raise EstimateError(f"adapter: {exc}") from None


def adapter_parameters(model: nn.Module) -> set[int]:
    """The ids of the adapters' own parameters in a PEFT model (its tuner layers' adapter
    weights: LoRA's A and B, DoRA's magnitude ...), which stay fp32 under a 16-bit base."""
    ids: set[int] = set()
    for module in model.modules():
        for name in getattr(module, "adapter_layer_names", ()):
            held = getattr(module, name, None)
            if isinstance(held, nn.Module):
                ids.update(id(p) for p in held.parameters())
    return ids


def describe_adapter(model: nn.Module) -> str | None:
    """One line for a PEFT model: the method, rank, targets and trainable share."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    config = next(iter(configs.values()))
    method = str(getattr(config, "peft_type", "adapter")).rsplit(".", 1)[-1]
    parts = ["DoRA" if getattr(config, "use_dora", False) else str(method)]
    if getattr(config, "r", None) is not None:
        parts.append(f"r={config.r}")
    if getattr(config, "lora_alpha", None) is not None:
        parts.append(f"alpha={config.lora_alpha:g}")
    targets = getattr(config, "target_modules", None)
    if targets:
        names = [targets] if isinstance(targets, str) else {t.rsplit(".", 1)[-1] for t in targets}
        parts.append("on " + ", ".join(sorted(names)))
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    share = f"{trained / total:.2%}" if total else "0%"
    return f"{' '.join(parts)}: {trained:,} trainable parameters ({share} of {total:,})"
