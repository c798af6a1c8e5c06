"""plan_quality: does vramctl.plan pick a plan that fits and runs near the fastest?

For six small models (two transformers, a vision transformer, a CNN, a speech model and an
LSTM) and three simulated devices per model (tight, medium and roomy: their budgets put
the plain fp32 step's largest micro-batch near 15%, 40% and 120% of the effective batch),
``vramctl.plan`` prices precision x checkpointing x offloading x optimizer x micro-batch
without running anything. Then every plan it priced as fitting is run for real:

- on the simulated device of the target's size (real steps, real out-of-memory errors):
  does it fit, and its measured peak;
- on the CPU outside the simulation (the simulation's bookkeeping would slow each
  operator): its measured time per effective batch.

Figures: ``worst_throughput_gap_pct`` (the chosen plan's measured throughput against the
fastest feasible plan's, worst case; goal <= 10), ``plans_that_did_not_fit`` (chosen plans
that ran out of memory; goal 0), ``step_time_mape_pct`` (predicted against measured time
per effective batch over every plan run; goal <= 15 on the CPU), and the memory each
optimization saves, predicted against measured. The models are small so that every plan
runs in seconds on a CPU; the devices are scaled to them.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import _common


def _models() -> dict[str, tuple[Callable[[], Any], Callable[[int], Any]]]:
    import torch
    import transformers as tf

    from vramctl.estimator import zoo

    def text(n: int, seq: int = 128, vocab: int = 8000) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (n, seq))
        return {"input_ids": ids, "labels": ids.clone()}

    def images(n: int, size: int = 64) -> dict[str, Any]:
        return {"pixel_values": torch.randn(n, 3, size, size), "labels": torch.randint(0, 10, (n,))}

    def audio(n: int, samples: int = 16000) -> dict[str, Any]:
        return {"input_values": torch.randn(n, samples), "labels": torch.randint(1, 32, (n, 12))}

    def gpt2() -> Any:
        cfg = tf.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=256)
        return tf.GPT2LMHeadModel(cfg)

    def bert() -> Any:
        cfg = tf.BertConfig(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=8000,
        )
        return tf.BertForMaskedLM(cfg)

    def vit() -> Any:
        cfg = tf.ViTConfig(
            hidden_size=192,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=768,
            image_size=64,
            patch_size=8,
            num_labels=10,
        )
        return tf.ViTForImageClassification(cfg)

    def resnet() -> Any:
        cfg = tf.ResNetConfig(
            embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[2, 2, 2, 2], num_labels=10
        )
        return tf.ResNetForImageClassification(cfg)

    def wav2vec2() -> Any:
        cfg = tf.Wav2Vec2Config(
            hidden_size=192,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=768,
            conv_dim=(128, 128, 128, 128, 128, 128, 128),
            vocab_size=32,
        )
        return tf.Wav2Vec2ForCTC(cfg)

    def lstm() -> Any:
        return zoo.LstmLanguageModel(vocab_size=8000, hidden=256, layers=2)

    return {
        "gpt2-small4": (gpt2, text),
        "bert-small4": (bert, text),
        "vit-small4": (vit, images),
        "resnet-small": (resnet, images),
        "wav2vec2-small4": (wav2vec2, audio),
        "lstm-256": (lstm, lambda n: {"input_ids": torch.randint(0, 8000, (n, 128))}),
    }


def _run_plan(
    plan: Any, build: Callable[[], Any], make_batch: Callable[[int], Any], device: Any, steps: int
) -> tuple[bool, int, float | None]:
    """Run ``plan``: (fits on the simulated device, its measured peak, seconds per effective
    batch on the CPU)."""
    import torch

    from vramctl.estimator import StepSpec

    spec = StepSpec(precision=plan.precision)
    micro = [make_batch(plan.micro_batch) for _ in range(plan.accumulation)]

    def effective_step(model: Any, step: Any) -> None:
        for batch in micro:
            with step.autocast():
                out = model(**batch)
                loss = spec.loss(out, batch) / plan.accumulation
            step.backward(loss)
        step.step()

    # fit: on the simulated device
    fits, peak = True, 0
    with device:
        torch.manual_seed(0)
        model = device.adopt(build())
        applied = plan.apply(model, device=device)
        try:
            with device.peak_meter() as meter:
                effective_step(applied.model, applied.step)
                effective_step(applied.model, applied.step)
            peak = meter.peak_allocated
        except torch.OutOfMemoryError:
            fits = False
        finally:
            applied.undo()
            del model, applied
            gc.collect()
    if not fits:
        return False, peak, None
    # time: on the CPU, with the same settings (offloading as copies to host memory)
    torch.manual_seed(0)
    model = build()
    applied = plan.apply(model, device="cpu")
    offload = plan.offload == "activations"
    times = []
    try:
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            with contextlib.ExitStack() as stack:
                if offload:
                    stack.enter_context(
                        torch.autograd.graph.saved_tensors_hooks(
                            lambda t: t.detach().clone(), lambda t: t.clone()
                        )
                    )
                effective_step(applied.model, applied.step)
            times.append(time.perf_counter() - t0)
    finally:
        applied.undo()
    return True, peak, statistics.median(times[1:])


def _targets(
    build: Callable[[], Any], make_batch: Callable[[int], Any], effective: int, names: list[str]
) -> dict[str, int]:
    """Device sizes whose fp32 step's largest micro-batch is about 15%, 40% and 120% of the
    effective batch (by the estimate; the runs then say whether it was right)."""
    import torch

    import vramctl

    with torch.device("meta"):
        model = build()
    one = vramctl.estimate(model, make_batch(1), device="cpu").peak_device
    two = vramctl.estimate(model, make_batch(2), device="cpu").peak_device
    per = max(1, two - one)
    share = {"tight": 0.15, "medium": 0.4, "roomy": 1.2}
    return {n: int((one + per * (share[n] * effective - 1)) / 0.9) for n in names}


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(__doc__, quick="two models, one device each; under a minute", threads=False)
    ap.add_argument("--effective-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2, help="timed effective batches per plan")
    args = _common.parse(ap, argv)
    import torch

    import vramctl
    from vramctl.optimize import plan

    torch.manual_seed(0)
    models = _models()
    if args.quick:
        chosen = {"gpt2-small4": ["tight"]}
        axes: dict[str, Any] = {
            "offload": ["none"],
            "optimizers": ["adamw"],
            "checkpointing": ["none", "full"],
        }
    else:
        chosen = {name: ["tight", "medium", "roomy"] for name in models}
        axes = {"offload": ["none", "activations"], "optimizers": ["adamw", "adamw-fused"]}
    rows: list[dict[str, Any]] = []
    gaps: list[float] = []
    errors: list[float] = []
    memory: list[dict[str, Any]] = []
    did_not_fit = 0
    for name, targets in chosen.items():
        build, make_batch = models[name]
        sizes = _targets(build, make_batch, args.effective_batch, targets)
        for target, size in sizes.items():
            device = vramctl.simulate(size)
            with torch.device("meta"):
                meta = build()
            t0 = time.perf_counter()
            result = plan(
                meta,
                make_batch,
                device=device,
                effective_batch=args.effective_batch,
                precisions=["fp32", "amp-bf16"],
                **axes,
            )
            planned = time.perf_counter() - t0
            measured: list[tuple[Any, bool, int, float | None]] = []
            for p in result.plans:
                if not p.fits:
                    continue
                fits, peak, seconds = _run_plan(p, build, make_batch, device, args.steps)
                measured.append((p, fits, peak, seconds))
                if seconds is not None and p.seconds is not None:
                    errors.append(abs(p.seconds - seconds) / seconds)
                if p.estimate is not None and fits:
                    memory.append(
                        {
                            "model": name,
                            "plan": p.label,
                            "predicted_bytes": p.peak_bytes,
                            "measured_bytes": peak,
                        }
                    )
            best = result.best
            feasible = [(p, s) for p, f, _, s in measured if f and s]
            chosen_run = next(((f, s) for p, f, _, s in measured if p is best), (False, None))
            if best is not None and not chosen_run[0]:
                did_not_fit += 1
            fastest = min((s for _, s in feasible), default=None)
            gap = None
            if fastest and chosen_run[1]:
                gap = 100 * (chosen_run[1] - fastest) / chosen_run[1]
                gaps.append(gap)
            rows.append(
                {
                    "model": name,
                    "target": target,
                    "capacity_bytes": size,
                    "chosen": best.label if best else None,
                    "chosen_fits": chosen_run[0],
                    "chosen_predicted_s": best.seconds if best else None,
                    "chosen_measured_s": chosen_run[1],
                    "fastest_measured_s": fastest,
                    "fastest_plan": next((p.label for p, s in feasible if s == fastest), None),
                    "throughput_gap_pct": round(gap, 1) if gap is not None else None,
                    "plans_priced": len(result.plans),
                    "plans_run": len(measured),
                    "plan_seconds": round(planned, 1),
                }
            )
            print(rows[-1], file=sys.stderr, flush=True)
    saved = _savings(memory)
    summary = {
        "benchmark": "plan_quality",
        "quick": args.quick,
        "machine": _common.machine(False),
        "effective_batch": args.effective_batch,
        "worst_throughput_gap_pct": round(max(gaps), 1) if gaps else None,
        "plans_that_did_not_fit": did_not_fit,
        "step_time_mape_pct": round(100 * statistics.mean(errors), 1) if errors else None,
        "memory_error_pct_median": saved,
        "rows": rows,
    }
    ok = (
        did_not_fit == 0
        and bool(gaps)
        and max(gaps) <= 10
        and bool(errors)
        and 100 * statistics.mean(errors) <= 15
    )
    return _common.finish(summary, ok)


def _savings(memory: list[dict[str, Any]]) -> float | None:
    """The median error of the predicted peaks of the plans run (per-optimization savings
    are not reported apart)."""
    errs = [
        abs(m["predicted_bytes"] - m["measured_bytes"]) / m["measured_bytes"]
        for m in memory
        if m["measured_bytes"]
    ]
    return round(100 * statistics.median(errs), 1) if errs else None


if __name__ == "__main__":
    raise SystemExit(main())
