"""The on-disk cache of fitted batch sizes: what a key is made of, and atomic JSON files.

A fitted batch size is only reused for the same step (its code), the same model
(class and parameter shapes), the same input shapes, the same device, about the
same free memory (the same 1/32 band of the device) and the same target. Each
answer is one JSON file named by the SHA-256 of its key; the key is stored
inside as well and compared on reading. A file that cannot be read or parsed,
or whose key differs, is ignored (and overwritten by the next fit).

>>> import tempfile
>>> from pathlib import Path
>>> from vramctl.fit._cache import load, store
>>> root = Path(tempfile.mkdtemp())
>>> key = {"step": "train", "target": 0.9}
>>> path = store(root, key, {"batch_size": 48})
>>> load(root, key)
{'batch_size': 48}
>>> _ = path.write_text("{ not json")
>>> load(root, key) is None
True
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import sys
import tempfile
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from vramctl.device import Device
from vramctl.fit._result import SCHEMA

__all__ = [
    "BANDS",
    "ENV_CACHE_DIR",
    "SCHEMA",
    "cache_root",
    "device_identity",
    "free_band",
    "input_signature",
    "key_digest",
    "load",
    "model_identity",
    "runtime",
    "step_identity",
    "store",
]

#: Environment variable naming the cache directory.
ENV_CACHE_DIR = "VRAMCTL_CACHE_DIR"
#: Free memory is compared in bands of 1/BANDS of the device's total.
BANDS = 32


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where fitted sizes live: the ``fit/`` folder of the cache directory.

    The cache directory is ``cache_dir``, else ``$VRAMCTL_CACHE_DIR``, else
    ``~/.cache/vramctl``.
    """
    if cache_dir is not None:
        base = Path(cache_dir)
    elif os.environ.get(ENV_CACHE_DIR):
        base = Path(os.environ[ENV_CACHE_DIR])
    else:
        base = Path.home() / ".cache" / "vramctl"
    return base.expanduser() / "fit"


# -- what the key is made of ------------------------------------------------------------


def _const(value: Any, digest: hashlib._Hash) -> None:
    if isinstance(value, types.CodeType):
        _code(value, digest)
    elif isinstance(value, frozenset):  # set literals: order varies with the hash seed
        for item in sorted(value, key=repr):
            _const(item, digest)
    elif isinstance(value, tuple):
        for item in value:
            _const(item, digest)
    else:
        digest.update(repr(value).encode())
    digest.update(b"\x00")


def _code(code: types.CodeType, digest: hashlib._Hash) -> None:
    digest.update(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for value in code.co_consts:
        _const(value, digest)


def _function_of(step: Callable[..., Any]) -> tuple[Any, str]:
    """The function whose code identifies ``step``, and the name to show for it."""
    obj: Any = step
    for _ in range(8):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif inspect.ismethod(obj):
            obj = obj.__func__
        else:
            break
    if hasattr(obj, "__code__") or inspect.isbuiltin(obj):
        name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
        return obj, name
    cls = type(obj)
    call = getattr(cls, "__call__", None)  # noqa: B004 - the class's __call__, not callable()
    return call, f"{cls.__module__}.{cls.__qualname__}"


def step_identity(step: Callable[..., Any]) -> dict[str, Any]:
    """Qualified name, module and a hash of the step's code.

    For a callable object (a :class:`vramctl.Guard`) the code of its class's
    ``__call__`` and of the functions it holds as attributes (its ``loss_fn``,
    its ``forward``) are hashed. Values a function closes over are not.
    """
    fn, name = _function_of(step)
    digest = hashlib.sha256()
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        _code(code, digest)
    else:  # a builtin or C-implemented callable: its name is all there is
        digest.update(name.encode())
    if fn is not step and not inspect.ismethod(step) and hasattr(step, "__dict__"):
        for attr, value in sorted(vars(step).items()):
            inner = getattr(value, "__code__", None)
            if isinstance(inner, types.CodeType):
                digest.update(attr.encode())
                _code(inner, digest)
    return {
        "name": name,
        "module": getattr(fn, "__module__", None) or type(step).__module__,
        "code": digest.hexdigest()[:32],
    }


def model_identity(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any] | None:
    """Model class, parameter names, shapes and dtypes, and the optimizer's class."""
    if model is None and optimizer is None:
        return None
    out: dict[str, Any] = {}
    if model is not None:
        cls = type(model)
        out["model"] = f"{cls.__module__}.{cls.__qualname__}"
        digest = hashlib.sha256()
        for name, p in model.named_parameters():
            digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
        for name, b in model.named_buffers():
            digest.update(f"{name}:{tuple(b.shape)}:{b.dtype};".encode())
        out["parameters"] = digest.hexdigest()[:32]
    if optimizer is not None:
        opt_cls = type(optimizer)
        out["optimizer"] = f"{opt_cls.__module__}.{opt_cls.__qualname__}"
    return out


def input_signature(batch: Any) -> Any:
    """Shapes and dtypes of the tensors in a batch, in its own structure (JSON-ready)."""
    if isinstance(batch, torch.Tensor):
        return {"shape": list(batch.shape), "dtype": str(batch.dtype)}
    if isinstance(batch, Mapping):
        return {
            str(k): input_signature(v) for k, v in sorted(batch.items(), key=lambda kv: str(kv[0]))
        }
    if isinstance(batch, list | tuple):
        return [input_signature(v) for v in batch]
    if isinstance(batch, int | float | bool | str) or batch is None:
        return batch
    return type(batch).__qualname__


def device_identity(device: Device) -> dict[str, Any]:
    return {"id": device.id, "name": device.name, "total": device.capacity()}


def free_band(device: Device) -> int:
    """Available bytes rounded down to a 1/32 of the device's total."""
    total = device.capacity()
    return int(device.available() * BANDS // max(total, 1))


def key_digest(key: Mapping[str, Any]) -> str:
    text = json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def runtime() -> dict[str, str]:
    return {"torch": torch.__version__, "python": sys.version.split()[0]}


# -- the files ---------------------------------------------------------------------------


def _path(root: Path, key: Mapping[str, Any]) -> Path:
    return root / f"{key_digest(key)}.json"


def load(root: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """The stored answer for ``key``, or None (missing, unreadable, corrupt or another key)."""
    path = _path(root, key)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    wanted = json.loads(json.dumps(key, sort_keys=True, default=str))
    if data.get("key") != wanted:
        return None
    result = data.get("result")
    return result if isinstance(result, dict) else None


def store(root: Path, key: Mapping[str, Any], result: Mapping[str, Any]) -> Path | None:
    """Write the answer atomically (a temporary file, then ``os.replace``); None on failure."""
    path = _path(root, key)
    text = json.dumps(
        {"schema": SCHEMA, "key": key, "result": result}, sort_keys=True, indent=1, default=str
    )
    tmp: str | None = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=root)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError:
        return None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path
