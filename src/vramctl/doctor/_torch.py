"""The doctor's PyTorch settings checks: the caching allocator's settings
(``PYTORCH_CUDA_ALLOC_CONF``), TF32 and cuDNN (this process's settings)."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vramctl._na import NA
from vramctl.device import Device
from vramctl.doctor._report import Finding, Level

__all__ = ["check_alloc_conf", "check_cudnn", "check_tf32", "parse_alloc_conf"]

_DEFAULT_ALLOC_CONF = "expandable_segments:True"
_NO_GPU = "not applicable: no CUDA device"

#: The caching allocator's keys, each with its value's rule.
_BOOL = "True or False"
_ALLOC_KEYS: dict[str, str] = {
    "backend": "native or cudaMallocAsync",
    "expandable_segments": _BOOL,
    "max_split_size_mb": "a whole number of MiB, at least 20",
    "max_non_split_rounding_mb": "a whole number of MiB, at least 20",
    "large_segment_size_mb": "a positive whole number of MiB",
    "garbage_collection_threshold": "a fraction between 0 and 1 (exclusive)",
    "roundup_power2_divisions": "a power of 2, or a list like [256:1,512:2,>:4]",
    "release_lock_on_cudamalloc": _BOOL,
    "pinned_use_cuda_host_register": _BOOL,
    "pinned_num_register_threads": "a power of 2, at most 128",
    "pinned_use_background_threads": _BOOL,
    "pinned_reserve_segment_size_mb": "a positive whole number of MiB",
    "pinned_max_round_threshold_mb": "a positive whole number of MiB",
    "pinned_max_cached_size_mb": "a positive whole number of MiB",
    "graph_capture_record_stream_reuse": _BOOL,
    "per_process_memory_fraction": "a fraction above 0, at most 1",
    "pinned_free_catch_all": _BOOL,
    "throw_on_cudamalloc_oom": _BOOL,
    "release_lock_on_hipmalloc": _BOOL,
    "pinned_use_hip_host_register": _BOOL,
}
#: Keys that the cudaMallocAsync backend ignores.
_NATIVE_ONLY = ("max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold")


def _power_of_two(text: str, *, zero: bool = False) -> bool:
    if not text.isdigit():
        return False
    n = int(text)
    return (n == 0 and zero) or (n > 0 and n & (n - 1) == 0)


def _valid_value(key: str, value: str) -> bool:
    rule = _ALLOC_KEYS[key]
    if rule == _BOOL:
        return value in ("True", "False")
    if key == "backend":
        return value in ("native", "cudaMallocAsync", "hipMallocAsync")
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        return value.isdigit() and int(value) >= 20
    if key.endswith("_mb"):
        return value.isdigit() and int(value) > 0
    if key in ("garbage_collection_threshold", "per_process_memory_fraction"):
        try:
            x = float(value)
        except ValueError:
            return False
        return 0 < x < 1 if key == "garbage_collection_threshold" else 0 < x <= 1
    if key == "pinned_num_register_threads":
        return _power_of_two(value) and int(value) <= 128
    if key == "roundup_power2_divisions":
        if value.startswith("["):
            if not value.endswith("]"):
                return False
            for item in value[1:-1].split(","):
                size, sep, divisions = item.strip().partition(":")
                if not sep or not _power_of_two(divisions.strip(), zero=True):
                    return False
                if size.strip() != ">" and not _power_of_two(size.strip()):
                    return False
            return True
        return _power_of_two(value)
    return True


def _split_items(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, buf = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(buf)
            buf = ""
        else:
            buf += ch
    items.append(buf)
    return [i.replace(" ", "") for i in items if i.strip()]


def parse_alloc_conf(text: str) -> tuple[dict[str, str], list[tuple[Level, str]]]:
    """The allocator's settings in ``text`` (``key:value,...``) and what is wrong with them.

    A problem is ("error", why) where PyTorch refuses the setting at its first CUDA
    allocation, or ("warning", why) for a key this list does not know (a newer PyTorch
    may), and for options the cudaMallocAsync backend ignores.

    >>> parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")
    ({'expandable_segments': 'True', 'max_split_size_mb': '128'}, [])
    >>> parse_alloc_conf("expandable_segment:true")[1]
    [('error', "unknown key 'expandable_segment' (did you mean 'expandable_segments'?)")]
    """
    settings: dict[str, str] = {}
    problems: list[tuple[Level, str]] = []
    for item in _split_items(text):
        key, sep, value = item.partition(":")
        if not sep or not key or not value:
            problems.append(("error", f"{item!r} is not key:value"))
            continue
        if key not in _ALLOC_KEYS:
            close = difflib.get_close_matches(key, list(_ALLOC_KEYS), n=1, cutoff=0.8)
            if close:
                problems.append(("error", f"unknown key {key!r} (did you mean {close[0]!r}?)"))
            else:
                problems.append(
                    (
                        "warning",
                        f"unknown key {key!r}: PyTorch {torch.__version__} may refuse it "
                        "('Unrecognized key')",
                    )
                )
            continue
        if not _valid_value(key, value):
            problems.append(("error", f"{key}:{value}: {key} takes {_ALLOC_KEYS[key]}"))
            continue
        settings[key] = value
    if settings.get("backend", "native").endswith("MallocAsync"):
        ignored = [k for k in (*_NATIVE_ONLY, "expandable_segments") if k in settings]
        if ignored:
            problems.append(
                ("warning", f"backend:{settings['backend']} ignores {', '.join(ignored)}")
            )
    return settings, problems


def check_alloc_conf(env: Mapping[str, str], *, gpu: bool) -> list[Finding]:
    """``cuda.alloc_conf``: ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) parsed and
    checked."""
    cuda_conf, generic = env.get("PYTORCH_CUDA_ALLOC_CONF"), env.get("PYTORCH_ALLOC_CONF")
    name, text = (
        ("PYTORCH_ALLOC_CONF", generic)
        if cuda_conf is None and generic is not None
        else ("PYTORCH_CUDA_ALLOC_CONF", cuda_conf)
    )
    details: dict[str, Any] = {"variable": name, "value": text}
    out: list[Finding] = []
    if cuda_conf is not None and generic is not None and cuda_conf != generic:
        out.append(
            Finding(
                "cuda.alloc_conf",
                "warning",
                "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF are both set and differ; "
                "which one the CUDA allocator reads depends on the PyTorch version",
                "set one of them",
                {"PYTORCH_CUDA_ALLOC_CONF": cuda_conf, "PYTORCH_ALLOC_CONF": generic},
            )
        )
    if text is None or not text.strip():
        if gpu:
            out.append(
                Finding(
                    "cuda.alloc_conf",
                    "info",
                    "PYTORCH_CUDA_ALLOC_CONF is not set: the caching allocator keeps fixed "
                    "segments, and memory freed between steps of varying shapes fragments",
                    f"export PYTORCH_CUDA_ALLOC_CONF={_DEFAULT_ALLOC_CONF} (segments grow in "
                    "place: less reserved-but-unused memory, fewer OOMs)",
                    details,
                )
            )
        else:
            out.append(
                Finding(
                    "cuda.alloc_conf",
                    "ok",
                    "PYTORCH_CUDA_ALLOC_CONF is not set (it matters only on a GPU)",
                    "",
                    details,
                )
            )
        return out
    settings, problems = parse_alloc_conf(text)
    details["settings"] = settings
    details["problems"] = [why for _, why in problems]
    refused = [why for level, why in problems if level == "error"]
    doubtful = [why for level, why in problems if level == "warning"]
    if refused:
        out.append(
            Finding(
                "cuda.alloc_conf",
                "error" if gpu else "warning",
                f"{name}={text!r}: "
                + "; ".join(refused)
                + ("" if gpu else " (PyTorch would refuse it at the first CUDA allocation)"),
                f"fix or unset it, e.g. {name}={_DEFAULT_ALLOC_CONF}",
                details,
            )
        )
    if doubtful:
        out.append(
            Finding(
                "cuda.alloc_conf",
                "warning",
                f"{name}={text!r}: " + "; ".join(doubtful),
                "check the key against the PyTorch version's CUDA semantics notes, or remove it",
                details,
            )
        )
    if not problems:
        out.append(Finding("cuda.alloc_conf", "ok", f"{name}={text}", "", details))
    return out


def check_tf32(devices: Sequence[Device], env: Mapping[str, str]) -> list[Finding]:
    """``torch.tf32``: whether fp32 matmuls and convolutions may use TF32 on GPUs that have it
    (compute capability 8.0 and newer). Reads this process's settings."""
    capable = [d for d in devices if d.capability is not NA and d.capability.tf32]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # newer PyTorch deprecates the allow_tf32 flags
        matmul = bool(torch.backends.cuda.matmul.allow_tf32)
        cudnn = bool(torch.backends.cudnn.allow_tf32)
    precision = torch.get_float32_matmul_precision()
    override = env.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1"
    details: dict[str, Any] = {
        "matmul_allow_tf32": matmul,
        "cudnn_allow_tf32": cudnn,
        "float32_matmul_precision": precision,
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": env.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"),
        "devices": [d.id for d in capable],
    }
    if not capable:
        text = _NO_GPU if not devices else "no GPU with TF32 (compute capability 8.0+)"
        return [Finding("torch.tf32", "ok", f"{text}", "", details)]
    names = ", ".join(d.id for d in capable)
    out: list[Finding] = []
    matmul_on = matmul or precision != "highest" or override
    if not matmul_on:
        out.append(
            Finding(
                "torch.tf32",
                "info",
                f"fp32 matmuls on {names} run in full fp32 (float32 matmul precision "
                "'highest'); TF32 tensor cores make them several times faster at a precision "
                "training usually tolerates",
                "torch.set_float32_matmul_precision('high') at the start of the script (this "
                "reads this process's defaults: a script's own setting is not seen here)",
                details,
            )
        )
    if not cudnn:
        out.append(
            Finding(
                "torch.tf32",
                "info",
                f"cuDNN convolutions on {names} do not use TF32",
                "torch.backends.cudnn.allow_tf32 = True (the default)",
                details,
            )
        )
    if not out:
        out.append(Finding("torch.tf32", "ok", f"TF32 is allowed on {names}", "", details))
    return out


def _cudnn_text(version: int) -> str:
    if version >= 10000:  # cuDNN 9: 90100 is 9.1.0
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"  # 8902 is 8.9.2


def check_cudnn(torch_cuda: str | None, *, gpu: bool) -> list[Finding]:
    """``torch.cudnn``: cuDNN's presence and version, ``benchmark`` and ``deterministic``."""
    cudnn = torch.backends.cudnn
    available = bool(cudnn.is_available())
    raw = cudnn.version() if available else None
    details: dict[str, Any] = {
        "available": available,
        "version": None if raw is None else _cudnn_text(int(raw)),
        "benchmark": bool(cudnn.benchmark),
        "deterministic": bool(cudnn.deterministic),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
    }
    if not available:
        if torch_cuda is None:
            return [Finding("torch.cudnn", "ok", "no cuDNN in a CPU-only torch build", "", details)]
        return [
            Finding(
                "torch.cudnn",
                "warning" if gpu else "info",
                f"cuDNN is not available to torch {torch.__version__}: convolutions and RNNs "
                "fall back to slow kernels",
                "reinstall torch from the official wheels (they bring cuDNN), or fix "
                "LD_LIBRARY_PATH if it points at another cuDNN",
                details,
            )
        ]
    out: list[Finding] = []
    if details["deterministic"] or details["deterministic_algorithms"]:
        out.append(
            Finding(
                "torch.cudnn",
                "info",
                "deterministic algorithms are on: some kernels are slower (and some raise)",
                "turn them off unless runs must be bit-exact: "
                "torch.backends.cudnn.deterministic = False, "
                "torch.use_deterministic_algorithms(False)",
                details,
            )
        )
    bench = "on" if details["benchmark"] else "off (for fixed input shapes, on is faster)"
    out.append(
        Finding(
            "torch.cudnn",
            "ok",
            f"cuDNN {details['version']}; cudnn.benchmark {bench}",
            "",
            details,
        )
    )
    return out
