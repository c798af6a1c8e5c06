"""Generation estimates (``mode="generate"``) against real ``model.generate`` on the CPU.

Rows: shrunk decoder configs (Llama with grouped-query attention, Qwen2, Gemma-2 with a
sliding window on every other layer, Mistral) x prompt length, new tokens and batch x the
cache (``dynamic``, transformers' default, and ``static``): the peak of
``vramctl.estimate(model, prompt, mode="generate", max_new_tokens=N, cache=...)`` against
the real greedy ``generate``'s (PyTorch's profiler, after a warm-up generate; the weights and
the prompt counted once). Goals: median error <= 1%, max <= 3%, worst under-estimate <= 2%.

Not covered yet: encoder-decoder models (T5, Whisper: refused with a clear error), Mamba and
hybrid models, offloaded caches, and the serving plan (issue 47's second part).

    python benchmarks/estimate_generate.py --quick
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import estimate_finetune

import _common

QUICK = "Llama, two shapes, both caches; under a minute"

#: estimate_finetune's shrunk decoder, with room for the longest generation here.
_SHRUNK = {**estimate_finetune._SHRUNK, "max_position_embeddings": 1024}
SMALL = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "gemma2": ("Gemma2Config", {"head_dim": 32, "sliding_window": 32, "num_hidden_layers": 4}),
}
#: (batch, prompt tokens, new tokens)
SHAPES = ((2, 64, 32), (1, 256, 8), (4, 16, 96))
CACHES = ("dynamic", "static")
QUICK_ROWS = (("llama",), SHAPES[:2])


def build(kind: str) -> tuple[Any, Any]:
    import torch
    import transformers

    name, extra = SMALL[kind]
    cfg = getattr(transformers, name)(**{**_SHRUNK, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, as the estimate
    return cfg, model


def measure(model: Any, ids: Any, new: int, cache: str) -> int:
    import torch

    def run() -> None:
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                cache_implementation=cache,
            )

    run()  # warm-up
    held = [*model.parameters(), *model.buffers(), ids]
    return _common.storages_bytes(held) + _common.profiled_peak(run)


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(__doc__, quick=QUICK)
    args = _common.parse(ap, argv)
    import torch

    import vramctl

    t0 = time.perf_counter()
    kinds, shapes = QUICK_ROWS if args.quick else (tuple(SMALL), SHAPES)
    rows = []
    with _common.quiet():
        for kind in kinds:
            for batch, prompt, new in shapes:
                for cache in CACHES:
                    # a fresh model per row: generate keeps a static cache on the model
                    cfg, model = build(kind)
                    ids = torch.randint(
                        0,
                        cfg.vocab_size,
                        (batch, prompt),
                        generator=torch.Generator().manual_seed(1),
                    )
                    real = measure(model, ids, new, cache)
                    est = vramctl.estimate(
                        model, ids, device="cpu", mode="generate", max_new_tokens=new, cache=cache
                    )
                    err = (est.peak_allocated - real) / real * 100
                    row = {
                        "model": kind,
                        "batch": batch,
                        "prompt": prompt,
                        "new": new,
                        "cache": cache,
                        "estimate": est.peak_allocated,
                        "measured": real,
                        "kv_cache": est.breakdown.get("kv_cache", 0),
                        "error_pct": round(err, 3),
                    }
                    rows.append(row)
                    print(
                        f"{kind:8} b{batch} prompt {prompt:4} new {new:4} {cache:8} estimate "
                        f"{est.peak_allocated:>10,} measured {real:>10,} error {err:+.3f}%",
                        file=sys.stderr,
                        flush=True,
                    )
                    gc.collect()
    figures, ok = _common.accuracy_figures([(r["estimate"], r["measured"]) for r in rows])
    summary = {
        "benchmark": "estimate_generate",
        "quick": args.quick,
        "machine": _common.machine(False),
        "transformers": _common.version("transformers"),
        **figures,
        "by_row": {
            f"{r['model']} b{r['batch']} p{r['prompt']} n{r['new']} {r['cache']}": r["error_pct"]
            for r in rows
        },
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    return _common.finish(summary, ok)


if __name__ == "__main__":
    sys.exit(main())
