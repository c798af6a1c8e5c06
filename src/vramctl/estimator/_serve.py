"""Serving: what an inference engine leaves for its KV cache on a GPU, before it starts.

vLLM and SGLang both load the weights, set some memory aside and carve the rest into a KV
cache, each by its own published rule:

**vLLM** (V1 engine, ``vllm/v1/worker/gpu_worker.py``, ``determine_available_memory``)
    ``available = capacity x gpu_memory_utilization - (weights + the activation peak of a
    profiling forward of max_num_batched_tokens tokens + non-torch memory) - the CUDA
    graphs' estimate`` (subtracted by default since v0.21). The KV cache is pages of 16
    tokens: a full-attention layer's page holds ``2 x 16 x kv_heads_per_rank x head_size x
    dtype bytes`` (MLA: ``16 x (kv_lora_rank + qk_rope_head_dim) x bytes``), and
    ``num_blocks = available // (page x layers)``. It logs ``GPU KV cache size: N tokens``
    (``num_blocks x 16``) and ``Maximum concurrency for L tokens per request: Xx``
    (``num_blocks / cdiv(L, 16)``). It does not start where free memory is under
    ``capacity x utilization``, where nothing is left for the cache, or where one request
    of ``max_model_len`` tokens does not fit (the error names the longest that does).

**SGLang** (``model_runner.profile_max_num_token``)
    ``rest = free memory after the weights - free memory before them x (1 -
    mem_fraction_static)``; ``max_total_num_tokens = rest // (kv_heads_per_rank x (head_dim
    + v_head_dim) x layers x bytes)``. There is no profiling forward: the part left out of
    the fraction holds the activations and CUDA graphs. The default fraction is
    ``(capacity - reserved) / capacity`` with ``reserved`` (MiB) ``= 512 + max(chunked
    prefill, 2048) x 1.5 + cuda_graph_max_bs x 2 + tp / 8 x 1024``, at least 10 GiB on a
    GPU over 60 GiB (``server_args._handle_gpu_memory_settings``), the chunk and graph
    sizes from a table by GPU memory.

The weights and the activation peak are traced here as :func:`vramctl.estimate` traces a
prefill (``mode="generate"``, one new token: the logits of the last position only), on a
model whose config is one tensor-parallel rank's (heads, KV heads, MLP width and vocabulary
divided by ``tp``). Non-torch memory and the CUDA graphs' estimate are what the engines
measure at start-up; their defaults here are figures the engines have logged.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from vramctl._errors import VramctlError
from vramctl._units import format_bytes
from vramctl.device import Device
from vramctl.estimator._target import Target, resolve_target

__all__ = [
    "ENGINES",
    "KV_DTYPES",
    "EngineBudget",
    "KVShape",
    "ServePlan",
    "kv_shape",
    "serve_plan",
    "serve_variants",
    "sglang_defaults",
    "vllm_defaults",
]

GiB = 1 << 30
MiB = 1 << 20

#: The engines priced.
ENGINES = ("vllm", "sglang")

#: ``--kv-dtype`` values and their bytes per element (``auto``: the model's dtype).
KV_DTYPES = {
    "auto": 0,
    "bf16": 2,
    "fp16": 2,
    "fp32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

#: vLLM's KV page: tokens per block (``--block-size``'s default on CUDA).
BLOCK_SIZE = 16

#: Memory outside PyTorch's allocator a vLLM rank gains while it profiles (cuBLAS, NCCL,
#: the attention backend's buffers): vLLM logs it as ``non_torch_memory``, 0.16 to 0.35 GiB
#: for one GPU in the logs of vllm#10517 and vllm#12126.
NON_TORCH = int(0.35 * GiB)

#: What vLLM (v0.21 and later) subtracts for its CUDA graphs unless ``--enforce-eager``: it
#: measures the graphs at start-up; logged estimates for dense models run 0.36 to 0.58 GiB.
CUDA_GRAPHS = int(0.5 * GiB)

#: Bytes per vocabulary entry and sampled row of vLLM's sampler pass after the profiling
#: forward: the logits in the model's dtype, their fp32 copy and the fp32 probabilities.
_SAMPLER_FP32_COPIES = 2


# -- the KV cache's shape ----------------------------------------------------------------


@dataclass(frozen=True)
class KVShape:
    """One rank's KV cache per token, by layer kind."""

    #: Layers that keep every token (full attention, MLA).
    full_layers: int
    #: Sliding-window layers, which keep the last ``window`` tokens.
    sliding_layers: int
    window: int | None
    #: KV heads on one rank (1 for MLA's latent).
    heads: int
    #: Key and value widths per head (MLA: the latent and rope widths as the key, 0 value).
    k_dim: int
    v_dim: int
    dtype_bytes: int
    mla: bool = False
    #: Layer kinds this does not price.
    unpriced: tuple[str, ...] = ()
    #: Layers that keep a fixed state a request (Mamba, linear attention), and one request's
    #: state in one of them on one rank.
    state_layers: int = 0
    state_layer_bytes: int = 0

    @property
    def layers(self) -> int:
        """The attention layers."""
        return self.full_layers + self.sliding_layers

    def state_bytes(self) -> int:
        """One request's fixed state in every Mamba or linear-attention layer."""
        return self.state_layers * self.state_layer_bytes

    def unit_bytes(self, block: int = BLOCK_SIZE) -> int:
        """vLLM's page: one block of one attention layer (a model without attention: one
        request's state)."""
        return self.page_bytes(block) if self.layers else max(1, self.state_bytes())

    def layer_token_bytes(self) -> int:
        """One token of one layer."""
        return self.heads * (self.k_dim + self.v_dim) * self.dtype_bytes

    def token_bytes(self) -> int:
        """One token in every attention layer (SGLang's cell; vLLM's page / 16 x layers)."""
        return self.layer_token_bytes() * self.layers

    def page_bytes(self, block: int = BLOCK_SIZE) -> int:
        """vLLM's page: one block of one layer."""
        return self.layer_token_bytes() * block

    def request_blocks(self, length: int, block: int = BLOCK_SIZE) -> int:
        """Pages one request of ``length`` tokens holds (vLLM's): a block of each attention
        layer per 16 tokens (a sliding-window layer's window only), and its state in pages
        of the same size."""
        full = -(-length // block)
        blocks = self.full_layers * full
        if self.sliding_layers:
            keep = full if not self.window else min(full, -(-(self.window - 1) // block) + 1)
            blocks += self.sliding_layers * keep
        if self.state_layers:
            blocks += -(-self.state_bytes() // self.unit_bytes(block))
        return blocks

    def request_bytes(self, length: int, block: int = BLOCK_SIZE) -> int:
        return self.request_blocks(length, block) * self.unit_bytes(block)

    def to_dict(self) -> dict[str, Any]:
        return {
            "full_layers": self.full_layers,
            "sliding_layers": self.sliding_layers,
            "window": self.window,
            "kv_heads_per_rank": self.heads,
            "k_dim": self.k_dim,
            "v_dim": self.v_dim,
            "dtype_bytes": self.dtype_bytes,
            "mla": self.mla,
            "bytes_per_token": self.token_bytes(),
            "unpriced_layers": list(self.unpriced),
            "state_layers": self.state_layers,
            "state_bytes_per_request": self.state_bytes(),
        }


def _text(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def kv_shape(config: Any, *, tp: int = 1, dtype_bytes: int = 2) -> KVShape:
    """One rank's KV cache per token for a Hugging Face config, under vLLM's tensor-parallel
    rules: attention heads divide by ``tp``; KV heads divide by it, or ``tp`` by them (then
    each rank keeps one); an MLA latent is kept whole on every rank."""
    text = _text(config)
    layers = _int(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(text, "num_attention_heads", "n_head")
    if tp < 1:
        raise VramctlError(f"tp must be at least 1, got {tp}")
    state = _state_layer_bytes(text, tp, dtype_bytes)
    if layers is not None and heads is None and state is not None:
        # a state-space model: no attention, a state in every layer
        return KVShape(0, 0, None, 0, 0, 0, dtype_bytes, False, (), layers, state)
    if layers is None or heads is None:
        raise VramctlError(
            f"{type(config).__name__} has no num_hidden_layers or num_attention_heads: "
            "serving is priced for decoder language models"
        )
    if heads % tp:
        raise VramctlError(
            f"tensor parallel size {tp} does not divide the {heads} attention heads: vLLM and "
            "SGLang need the attention heads divisible by --tp"
        )
    full, sliding, window, stateful, unpriced = _layer_kinds(text, layers)
    if stateful and state is None:
        unpriced = tuple(sorted({*unpriced, "state"}))
    states = {"state_layers": stateful, "state_layer_bytes": state or 0} if state else {}
    lora = _int(text, "kv_lora_rank")
    if lora is not None:
        rope = _int(text, "qk_rope_head_dim") or 0
        return KVShape(
            full + sliding, 0, None, 1, lora + rope, 0, dtype_bytes, True, unpriced, **states
        )
    kv = _int(text, "num_key_value_heads", "multi_query_group_num") or heads
    if kv >= tp:
        if kv % tp:
            raise VramctlError(
                f"tensor parallel size {tp} does not divide the {kv} KV heads: vLLM needs "
                "the KV heads divisible by --tp, or --tp divisible by them"
            )
        per_rank = kv // tp
    else:
        if tp % kv:
            raise VramctlError(
                f"tensor parallel size {tp} is not a multiple of the {kv} KV heads: vLLM "
                "replicates KV heads only where --tp is divisible by them"
            )
        per_rank = 1
    hidden = _int(text, "hidden_size", "n_embd") or 0
    head_dim = _int(text, "head_dim") or (hidden // heads)
    v_dim = _int(text, "v_head_dim") or head_dim
    return KVShape(
        full, sliding, window, per_rank, head_dim, v_dim, dtype_bytes, False, unpriced, **states
    )


#: Layer kinds in a config's ``layer_types``: attention that keeps every token, a sliding
#: window, a fixed state (Mamba, linear attention), or both an attention and a state.
_FULL = ("full_attention", "attention", "global")
_SLIDING = ("sliding_attention", "local", "chunked_attention")
_STATE = ("mamba", "linear_attention", "mamba2", "ssm")
_BOTH = ("hybrid",)


def _layer_kinds(text: Any, layers: int) -> tuple[int, int, int | None, int, tuple[str, ...]]:
    """``(full, sliding, window, stateful, unknown kinds)`` of a config's layers."""
    window = _int(text, "sliding_window")
    kinds = getattr(text, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and len(kinds) == layers:
        full = sum(1 for k in kinds if k in _FULL or k in _BOTH)
        sliding = sum(1 for k in kinds if k in _SLIDING)
        stateful = sum(1 for k in kinds if k in _STATE or k in _BOTH)
        known = (*_FULL, *_SLIDING, *_STATE, *_BOTH)
        other = tuple(sorted({str(k) for k in kinds if k not in known}))
        return full, sliding, window if sliding else None, stateful, other
    if window and getattr(text, "use_sliding_window", True):
        return 0, layers, window, 0, ()
    return layers, 0, None, 0, ()


def _state_layer_bytes(text: Any, tp: int, dtype_bytes: int) -> int | None:
    """One request's state in one Mamba or linear-attention layer on one of ``tp`` ranks
    (its convolution's last ``kernel - 1`` inputs and its recurrent state, in the model's
    dtype as vLLM keeps them by default), or None for a config with neither."""
    nv = _int(text, "linear_num_value_heads")
    if nv is not None:  # gated delta net (Qwen3-Next)
        nk = _int(text, "linear_num_key_heads") or nv
        dk = _int(text, "linear_key_head_dim") or 128
        dv = _int(text, "linear_value_head_dim") or 128
        kernel = _int(text, "linear_conv_kernel_dim") or 4
        conv = (kernel - 1) * (2 * nk * dk + nv * dv)
        state = nv * dk * dv
    else:
        d_state = _int(text, "mamba_d_state", "state_size", "ssm_state_size")
        if d_state is None:
            return None
        kernel = _int(text, "mamba_d_conv", "conv_kernel") or 4
        hidden = _int(text, "hidden_size") or 0
        heads = _int(text, "mamba_n_heads") or (
            _int(text, "num_heads") if getattr(text, "model_type", "") == "mamba2" else None
        )
        if heads is not None:  # Mamba-2: heads x head size, grouped B and C
            head_dim = _int(text, "mamba_d_head", "head_dim") or 64
            groups = _int(text, "mamba_n_groups", "n_groups") or 1
            inner = heads * head_dim
            conv = (kernel - 1) * (inner + 2 * groups * d_state)
            state = heads * head_dim * d_state
        else:  # Mamba-1 (Mamba, Jamba): expand x hidden channels
            inner = (_int(text, "mamba_expand", "expand") or 2) * hidden
            conv = (kernel - 1) * inner
            state = inner * d_state
    return (conv + state) * dtype_bytes // tp


# -- the engines' defaults -----------------------------------------------------------------


def vllm_defaults(capacity: int, name: str) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` of ``vllm serve`` on a GPU
    (``EngineArgs.get_batch_defaults``): 8192 and 1024 on one of 70 GiB or more that is
    not an A100, else 2048 and 256."""
    if capacity >= 70 * GiB and "a100" not in name.lower():
        return 8192, 1024
    return 2048, 256


#: SGLang's table by GPU memory (MiB below): chunked prefill size, and the CUDA graphs'
#: largest batch under tp 4 and from tp 4 (``server_args._handle_gpu_memory_settings``).
_SGLANG_TABLE = (
    (20 * 1024, 2048, 16, 64),
    (35 * 1024, 2048, 24, 80),
    (60 * 1024, 4096, 32, 160),
    (160 * 1024, 8192, 256, 512),
    (math.inf, 16384, 512, 512),
)


def sglang_defaults(capacity: int, tp: int = 1) -> tuple[int, int, float]:
    """``(chunked_prefill_size, cuda_graph_max_bs, mem_fraction_static)`` SGLang picks for a
    GPU of ``capacity`` bytes (``server_args._handle_gpu_memory_settings``)."""
    mib = capacity / MiB
    chunk, small, large = next((c, s, lg) for top, c, s, lg in _SGLANG_TABLE if mib < top)
    graph_bs = small if tp < 4 else large
    reserved = 512 + max(chunk, 2048) * 1.5 + graph_bs * 2 + tp / 8 * 1024
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return chunk, graph_bs, round((mib - reserved) / mib, 3)


# -- the results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineBudget:
    """One engine's memory on one rank, and what it makes of it."""

    engine: str
    #: The settings used: the engine's own names and values.
    settings: dict[str, Any]
    capacity: int
    #: What the engine lets itself use (vLLM: capacity x utilization; SGLang: free memory
    #: before the weights x the static fraction).
    budget: int
    weights: int
    #: The activation peak the engine sets aside (vLLM: its profiling forward's; SGLang: none
    #: in the budget, but the traced peak of a prefill chunk, checked against what is left).
    activation: int
    non_torch: int
    cuda_graphs: int
    kv_bytes: int
    kv_tokens: int
    #: vLLM's 16-token blocks (None for SGLang).
    blocks: int | None
    max_model_len: int
    #: Requests of ``max_model_len`` tokens the cache holds at once.
    concurrency: float
    starts: bool
    #: Why it would not start, in the engine's terms.
    error: str | None = None
    #: Settings that make it start, or reach the target concurrency.
    suggestions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "settings": dict(self.settings),
            "capacity": self.capacity,
            "budget": self.budget,
            "weights": self.weights,
            "activation": self.activation,
            "non_torch": self.non_torch,
            "cuda_graphs": self.cuda_graphs,
            "kv_bytes": self.kv_bytes,
            "kv_tokens": self.kv_tokens,
            "blocks": self.blocks,
            "max_model_len": self.max_model_len,
            "concurrency": round(self.concurrency, 3),
            "starts": self.starts,
            "error": self.error,
            "suggestions": list(self.suggestions),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class ServePlan:
    """What each engine would make of a model on a GPU (:func:`serve_plan`)."""

    model: str
    device: str
    tp: int
    dtype: str
    kv_dtype: str
    max_model_len: int
    kv: KVShape
    engines: tuple[EngineBudget, ...]
    notes: tuple[str, ...] = field(default=())
    #: The weights' quantization (None: the dtype's).
    quant: str | None = None

    def engine(self, name: str) -> EngineBudget:
        for e in self.engines:
            if e.engine == name:
                return e
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "tp": self.tp,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "max_model_len": self.max_model_len,
            "quant": self.quant,
            "kv": self.kv.to_dict(),
            "engines": [e.to_dict() for e in self.engines],
            "notes": list(self.notes),
        }


# -- the plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Traced:
    weights: int
    activation: int
    vocab: int
    notes: tuple[str, ...]


def _check_fraction(name: str, value: float | None) -> None:
    if value is not None and not 0 < value <= 1:
        raise VramctlError(f"{name} must be in (0, 1], got {value}")


def serve_plan(
    model: Any,
    device: Target | Device | str,
    *,
    max_model_len: int | None = None,
    engine: str | tuple[str, ...] = ENGINES,
    gpu_memory_utilization: float = 0.9,
    mem_fraction_static: float | None = None,
    tp: int = 1,
    dtype: str = "auto",
    kv_dtype: str = "auto",
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    chunked_prefill_size: int | None = None,
    enforce_eager: bool = False,
    cuda_graph_memory: int | None = None,
    non_torch_memory: int | None = None,
    target_concurrency: int | None = None,
    quant: Any = None,
    trust_remote_code: bool = False,
    calibration: Any = None,
) -> ServePlan:
    """Price serving ``model`` on ``device`` with vLLM and SGLang, before either starts.

    ``model`` is a Hugging Face causal LM by its config (Hub id, folder, ``config.json``
    or a ``PretrainedConfig``). For each engine it gives one rank's weights, the memory set
    aside outside the cache, the KV cache's bytes, tokens and (vLLM) blocks, how many
    requests of ``max_model_len`` tokens fit at once, whether the engine would start, and
    the settings that make it start or reach ``target_concurrency`` requests. See the
    module for each engine's rule.

    ``dtype`` ``auto`` is the config's (an fp32 checkpoint is served in bf16, or fp16 on a
    GPU without bf16); ``kv_dtype`` ``auto`` is the model's. ``max_num_seqs`` and
    ``max_num_batched_tokens`` default to ``vllm serve``'s for the GPU,
    ``chunked_prefill_size`` and ``mem_fraction_static`` to SGLang's. ``cuda_graph_memory``
    and ``non_torch_memory`` (bytes) replace the defaults :data:`CUDA_GRAPHS` and
    :data:`NON_TORCH`. ``quant`` serves a quantized checkpoint (``"awq"``, ``"gptq"``,
    ``"fp8"``, ``"int8"`` ...: :func:`vramctl.estimate`'s formats; a config's own
    ``quantization_config`` is read without it).
    """
    from vramctl.estimator._hub import config_model

    engines = (engine,) if isinstance(engine, str) else tuple(engine)
    for name in engines:
        if name not in ENGINES:
            raise VramctlError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}")
    _check_fraction("gpu_memory_utilization", gpu_memory_utilization)
    _check_fraction("mem_fraction_static", mem_fraction_static)
    if kv_dtype not in KV_DTYPES:
        raise VramctlError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    for label, value in (
        ("max_model_len", max_model_len),
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("chunked_prefill_size", chunked_prefill_size),
        ("target_concurrency", target_concurrency),
    ):
        if value is not None and value < 1:
            raise VramctlError(f"{label} must be at least 1, got {value}")
    target = resolve_target(device, calibration)
    if not target.cuda:
        raise VramctlError(
            f"serving is priced for a GPU; {target.name} is not one (give a GPU such as "
            "'H100-80GB' or a size such as '24GiB')"
        )
    cm = config_model(model, task="causal-lm", trust_remote_code=trust_remote_code)
    config = cm.config
    notes: list[str] = []
    positions = cm.max_positions
    if max_model_len is None:
        if positions is None:
            raise VramctlError(f"{cm.name}: the config gives no position limit; give max_model_len")
        max_model_len = positions
    elif positions is not None and max_model_len > positions:
        notes.append(
            f"max_model_len {max_model_len} is beyond the {positions} positions of the "
            f"config ({cm.positions_from}); vLLM refuses it unless "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, and the model may not work that far"
        )
    precision = _precision(config, dtype, target)
    model_bytes = 2 if precision in ("bf16", "fp16") else 4
    kv_bytes = KV_DTYPES[kv_dtype] or model_bytes
    kv = kv_shape(config, tp=tp, dtype_bytes=kv_bytes)
    if kv.unpriced:
        notes.append(
            f"layers of kind {', '.join(kv.unpriced)} are not priced here; the cache "
            "figures count the attention layers only"
        )
    if kv.state_layers:
        notes.append(
            f"{kv.state_layers} Mamba or linear-attention layers keep "
            f"{format_bytes(kv.state_bytes())} of state a request, priced beside its keys "
            "and values (vLLM keeps it in pages of the attention's size; the engines' hybrid "
            "allocators round it their own ways)"
        )
    if kv.sliding_layers:
        notes.append(
            f"{kv.sliding_layers} sliding-window layers keep {kv.window} tokens a request in "
            "vLLM's hybrid cache; SGLang is priced keeping every token in them (its default "
            "for most models)"
        )
    default_tokens, default_seqs = vllm_defaults(target.capacity, target.name)
    batched = max_num_batched_tokens or default_tokens
    seqs = max_num_seqs or default_seqs
    chunk, graph_bs, fraction = sglang_defaults(target.capacity, tp)
    chunk = chunked_prefill_size or chunk
    traced: dict[int, _Traced] = {}

    def trace(tokens: int) -> _Traced:
        if tokens not in traced:
            # sequences no longer than the model's positions (a learned table stops there)
            longest = min(max_model_len, positions or max_model_len)
            traced[tokens] = _trace(config, tokens, longest, tp, precision, target, quant)
        return traced[tokens]

    out = []
    for name in engines:
        if name == "vllm":
            t = trace(batched)
            out.append(
                _vllm(
                    target,
                    kv,
                    t,
                    max_model_len,
                    utilization=gpu_memory_utilization,
                    batched=batched,
                    seqs=min(seqs, batched),
                    model_bytes=model_bytes,
                    cuda_graphs=0 if enforce_eager else _or(cuda_graph_memory, CUDA_GRAPHS),
                    non_torch=_or(non_torch_memory, NON_TORCH),
                    target_concurrency=target_concurrency,
                )
            )
        else:
            t = trace(chunk)
            out.append(
                _sglang(
                    target,
                    kv,
                    t,
                    max_model_len,
                    fraction=mem_fraction_static or fraction,
                    default_fraction=mem_fraction_static is None,
                    chunk=chunk,
                    graph_bs=0 if enforce_eager else graph_bs,
                    tp=tp,
                    target_concurrency=target_concurrency,
                )
            )
    for t in traced.values():
        notes.extend(n for n in t.notes if n not in notes)
    return ServePlan(
        model=cm.name,
        device=target.name,
        tp=tp,
        dtype=precision,
        kv_dtype=kv_dtype if kv_dtype != "auto" else precision,
        max_model_len=max_model_len,
        kv=kv,
        engines=tuple(out),
        notes=tuple(notes),
        quant=_quant_name(quant),
    )


def _quant_name(quant: Any) -> str | None:
    if quant is None:
        return None
    from vramctl.estimator._quant import quant_spec

    return quant_spec(quant).method


#: ``serve_variants``' settings: (label, weight quantization, KV cache dtype).
VARIANTS = (
    ("16-bit", None, "auto"),
    ("16-bit + fp8 KV", None, "fp8"),
    ("fp8", "fp8", "auto"),
    ("fp8 + fp8 KV", "fp8", "fp8"),
    ("AWQ int4", "awq", "auto"),
    ("AWQ + fp8 KV", "awq", "fp8"),
)


def serve_variants(model: Any, device: Target | Device | str, **kw: Any) -> list[ServePlan]:
    """:func:`serve_plan` of ``model`` for each of :data:`VARIANTS`: the weights in 16 bits,
    fp8 or AWQ int4, with a 16-bit or fp8 KV cache; ``kw`` as :func:`serve_plan` takes them
    (not ``quant`` or ``kv_dtype``)."""
    for key in ("quant", "kv_dtype"):
        if key in kw:
            raise VramctlError(f"serve_variants sets {key} itself; give the other settings")
    return [serve_plan(model, device, quant=q, kv_dtype=kv, **kw) for _, q, kv in VARIANTS]


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _precision(config: Any, dtype: str, target: Target) -> str:
    if dtype not in ("auto", "bf16", "fp16", "fp32"):
        raise VramctlError(f"dtype must be one of auto, bf16, fp16, fp32, got {dtype!r}")
    bf16_ok = target.capability is None or target.capability.major >= 8
    if dtype == "auto":
        text = _text(config)
        given = str(getattr(text, "dtype", None) or getattr(config, "torch_dtype", "") or "")
        dtype = "fp16" if "float16" in given and "bfloat" not in given else "bf16"
    if dtype == "bf16" and not bf16_ok:
        return "fp16"
    return dtype


def rank_config(config: Any, tp: int) -> Any:
    """A copy of ``config`` as one of ``tp`` tensor-parallel ranks holds the model: attention
    and KV heads, MLP and expert widths and the vocabulary divided (a KV head kept where there
    are fewer than ``tp``), the head size kept."""
    out = copy.deepcopy(config)
    if tp == 1:
        return out
    text = _text(out)
    heads = _int(text, "num_attention_heads")
    hidden = _int(text, "hidden_size")
    if heads and hidden and _int(text, "head_dim") is None:
        text.head_dim = hidden // heads
    if heads:
        text.num_attention_heads = heads // tp
    kv = _int(text, "num_key_value_heads")
    if kv:
        text.num_key_value_heads = max(1, kv // tp)
    for key in (
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "vocab_size",
    ):
        value = _int(text, key)
        if value:
            setattr(text, key, -(-value // tp))
    return out


def _trace(
    config: Any,
    tokens: int,
    max_model_len: int,
    tp: int,
    precision: str,
    target: Target,
    quant: Any = None,
) -> _Traced:
    """One rank's weights and the activation peak of a forward of ``tokens`` tokens (as
    sequences of at most ``max_model_len``), logits of the last position only."""
    from vramctl.estimator._estimate import estimate

    length = min(tokens, max_model_len)
    batch = -(-tokens // length)
    est = estimate(
        rank_config(config, tp),
        mode="generate",
        max_new_tokens=1,
        batch_size=batch,
        seq_len=length,
        precision=precision,
        device=target,
        task="causal-lm",
        quant=quant,
    )
    b = est.breakdown
    activation = sum(b.get(k, 0) for k in ("activations", "temporaries", "inputs", "workspaces"))
    vocab = _int(_text(config), "vocab_size") or 0
    notes = tuple(n for n in est.notes if "quantiz" in n or "not modelled" in n)
    return _Traced(int(b.get("parameters", 0)), int(activation), vocab, notes)


def _vllm(
    target: Target,
    kv: KVShape,
    t: _Traced,
    max_model_len: int,
    *,
    utilization: float,
    batched: int,
    seqs: int,
    model_bytes: int,
    cuda_graphs: int,
    non_torch: int,
    target_concurrency: int | None,
) -> EngineBudget:
    capacity = target.capacity
    context = target.constants.context_bytes
    sampler = seqs * t.vocab * (model_bytes + 4 * _SAMPLER_FP32_COPIES)
    activation = max(t.activation, sampler)
    fixed = t.weights + activation + non_torch + cuda_graphs
    budget = int(capacity * utilization)
    available = budget - fixed
    # vLLM's blocks span every attention layer: num_blocks = available // page // layers
    units = max(0, available) // kv.unit_bytes()
    blocks = units // kv.layers if kv.layers else 0
    if kv.layers:
        units = blocks * kv.layers
    tokens = blocks * BLOCK_SIZE
    per_request = kv.request_blocks(max_model_len)
    concurrency = units / per_request if per_request else 0.0
    error = None
    most = (capacity - context) / capacity
    if utilization > most:
        error = (
            f"free memory on device ({(capacity - context) / GiB:.2f} GiB) is less than "
            f"desired GPU memory utilization ({utilization}, {budget / GiB:.2f} GiB)"
        )
    elif available <= 0:
        error = (
            "No available memory for the cache blocks: the weights, activations and "
            f"buffers take {fixed / GiB:.2f} GiB of the {budget / GiB:.2f} GiB budget"
        )
    elif concurrency < 1:
        longest = _longest(kv, units, max_model_len)
        error = (
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"{kv.request_bytes(max_model_len) / GiB:.2f} GiB KV cache is needed, which is "
            f"larger than the available KV cache memory ({available / GiB:.2f} GiB); the "
            f"estimated maximum model length is {longest}"
        )
    suggestions = []

    def utilization_for(requests: int) -> float:
        need = fixed + requests * kv.request_bytes(max_model_len)
        return math.ceil(need / capacity * 100) / 100

    if error is not None or (target_concurrency and concurrency < target_concurrency):
        want = target_concurrency or 1
        u = utilization_for(want)
        if u <= most:
            suggestions.append(
                f"--gpu-memory-utilization {u:.2f} holds {want} request(s) of {max_model_len} "
                "tokens"
            )
        else:
            top = math.floor(most * 100) / 100
            room = max(0, int(capacity * top) - fixed) // kv.unit_bytes()
            fit = room // per_request if per_request else 0
            if fit >= 1:
                suggestions.append(
                    f"--gpu-memory-utilization {top:.2f} holds {fit} request(s) of "
                    f"{max_model_len} tokens, the most this GPU can"
                )
            longest = _longest(kv, room // want, max_model_len)
            if longest and longest < max_model_len:
                suggestions.append(
                    f"--gpu-memory-utilization {top:.2f} --max-model-len {longest} holds "
                    f"{want} request(s)"
                )
            if not fit and not longest:
                suggestions.append(
                    "the weights and buffers alone do not fit: more GPUs (--tp), a quantized "
                    "checkpoint or a smaller model"
                )
    elif utilization_for(max(1, math.floor(concurrency))) < utilization - 0.01:
        u = utilization_for(max(1, math.floor(concurrency)))
        n = max(1, math.floor(concurrency))
        suggestions.append(
            f"--gpu-memory-utilization {u:.2f} still holds {n} request(s) of {max_model_len} "
            "tokens, and leaves the rest of the GPU to other processes"
        )
    return EngineBudget(
        engine="vllm",
        settings={
            "gpu_memory_utilization": utilization,
            "max_model_len": max_model_len,
            "max_num_batched_tokens": batched,
            "max_num_seqs": seqs,
            "block_size": BLOCK_SIZE,
            "enforce_eager": cuda_graphs == 0,
        },
        capacity=capacity,
        budget=budget,
        weights=t.weights,
        activation=activation,
        non_torch=non_torch,
        cuda_graphs=cuda_graphs,
        kv_bytes=max(0, available),
        kv_tokens=tokens,
        blocks=blocks if kv.layers else None,
        max_model_len=max_model_len,
        concurrency=concurrency,
        starts=error is None,
        error=error,
        suggestions=tuple(suggestions),
        notes=(
            f"activation: the profiling forward of {batched} tokens (traced) or the sampler's "
            f"logits for {seqs} requests, the larger",
        ),
    )


def _longest(kv: KVShape, layer_blocks: int, cap: int) -> int:
    """The longest request whose pages fit in ``layer_blocks`` (vLLM's binary search)."""
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv.request_blocks(mid) <= layer_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _sglang(
    target: Target,
    kv: KVShape,
    t: _Traced,
    max_model_len: int,
    *,
    fraction: float,
    default_fraction: bool,
    chunk: int,
    graph_bs: int,
    tp: int,
    target_concurrency: int | None,
) -> EngineBudget:
    capacity = target.capacity
    context = target.constants.context_bytes
    before = capacity - context
    after = before - t.weights
    reserved = int(before * (1 - fraction))
    rest = after - reserved
    cell = kv.token_bytes()
    # a request's state sits in its own pool beside the tokens' (SGLang's hybrid models)
    per_request = max_model_len * cell + kv.state_bytes()
    concurrency = max(0, rest) / per_request if per_request else 0.0
    if kv.state_layers:
        tokens = int(concurrency * max_model_len) if cell else 0
    else:
        tokens = max(0, rest // cell) if cell else 0
        concurrency = tokens / max_model_len
    error = None
    if rest <= 0 or (cell and tokens <= 0):
        error = "Not enough memory. Please try to increase --mem-fraction-static."
    # What is left outside the pool must hold a prefill chunk's activations and the graphs.
    graphs = graph_bs * 2 * MiB
    left = reserved
    suggestions = []
    notes = [
        f"the pool's {(capacity - context - t.weights - left) / GiB:.2f} GiB is what the "
        f"static fraction leaves after the weights; {left / GiB:.2f} GiB stay outside it"
    ]
    if 0 < tokens < max_model_len:
        notes.append(
            f"a request of {max_model_len} tokens does not fit the {tokens}-token pool: "
            "SGLang starts, and rejects inputs that long"
        )
    if t.activation + graphs > left:
        notes.append(
            f"the traced prefill of a {chunk}-token chunk peaks at {t.activation / GiB:.2f} "
            f"GiB, and CUDA graphs to batch {graph_bs} take about {graphs / GiB:.2f} GiB, more "
            f"than the {left / GiB:.2f} GiB outside the pool: a long prefill may run out of "
            "memory; lower --mem-fraction-static or --chunked-prefill-size"
        )

    def fraction_for(requests: int) -> float:
        return math.ceil((1 - (after - requests * per_request) / before) * 1000) / 1000

    want = target_concurrency or (1 if concurrency < 1 else 0)
    if want and concurrency < want:
        f = fraction_for(want)
        # the largest fraction that still leaves a prefill chunk and the graphs their room
        top = math.floor((1 - (t.activation + graphs) / before) * 1000) / 1000
        if f <= top:
            suggestions.append(
                f"--mem-fraction-static {f:.3f} holds {want} request(s) of {max_model_len} tokens"
            )
        else:
            room = max(0, after - int(before * (1 - top)))
            fit = room // per_request
            # the longest context at which ``want`` requests fit
            longest = (room // want - kv.state_bytes()) // cell if cell else 0
            if fit >= 1:
                suggestions.append(
                    f"--mem-fraction-static {top:.3f} holds {fit} request(s) of "
                    f"{max_model_len} tokens, the most this GPU can"
                )
            if 1 <= longest < max_model_len:
                suggestions.append(
                    f"--mem-fraction-static {top:.3f} --context-length {longest} holds "
                    f"{want} request(s)"
                )
            if fit < 1 and longest < 1:
                suggestions.append(
                    "the weights leave no room: more GPUs (--tp), a quantized checkpoint or a "
                    "smaller model"
                )
    settings: dict[str, Any] = {
        "mem_fraction_static": fraction,
        "context_length": max_model_len,
        "chunked_prefill_size": chunk,
        "cuda_graph_max_bs": graph_bs,
        "page_size": 1,
    }
    if default_fraction:
        notes.append(
            f"mem_fraction_static {fraction} is SGLang's default for this GPU and --tp {tp}"
        )
    return EngineBudget(
        engine="sglang",
        settings=settings,
        capacity=capacity,
        budget=int(before * fraction),
        weights=t.weights,
        activation=t.activation,
        non_torch=0,
        cuda_graphs=graphs,
        kv_bytes=max(0, tokens * cell),
        kv_tokens=tokens,
        blocks=None,
        max_model_len=max_model_len,
        concurrency=concurrency,
        starts=error is None,
        error=error,
        suggestions=tuple(suggestions),
        notes=tuple(notes),
    )


def with_capacity(target: Target, capacity: int) -> Target:
    """``target`` with another memory total (a GPU whose logs give its own)."""
    return dataclasses.replace(target, capacity=capacity)
