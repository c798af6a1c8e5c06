"""For vramctl's other packages only: the estimator's helpers that other vramctl packages use
(tracing a target, the search bounds, the calibration's rows, loading a model source, reading
a quantization, an adapter's settings, generate's caches, the serving plan's variants).

Not the public surface (that is ``vramctl.estimator``); the import contracts let sibling
packages import this module and no other private one of ``vramctl.estimator``.
"""

from __future__ import annotations

from vramctl.estimator._adapter import lora_config
from vramctl.estimator._calibration import constant_rows
from vramctl.estimator._estimate import StepSessions
from vramctl.estimator._generate import CACHES, QUANTIZED_KV
from vramctl.estimator._maxbatch import LENGTH_BOUND, SEARCH_INPUT_BYTES
from vramctl.estimator._quant import quant_spec
from vramctl.estimator._rates import cpu_profile_path, cpu_throughput
from vramctl.estimator._serve import VARIANTS, serve_variants
from vramctl.estimator._spec import load_model_source, resolve_source
from vramctl.estimator._target import Target, resolve_target, run_allocator, run_target

__all__ = [
    "CACHES",
    "LENGTH_BOUND",
    "QUANTIZED_KV",
    "SEARCH_INPUT_BYTES",
    "VARIANTS",
    "StepSessions",
    "Target",
    "constant_rows",
    "cpu_profile_path",
    "cpu_throughput",
    "load_model_source",
    "lora_config",
    "quant_spec",
    "resolve_source",
    "resolve_target",
    "run_allocator",
    "run_target",
    "serve_variants",
]
