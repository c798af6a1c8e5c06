"""Does the estimator trace every model a user brings, and is it right on each?

For every model class that transformers' auto mappings list for causal LM, masked LM,
sequence classification, CTC, image classification, speech seq2seq and seq2seq LM (and one
model per architecture of timm's registry, where timm is installed; beside a CPU build of
PyTorch whose torchvision wheel cannot load its C++ operators, torchvision is imported without
their fake kernels, as the CUDA truth cases do), the model is built from
its config class's defaults shrunk to at most 2 layers and a small hidden size, so that a
real step runs here. One training step (AdamW) and one inference step run at batch 2, each
twice: for real on the CPU, where the truth is the live bytes before the step plus the peak of
PyTorch's profiler memory timeline (as in ``estimate_accuracy``), and as an estimate for a
CPU target, from the config the way ``vramctl estimate <config.json>`` makes it (the model
built on fake tensors, the batch made by ``ConfigModel.make_batch``).

A class counts as ``built`` when its real steps ran, and as ``estimated`` when both its
estimates did too; ``coverage_pct`` is estimated / built. Classes whose config cannot be
shrunk into a model that runs are listed by reason, and do not count against coverage.

    python benchmarks/estimate_coverage.py --quick      # a fixed sample of 20 classes
    python benchmarks/estimate_coverage.py              # every class (about half an hour)
    python benchmarks/estimate_coverage.py --only mixtral,mamba --verbose
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import logging
import os
import re
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import _common

#: The task mappings swept (vramctl's task names).
TASKS = (
    "causal-lm",
    "masked-lm",
    "seq-classification",
    "ctc",
    "image-classification",
    "speech-seq2seq",
    "seq2seq-lm",
)
#: The --quick sample: (task, model type), 20 transformers classes, one per family worth
#: watching (dense, MoE by grouped GEMM and by loop, state-space, recurrent, hybrid,
#: encoders, encoder-decoders, speech CTC and seq2seq, vision), and timm's ResNet.
QUICK = [
    ("causal-lm", "gpt2"),
    ("causal-lm", "llama"),
    ("causal-lm", "mixtral"),
    ("causal-lm", "qwen3_moe"),
    ("causal-lm", "mamba"),
    ("causal-lm", "jamba"),
    ("causal-lm", "lfm2"),
    ("masked-lm", "bert"),
    ("seq-classification", "roberta"),
    ("seq2seq-lm", "t5"),
    ("seq2seq-lm", "bart"),
    ("speech-seq2seq", "whisper"),
    ("speech-seq2seq", "speech_to_text"),
    ("ctc", "wav2vec2"),
    ("ctc", "hubert"),
    ("ctc", "parakeet_ctc"),
    ("image-classification", "vit"),
    ("image-classification", "convnext"),
    ("image-classification", "resnet"),
    ("causal-lm", "jetmoe"),
    ("timm", "resnet"),  # where timm is installed: a 21st
]
#: The inputs of a step: tokens, seconds of audio, and (None: the config's) image side.
SIZES: dict[str, Any] = {"seq_len": 32, "seconds": 1.0, "image_size": None}
#: The same for --quick (a minute for the whole sample).
QUICK_SIZES: dict[str, Any] = {"seq_len": 16, "seconds": 0.5, "image_size": 64}
BATCH = 2
#: Seconds one class may take (build, two real steps, two estimates) before it is dropped.
CLASS_TIMEOUT = 60
#: A shrunk model larger than this is not run (it would not be "small").
MAX_PARAMS = 150_000_000

_LAYERS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "num_hidden_blocks",
)
_WIDTH = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim")
_FFN = (
    "intermediate_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "d_ff",
    "n_inner",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
_HEADS = (
    "num_attention_heads",
    "n_head",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "num_heads",
)


@dataclass
class Row:
    family: str
    task: str
    cls: str
    built: bool = False
    estimated: bool = False
    errors: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    shrink: str = ""
    params: int = 0
    seconds: float = 0.0
    #: The architecture group the class is counted in (see :func:`group_of`).
    group: str = ""


# -- shrinking a config ----------------------------------------------------------------------


def _configs(config: Any) -> Iterator[Any]:
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


#: The shrink levels tried in turn, most compact first.
LEVELS = ("heads", "hidden", "ffn", "layers")
VOCAB = 4096


def shrink(config: Any, level: str) -> Any:
    """At most 2 layers; then, by level, 4 heads of the config's own head size (``heads``)
    or of 16 (``hidden``, a 64-wide model), small FFNs, at most 4 experts and a vocabulary
    of at most 4096 (``heads``, ``hidden``, ``ffn``), or the layers alone (``layers``)."""
    for c in _configs(config):
        _layers(c)
        if level == "layers":
            continue
        for name in _FFN:
            v = getattr(c, name, None)
            if isinstance(v, int) and v > 256:
                setattr(c, name, 256)
        for name in ("num_experts", "num_local_experts", "n_routed_experts", "zero_expert_num"):
            v = getattr(c, name, None)
            if isinstance(v, int) and v > 4:
                setattr(c, name, 4)
        for name in ("num_experts_per_tok", "top_k", "moe_topk", "topk_group", "n_group"):
            v = getattr(c, name, None)
            if isinstance(v, int) and v > 2:
                setattr(c, name, 2 if "group" not in name else 1)
        _vocab(c)
        if level in ("heads", "hidden"):
            _width(c, level)
    return config


def _layers(c: Any) -> None:
    """At most 2 layers; a hybrid keeps one layer of each of its kinds (an attention layer
    and a state-space one, a dense MLP and a sparse one)."""
    aliases = getattr(c, "attribute_map", {}) or {}
    count = getattr(c, "num_hidden_layers", None)
    per_layer = {
        k: v
        for k, v in vars(c).items()
        if isinstance(v, list)
        and isinstance(count, int)
        and len(v) == count > 2
        and k not in aliases
        and all(isinstance(x, str | int | float) for x in v)
    }
    kinds = [k for k in per_layer if k.endswith(("layer_types", "block_type", "block_types"))]
    keep: list[int] = []
    for k in kinds:  # the first layer of each kind
        seen: set[Any] = set()
        for i, value in enumerate(per_layer[k]):
            if value not in seen:
                seen.add(value)
                keep.append(i)
    keep = sorted(set(keep))[:4]
    for i in range(count or 0):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep = sorted({*keep, i})
    for name in _LAYERS:
        if name in aliases:  # another name for a field (ConvNeXt's stages): not a count
            continue
        v = getattr(c, name, None)
        if isinstance(v, int) and v > 2:
            setattr(c, name, len(keep) if name == "num_hidden_layers" and per_layer else 2)
    for k, v in per_layer.items():
        setattr(c, k, [v[i] for i in keep])
    for name, value in (("attn_layer_period", 2), ("attn_layer_offset", 1)):
        if isinstance(getattr(c, name, None), int):
            setattr(c, name, value)
    for name, value in (("expert_layer_period", 2), ("expert_layer_offset", 1)):
        if isinstance(getattr(c, name, None), int):
            setattr(c, name, value)
    v = getattr(c, "depths", None)
    if isinstance(v, list | tuple) and v and all(isinstance(x, int) for x in v):
        c.depths = [min(x, 1) for x in v]
    if getattr(c, "layerdrop", None):
        c.layerdrop = 0.0  # the estimate is for the step that drops no layer
    if isinstance(getattr(c, "first_k_dense_replace", None), int):
        c.first_k_dense_replace = min(c.first_k_dense_replace, 1)


def _vocab(c: Any) -> None:
    v = getattr(c, "vocab_size", None)
    if not isinstance(v, int) or v <= VOCAB:
        return
    c.vocab_size = VOCAB
    spare = VOCAB - 1
    for key, value in list(vars(c).items()):
        special = key.endswith(("_token_id", "_token_index")) and isinstance(value, int)
        if special and value >= VOCAB:
            setattr(c, key, spare)
            spare -= 1


def _width(c: Any, level: str) -> None:
    width = next((n for n in _WIDTH if isinstance(getattr(c, n, None), int)), None)
    heads = next((n for n in _HEADS if isinstance(getattr(c, n, None), int)), None)
    if width is None:
        return
    old_heads = getattr(c, heads) if heads else 0
    head_dim = getattr(c, "head_dim", None)
    if not isinstance(head_dim, int):
        head_dim = getattr(c, width) // old_heads if old_heads else 16
    if level == "hidden":
        head_dim = 16
        derived = getattr(type(c), "head_dim", None)  # Falcon's: width // heads, read-only
        if isinstance(getattr(c, "head_dim", None), int) and not isinstance(derived, property):
            c.head_dim = 16
    new = 4 * head_dim if heads else 64
    if getattr(c, width) <= new:
        return
    setattr(c, width, new)
    for name in _HEADS:
        if isinstance(getattr(c, name, None), int):
            setattr(c, name, 4)
    kv = getattr(c, "num_key_value_heads", None)
    if isinstance(kv, int):  # multi-head stays multi-head, multi-query stays multi-query
        c.num_key_value_heads = 1 if kv == 1 else 4 if kv == old_heads else 2


# -- architecture groups -------------------------------------------------------------------

_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_STATE = ("state_size", "ssm_state_size", "mamba_d_state", "d_state", "conv_L_cache")
GROUPS = (
    "mixture of experts",
    "state-space and recurrent",
    "encoder-decoder text",
    "speech seq2seq",
    "speech CTC",
    "vision",
    "decoder LM",
    "encoder (masked LM, classification)",
)


def group_of(config: Any, task: str) -> str:
    """The architecture group a class is reported in, from its config and task."""
    subs = list(_configs(config))
    if any(
        isinstance(getattr(c, n, None), int) and getattr(c, n) > 1 for c in subs for n in _EXPERTS
    ):
        return GROUPS[0]
    recurrent = ("rwkv", "xlstm", "recurrent", "mamba", "ssm", "lfm2")
    if any(getattr(c, n, None) for c in subs for n in _STATE) or any(
        r in getattr(config, "model_type", "") for r in recurrent
    ):
        return GROUPS[1]
    if task == "speech-seq2seq":
        return GROUPS[3]
    if task == "ctc":
        return GROUPS[4]
    if task == "image-classification":
        return GROUPS[5]
    if task == "seq2seq-lm" or getattr(config, "is_encoder_decoder", False):
        return GROUPS[2]
    if task == "causal-lm":
        return GROUPS[6]
    return GROUPS[7]


def markdown(rows: list[Row]) -> str:
    """The tables of docs/benchmarks/estimate_coverage.md: per group and per task, then
    every class not estimated or off by more than 1%."""

    def line(name: str, group: list[Row]) -> str:
        built = [r for r in group if r.built]
        done = [r for r in built if r.estimated]
        errs = [e for r in done for e in r.errors.values()]
        med = f"{statistics.median(abs(e) for e in errs):.2f}%" if errs else "-"
        worst = f"{max(abs(e) for e in errs):.2f}%" if errs else "-"
        under = f"{max([0.0] + [-e for e in errs]):.2f}%" if errs else "-"
        cover = f"{100.0 * len(done) / len(built):.1f}%" if built else "-"
        cells = [name, len(group), len(built), len(done), cover, med, worst, under]
        return "| " + " | ".join(str(c) for c in cells) + " |"

    head = (
        "| {} | classes | built | estimated | coverage | median error | max error | "
        "worst under-estimate |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    out = [head.format("architecture group")]
    out += [
        line(g, [r for r in rows if r.group == g])
        for g in GROUPS
        if any(r.group == g for r in rows)
    ]
    out += ["", head.format("task mapping")]
    out += [
        line(t, [r for r in rows if r.task == t]) for t in TASKS if any(r.task == t for r in rows)
    ]
    out += ["", "| class | task | train | infer | note |", "| --- | --- | ---: | ---: | --- |"]
    for r in rows:
        off = r.estimated and max(abs(e) for e in r.errors.values()) > 1.0
        if r.built and (not r.estimated or off):
            tr, inf = (f"{r.errors[m]:+.2f}%" if m in r.errors else "-" for m in ("train", "infer"))
            out.append(f"| {r.cls} | {r.task} | {tr} | {inf} | {r.reason or ''} |")
    return "\n".join(out) + "\n"


# -- one class ---------------------------------------------------------------------------------


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def fire(*_: Any) -> None:
        raise Timeout(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def reason_of(exc: BaseException) -> str:
    """A short, stable key for a failure (numbers and quoted names folded)."""
    text = f"{type(exc).__name__}: {exc}"
    m = re.search(r"op (aten\.[\w.]+|[\w.]+::\w+)", text)
    if m:
        return f"{type(exc).__name__}: op {m.group(1)}"
    text = re.sub(r"\d+", "N", text.splitlines()[0] if text else "")
    return text[:90]


def real_peaks(batch_of: Any, build: Any) -> dict[str, int]:
    """The real CPU peak of a train and an infer step at batch 2 (``batch_of(mode)``)."""
    from vramctl.estimator._spec import StepSpec, prepare_model, warm_optimizer

    out = {}
    for mode in ("train", "infer"):
        torch.manual_seed(0)
        model = build()
        spec = StepSpec(mode=mode)
        prepare_model(model, spec)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = spec.make_optimizer(params)
        if opt is not None:
            warm_optimizer(opt, params)
        data = batch_of(mode)
        out[mode] = _common.cpu_step_peak(model, data, spec, opt)
        del model, opt, data
        gc.collect()
    return out


def _fill(batch: Any) -> Any:
    if isinstance(batch, dict):
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                batch[k] = v.normal_()
    elif isinstance(batch, torch.Tensor) and batch.is_floating_point():
        batch.normal_()
    return batch


def run_transformers(task: str, model_type: str, class_name: str, verbose: bool) -> Row:
    import transformers

    from vramctl.estimator import estimate
    from vramctl.estimator._hub import config_model

    row = Row(model_type, task, class_name)
    t0 = time.perf_counter()
    cfg_cls = transformers.CONFIG_MAPPING[model_type]
    first: BaseException | None = None
    for level in LEVELS:
        try:
            config = shrink(cfg_cls(), level)
            image_size = SIZES["image_size"]
            cm = config_model(config, task=task, image_size=image_size)
            lengths = {"seq_len": SIZES["seq_len"], "seconds": SIZES["seconds"]}
            if cm.inputs == "images":
                lengths = {}

            def batch_of(mode: str, cm: Any = cm, lengths: Any = lengths) -> Any:
                return _fill(cm.make_batch(BATCH, labels=mode == "train", **lengths))

            with torch.device("meta"):
                n = sum(p.numel() for p in cm.build().parameters())
            if n > MAX_PARAMS:
                raise ValueError(f"shrunk model too large ({n // 1_000_000}M parameters)")
            truth = real_peaks(batch_of, cm.build)
        except Timeout:
            raise
        except Exception as exc:
            first = first or exc
            if verbose:
                print(f"#   {class_name} at {level}: {reason_of(exc)}", file=sys.stderr)
            _common.free_failed(exc)
            continue
        row.built, row.shrink, row.params = True, level, n
        row.group = group_of(config, task)
        break
    if not row.built:
        row.reason = "not built: " + reason_of(first) if first else "not built"
        row.seconds = time.perf_counter() - t0
        return row
    sizes = {"image_size": image_size} if cm.inputs == "images" else lengths
    return estimate_row(
        row, truth, lambda mode: estimate(config, task=task, **sizes, **_step(mode)), t0, verbose
    )


def _step(mode: str) -> dict[str, Any]:
    return {"batch_size": BATCH, "mode": mode, "device": "cpu"}


def estimate_row(
    row: Row, truth: dict[str, int], estimate_at: Any, t0: float, verbose: bool
) -> Row:
    """Estimate the train and infer steps (``estimate_at(mode)``) against their truth."""
    try:
        for mode in ("train", "infer"):
            est = estimate_at(mode)
            row.errors[mode] = 100.0 * (est.logical_peak - truth[mode]) / truth[mode]
        row.estimated = True
    except Timeout:
        raise
    except Exception as exc:
        row.reason = reason_of(exc)
        if verbose:
            print(f"#   {exc}", file=sys.stderr)
    row.seconds = time.perf_counter() - t0
    return row


def timm_candidates() -> list[tuple[str, str]]:
    """One small model per timm architecture module: (module, model name)."""
    from _truth.cases import import_vision

    timm = import_vision("timm")  # also where torchvision's C++ operators do not load

    out = []
    for module in sorted(timm.list_modules()):
        names = timm.list_models(module=module)
        if not names:
            continue
        small = ("atto", "femto", "pico", "nano", "tiny", "small", "18", "b0", "_s")
        ranked = sorted(names, key=lambda n: (not any(s in n for s in small), len(n), n))
        out.append((module, ranked[0]))
    return out


def run_timm(module: str, name: str, verbose: bool) -> Row:
    from _truth.cases import import_vision

    from vramctl.estimator import estimate

    timm = import_vision("timm")

    row = Row(f"timm.{module}", "image-classification", name)
    t0 = time.perf_counter()
    try:
        with torch.device("meta"):
            probe = timm.create_model(name, pretrained=False)
        n = sum(p.numel() for p in probe.parameters())
        cfg = getattr(probe, "pretrained_cfg", {}) or {}
        c, h, w = cfg.get("input_size", (3, 224, 224))
        del probe
        if n > MAX_PARAMS:
            raise ValueError(f"smallest model too large ({n // 1_000_000}M parameters)")

        def build() -> Any:
            return timm.create_model(name, pretrained=False)

        def batch_of(mode: str) -> Any:
            return torch.empty(BATCH, c, h, w).normal_()

        truth = real_peaks(batch_of, build)
        row.built, row.params, row.group = True, n, GROUPS[5]
    except Timeout:
        raise
    except Exception as exc:
        row.reason = "not built: " + reason_of(exc)
        _common.free_failed(exc)
        return row
    pixels = torch.empty(BATCH, c, h, w)
    return estimate_row(
        row, truth, lambda mode: estimate(build, pixels, **_step(mode)), t0, verbose
    )


def transformers_classes() -> list[tuple[str, str, str]]:
    """(task, model type, class name) of every class the swept mappings list."""
    from transformers.models.auto import modeling_auto

    from vramctl.estimator import TASKS as MAPPINGS

    out = []
    for task in TASKS:
        mapping = getattr(modeling_auto, MAPPINGS[task][1])
        for model_type, cls in sorted(mapping.items()):
            for name in cls if isinstance(cls, tuple | list) else [cls]:
                out.append((task, model_type, name))
    return out


def main() -> int:
    ap = _common.parser(
        __doc__, quick="a fixed sample of 20 classes (21 with timm), under a minute"
    )
    ap.add_argument("--only", help="comma-separated model types (or timm modules) to run")
    ap.add_argument("--tasks", help="comma-separated task mappings to sweep (default: all)")
    ap.add_argument("--no-timm", action="store_true", help="skip timm's registry")
    ap.add_argument("--verbose", action="store_true", help="print each failure's message")
    ap.add_argument("--rows", help="write every row as JSON lines to this file")
    ap.add_argument("--markdown", help="write the per-group and per-task tables to this file")
    args = _common.parse(ap)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    started = time.perf_counter()

    from _truth.cases import vision_ready

    vision_ready()  # transformers imports torchvision for its image models
    jobs: list[tuple[str, tuple[str, ...]]] = []
    for task, model_type, name in transformers_classes():
        jobs.append(("hf", (task, model_type, name)))
    have_timm = _common.version("timm") is not None
    if have_timm and not args.no_timm:
        jobs += [("timm", m) for m in timm_candidates()]
    if args.quick:
        SIZES.update(QUICK_SIZES)
        wanted = {(t, m) for t, m in QUICK}
        picked: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        for kind, job in jobs:
            key = ("timm", job[0]) if kind == "timm" else (job[0], job[1])
            if key in wanted and key not in picked:
                picked[key] = (kind, job)
        jobs = [picked[k] for k in [(t, m) for t, m in QUICK] if k in picked]
    if args.tasks:
        tasks = set(args.tasks.split(","))
        jobs = [
            (k, j) for k, j in jobs if ("image-classification" if k == "timm" else j[0]) in tasks
        ]
    if args.only:
        only = set(args.only.split(","))
        jobs = [(k, j) for k, j in jobs if (j[0] if k == "timm" else j[1]) in only]

    rows: list[Row] = []
    sink = open(args.rows, "w") if args.rows else None  # noqa: SIM115
    print(f"{'task':<21}{'class':<46}{'train':>9}{'infer':>9}{'s':>6}  note", flush=True)
    for kind, job in jobs:
        try:
            with time_limit(CLASS_TIMEOUT):
                row = (
                    run_timm(*job, args.verbose)
                    if kind == "timm"
                    else run_transformers(*job, args.verbose)
                )
        except Timeout as exc:
            fam, task, name = (
                (f"timm.{job[0]}", "image-classification", job[1])
                if kind == "timm"
                else (job[1], job[0], job[2])
            )
            row = Row(fam, task, name, reason=f"timeout: {exc}")
        gc.collect()
        rows.append(row)
        tr, inf = (f"{row.errors[m]:+.2f}%" if m in row.errors else "-" for m in ("train", "infer"))
        note = row.reason or ""
        print(
            f"{row.task:<21}{row.cls[:45]:<46}{tr:>9}{inf:>9}{row.seconds:>6.1f}  {note}",
            flush=True,
        )
        if sink is not None:
            sink.write(json.dumps(row.__dict__) + "\n")
            sink.flush()
    if sink is not None:
        sink.close()

    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(markdown(rows))
    built = [r for r in rows if r.built]
    estimated = [r for r in built if r.estimated]
    errs = [e for r in estimated for e in r.errors.values()]
    reasons = collections.Counter(r.reason for r in rows if r.reason)
    summary = {
        "benchmark": "estimate_coverage",
        "quick": args.quick,
        "classes": len(rows),
        "built": len(built),
        "estimated": len(estimated),
        "coverage_pct": round(100.0 * len(estimated) / len(built), 2) if built else None,
        "median_error_pct": round(statistics.median(abs(e) for e in errs), 3) if errs else None,
        "max_error_pct": round(max(abs(e) for e in errs), 3) if errs else None,
        "worst_underestimate_pct": round(max([0.0] + [-e for e in errs]), 3) if errs else None,
        "failures_by_reason": dict(reasons.most_common()),
        "transformers": _common.version("transformers"),
        "timm": _common.version("timm"),
        "torch": torch.__version__,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return _common.finish(summary, bool(built) and len(estimated) == len(built))


if __name__ == "__main__":
    sys.exit(main())
