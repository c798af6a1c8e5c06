"""plan_quality: does vramctl.plan pick a plan that fits and runs near the fastest?

For six small models (two transformers, a vision transformer, a CNN, a speech model and an
LSTM) and a wider two-layer GPT-2 whose matrix multiplies take most of its time, and three
simulated devices per model (tight, medium and roomy, two for the wide one: their budgets
put the plain fp32 step's largest micro-batch near 15%, 40% and 120% of the effective batch),
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
optimization saves (amp-bf16, selective and full checkpointing, offloading the activations
or the optimizer's state, each alone against plain fp32 at one micro-batch), predicted
against measured on a simulated device. The models are small so that every plan runs in
seconds on a CPU; the devices are scaled to them.
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

    def gpt2_wide() -> Any:
        # wide enough that its matrix multiplies, not per-operator costs, take the time
        cfg = tf.GPT2Config(n_layer=2, n_embd=768, n_head=12, vocab_size=8000, n_positions=256)
        return tf.GPT2LMHeadModel(cfg)

    return {
        "gpt2-small4": (gpt2, text),
        "bert-small4": (bert, text),
        "vit-small4": (vit, images),
        "resnet-small": (resnet, images),
        "wav2vec2-small4": (wav2vec2, audio),
        "lstm-256": (lstm, lambda n: {"input_ids": torch.randint(0, 8000, (n, 128))}),
        "gpt2-wide2": (gpt2_wide, text),
    }


#: The devices each model is planned for: the compute-bound model at two sizes only (its
#: plans take seconds each to run).
_DEVICES = {"gpt2-wide2": ["tight", "roomy"]}


def _effective_step(plan: Any, micro: list[Any]) -> Callable[[Any, Any], None]:
    from vramctl.estimator._spec import StepSpec

    spec = StepSpec(precision=plan.precision)

    def run(model: Any, step: Any) -> None:
        for batch in micro:
            with step.autocast():
                out = model(**batch)
                loss = spec.loss(out, batch) / plan.accumulation
            step.backward(loss)
        step.step()

    return run


def _measure_peak(
    plan: Any, build: Callable[[], Any], make_batch: Callable[[int], Any], device: Any
) -> tuple[bool, int]:
    """Run ``plan`` for two effective batches on the simulated device: (it fits, the peak
    of its live tensors, parameters included)."""
    import torch

    run = _effective_step(plan, [make_batch(plan.micro_batch) for _ in range(plan.accumulation)])
    fits, peak = True, 0
    with device:
        torch.manual_seed(0)
        model = device.adopt(build())
        applied = plan.apply(model, device=device)
        try:
            with device.peak_meter() as meter:
                run(applied.model, applied.step)
                run(applied.model, applied.step)
            peak = meter.peak_used - device.reserve
        except torch.OutOfMemoryError:
            fits = False
        finally:
            applied.undo()
            del model, applied
            gc.collect()
    return fits, peak


def _time_plan(
    plan: Any, build: Callable[[], Any], make_batch: Callable[[int], Any], steps: int
) -> float:
    """Seconds per effective batch of ``plan`` on the CPU, outside the simulation (whose
    bookkeeping slows each operator), offloading as copies to host memory."""
    import torch

    run = _effective_step(plan, [make_batch(plan.micro_batch) for _ in range(plan.accumulation)])
    torch.manual_seed(0)
    model = build()
    applied = plan.apply(model, device="cpu")
    step = applied.step
    if "optimizer" in plan.offload and step.optimizer is not None:
        # the CPU has no host to offload to: the same copies and a step on host copies
        from vramctl.optimize import OffloadedOptimizer

        step.optimizer = OffloadedOptimizer(step.optimizer, "cpu")
    times = []
    try:
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            with contextlib.ExitStack() as stack:
                if "activations" in plan.offload:
                    stack.enter_context(
                        torch.autograd.graph.saved_tensors_hooks(
                            lambda t: t.detach().clone(), lambda t: t.clone()
                        )
                    )
                run(applied.model, step)
            times.append(time.perf_counter() - t0)
    finally:
        applied.undo()
    return statistics.median(times[1:])


#: One optimization at a time, against fp32 with no checkpointing or offloading.
_SINGLE = {
    "amp-bf16": {"precision": "amp-bf16"},
    "checkpointing selective": {"checkpointing": "selective"},
    "checkpointing full": {"checkpointing": "full"},
    "offload activations": {"offload": "activations"},
    "offload optimizer": {"offload": "optimizer"},
}


def _savings(
    build: Callable[[], Any], make_batch: Callable[[int], Any], micro: int
) -> dict[str, dict[str, Any]]:
    """The memory each optimization saves at micro-batch ``micro``: predicted (the
    estimate's peak against the baseline's) and measured (on a simulated device)."""
    import torch

    import vramctl
    from vramctl.estimator._target import run_target
    from vramctl.optimize import Plan, apply_checkpointing, find_blocks

    device = vramctl.simulate("64GiB")
    base = Plan("fp32", "none", "none", "adamw", micro, 1, fits=True)

    def both(p: Any) -> tuple[int, int]:
        with torch.device("meta"):
            meta = build()
        undo = apply_checkpointing(meta, p.checkpointing) if p.checkpointing != "none" else None
        try:
            est = vramctl.estimate(
                meta,
                make_batch(micro),
                device=run_target(device),
                precision=p.precision,
                offload_activations="activations" in p.offload,
                offload_optimizer="optimizer" in p.offload,
            )
        finally:
            if undo is not None:
                undo()
        return est.peak_device, _measure_peak(p, build, make_batch, device)[1]

    with torch.device("meta"):
        blocks = bool(find_blocks(build()))
    pred0, meas0 = both(base)
    out: dict[str, dict[str, Any]] = {}
    for name, change in _SINGLE.items():
        if "checkpointing" in change and not blocks:
            continue
        pred, meas = both(Plan(**{**base.__dict__, **change, "estimate": None}))
        saved_p, saved_m = pred0 - pred, meas0 - meas
        out[name] = {
            "predicted_saved_bytes": saved_p,
            "measured_saved_bytes": saved_m,
            "error_pct_of_peak": round(100 * (saved_p - saved_m) / meas0, 1),
        }
    return out


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
    ap = _common.parser(
        __doc__,
        quick="one model on its tight device, no checkpointing; under a minute",
        threads=False,
    )
    ap.add_argument("--effective-batch", type=int, default=None, help="samples per step (16)")
    ap.add_argument("--steps", type=int, default=2, help="timed effective batches per plan")
    ap.add_argument("--models", default=None, help="comma-separated model names (default: all six)")
    args = _common.parse(ap, argv)
    if args.effective_batch is None:
        args.effective_batch = 16
    import torch

    import vramctl
    from vramctl.optimize import plan

    torch.manual_seed(0)
    models = _models()
    if args.quick:
        chosen = {"gpt2-small4": ["tight"]}
        axes: dict[str, Any] = {
            "offload": ["none", "optimizer"],
            "optimizers": ["adamw"],
            "checkpointing": ["none"],
        }
    else:
        names = args.models.split(",") if args.models else list(models)
        unknown = sorted(set(names) - set(models))
        if unknown:
            ap.error(f"unknown model {unknown[0]!r}: one of {', '.join(models)}")
        chosen = {name: _DEVICES.get(name, ["tight", "medium", "roomy"]) for name in names}
        # every plan priced as fitting is run: each axis the planner has on a GPU
        axes = {
            "offload": ["none", "activations", "optimizer", "activations+optimizer"],
            "optimizers": ["adamw", "adamw-fused"],
        }
    rows: list[dict[str, Any]] = []
    gaps: list[float] = []
    errors: list[float] = []
    by_precision: dict[str, list[float]] = {}
    peaks: list[float] = []
    savings: dict[str, dict[str, Any]] = {}
    did_not_fit = 0
    from vramctl.estimator._rates import cpu_throughput

    for name, targets in chosen.items():
        build, make_batch = models[name]
        # This CPU measured again before each model's plans, which are run within minutes
        # of it: a shared machine's speed drifts by a quarter over the tens of minutes a
        # full run takes, and a profile measured once would price the last model for a
        # machine that is gone.
        profile = cpu_throughput(remeasure=True)
        factors = {
            "kernels": round(profile.step_factor, 3),
            "overheads": round(profile.overhead_factor, 3),
            "autocast": [round(f, 3) for f in profile.autocast_factors or ()],
            "error": round(profile.error, 3),
        }
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
                prune=False,  # every combination priced, then run: the fastest is known
                **axes,
            )
            planned = time.perf_counter() - t0
            measured: list[tuple[Any, bool, float | None]] = []
            for p in result.plans:
                if not p.fits:
                    continue
                fits, peak = _measure_peak(p, build, make_batch, device)
                seconds = _time_plan(p, build, make_batch, args.steps) if fits else None
                measured.append((p, fits, seconds))
                if seconds is not None and p.seconds is not None:
                    err = abs(p.seconds - seconds) / seconds
                    errors.append(err)
                    by_precision.setdefault(p.precision, []).append(err)
                if fits and peak:
                    peaks.append(abs(p.peak_bytes - peak) / peak)
                print(
                    f"  {p.label}: fits {fits}, peak {peak} (predicted {p.peak_bytes}), "
                    f"{seconds} s (predicted {p.seconds})",
                    file=sys.stderr,
                    flush=True,
                )
            best = result.best
            feasible = [(p, s) for p, f, s in measured if f and s]
            chosen_run = next(((f, s) for p, f, s in measured if p is best), (False, None))
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
                    "profile_factors": factors,
                }
            )
            print(rows[-1], file=sys.stderr, flush=True)
        if not args.quick or name == "gpt2-small4":
            # at the tight device's micro-batch (at least 2)
            micro = max(2, int(0.15 * args.effective_batch))
            savings[name] = _savings(build, make_batch, micro)
            print({"model": name, "savings": savings[name]}, file=sys.stderr, flush=True)
    saving_errors = [abs(v["error_pct_of_peak"]) for m in savings.values() for v in m.values()]
    summary = {
        "benchmark": "plan_quality",
        "quick": args.quick,
        "machine": _common.machine(False),
        "effective_batch": args.effective_batch,
        "worst_throughput_gap_pct": round(max(gaps), 1) if gaps else None,
        "plans_that_did_not_fit": did_not_fit,
        "step_time_mape_pct": round(100 * statistics.mean(errors), 1) if errors else None,
        "step_time_mape_pct_by_precision": {
            k: round(100 * statistics.mean(v), 1) for k, v in by_precision.items()
        },
        "plans_timed": len(errors),
        "peak_error_pct_median": round(100 * statistics.median(peaks), 1) if peaks else None,
        "saving_error_pct_of_peak_max": round(max(saving_errors), 1) if saving_errors else None,
        "savings": savings,
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


if __name__ == "__main__":
    raise SystemExit(main())
