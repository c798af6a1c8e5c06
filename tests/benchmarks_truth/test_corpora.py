"""The committed CUDA truth corpora, checked on every CI run (no GPU needed).

Every corpus under ``benchmarks/data/cuda_truth/`` must load, and each traced case's file
must match its checksum and replay through the allocator model (single-stream steps
exactly). The estimator is held to the figures it reached on each GPU's recorded truth, so
a change that makes it worse there fails here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _truth import corpus  # noqa: E402
from _truth.cases import estimate_case, recorded_per_call  # noqa: E402
from _truth.replay import replay  # noqa: E402

from _common import error_stats  # noqa: E402

DATA = BENCH / "data" / "cuda_truth"
CORPORA = sorted(p.parent for p in DATA.glob("*/index.json"))
H200 = DATA / "nvidia-h200-2026-11-25"
#: The first traced capture (68 cases), and the 198 cases of the same day's suite run whose
#: figures came back without their traces.
H200_TRACED = DATA / "nvidia-h200-2026-11-27"
H200_SUMMARY = DATA / "nvidia-h200-2026-11-27-summary"


def estimated_row(root: Path, case_id: str, **kw: Any) -> tuple[dict[str, Any], Any]:
    """A committed case and its estimate for the corpus' GPU with the corpus' own profile,
    estimated as its figures were taken (``recorded_per_call``) unless ``recorded`` says."""
    from vramctl.estimator import load_calibration

    index = corpus.load_index(root)
    case = next(c for c in index["cases"] if c["id"] == case_id)
    kw.setdefault("recorded", recorded_per_call(index))
    est = estimate_case(
        case["spec"],
        index["environment"]["gpu"],
        calibration=load_calibration(root / "calibration.json"),
        **kw,
    )
    return case, est


def test_there_is_a_corpus_and_a_readme() -> None:
    assert H200 in CORPORA
    assert (DATA / "README.md").is_file()


#: Single-stream steps the allocator model does not yet replay exactly, with what differs.
#: Both are cold mixed-precision training steps where the real allocator made one more
#: 2 MiB small-pool segment for a 1 MiB request in the optimizer's ``_foreach_sqrt``.
KNOWN_DIFFERENCES = {
    "nvidia-h200-2026-11-27": {
        "zoo/t5-small/train/amp-bf16/b1 cold",
        "zoo/whisper-base/train/amp-bf16/b4 cold",
    },
}


@pytest.mark.parametrize("root", CORPORA, ids=[p.name for p in CORPORA])
def test_every_committed_corpus_loads_and_replays(root: Path) -> None:
    index = corpus.load_index(root)
    assert index["cases"], f"{root.name} holds no cases"
    assert index["environment"].get("gpu"), f"{root.name} does not say which GPU"
    differs = []
    for case in index["cases"]:
        if not case.get("file") or case.get("status", "ok") != "ok":
            continue
        for step, trace in corpus.load_traces(root, case).items():
            r = replay(trace)
            if r.match is False:
                differs.append(f"{case['id']} {step}")
    # A new difference fails; so does one that went away (take it off the list).
    assert set(differs) == KNOWN_DIFFERENCES.get(root.name, set())


def test_the_h200_rows_give_the_figures_the_gpu_run_printed() -> None:
    """The 20 quick rows measured on an H200 (2026-11-25), estimated here with its profile.

    The GPU run printed median 4.145% and worst under-estimate 37.414% for the allocated
    peak; the measured side is kept to 3 significant digits, so the figures agree to a few
    hundredths of a percent. Since the training rows count two cuBLAS workspaces, a CUDA
    target's trace runs dropout and cross-entropy as CUDA does, and LSTMs as cuDNN does,
    the median was 3.601% and the worst under-estimate 10.2%: every inference row ran ~30
    MiB short. That run measured every row in one process, each model's training rows
    first, and never cleared a cuBLAS workspace: each inference step began with autograd's
    device thread's workspace allocated (``held_cublas_workspaces``; the same cases
    captured from a clean start two days later read 29-33 MiB less). Counted, the median
    is 0.46% and the worst under-estimate 1.9% (wav2vec2-base fp32 at batch 1, the first
    row after that model's failed training rows). The max, 5.8% over, is wav2vec2-base at
    batch 4 with this profile's workspace line for its convolutions (no recorded table).
    With cuBLASLt's 1 MiB apart from the handles' 32 MiB (made only by a bias product),
    the median is 0.15%, the max 5.5% and the worst under-estimate 2.3%.
    """
    from vramctl.estimator import load_calibration

    index = corpus.load_index(H200)
    cal = load_calibration(H200 / "calibration.json")
    pairs = []
    held = 0
    for case in index["cases"]:
        est = estimate_case(
            case["spec"],
            index["environment"]["gpu"],
            calibration=cal,
            recorded=recorded_per_call(index),
        )
        warm = case["steps"]["warm"]
        n = warm.get("held_cublas_workspaces", 0)
        held += n
        pairs.append((est.peak_allocated + n * cal.cublas_split()[0], warm["max_allocated"]))
    stats = error_stats(pairs)
    assert stats["rows"] == 20
    assert held == 12  # every inference row, none of the training rows
    assert stats["median_pct"] == pytest.approx(0.149, abs=0.1)
    assert stats["worst_under_pct"] <= 2.5
    assert stats["max_pct"] <= 6.0


def test_the_first_h200_rows_with_the_later_profile() -> None:
    """The 2026-11-25 rows estimated with the H200 profile of 2026-11-27
    (``estimate_accuracy.py --truth DIR --calibration PROFILE``), whose recorded table holds
    wav2vec2-base's convolutions: its fp32 inference at batch 4, 5.5% over with the first
    profile's one workspace line, is within 0.5%. Its batch-1 row stays 7% short: it ran
    right after that model's failed training rows, whose leftovers a clean capture of the
    same case does not read (67 MiB less two days later, one held cuBLAS workspace of it)."""
    import estimate_accuracy

    index = corpus.load_index(H200)
    later = str(H200_TRACED / "calibration.json")
    cal, named = estimate_accuracy.truth_calibration(later, index)
    assert later in named
    builtin, named_off = estimate_accuracy.truth_calibration("off", index)
    assert "built-in" in named_off and not builtin.measurements

    def row(case_id: str) -> float:
        case = next(c for c in index["cases"] if c["id"] == case_id)
        est = estimate_case(case["spec"], index["environment"]["gpu"], calibration=cal)
        warm = case["steps"]["warm"]
        held = warm["held_cublas_workspaces"] * cal.cublas_split()[0]
        return 100.0 * (est.peak_allocated + held - warm["max_allocated"]) / warm["max_allocated"]

    assert abs(row("zoo/wav2vec2-base/infer/fp32/b4")) < 0.5
    assert -8.0 < row("zoo/wav2vec2-base/infer/fp32/b1") < -6.0


def test_every_recorded_training_step_makes_two_cublas_workspaces() -> None:
    """The forward's thread and autograd's device thread each take a cuBLAS handle with its
    32 MiB workspace (compute capability 9.0): two in each cold training step, one in each
    cold inference step. The estimator's built-in ``TRAIN_HANDLES`` rests on this."""
    from vramctl.estimator._calibration import TRAIN_HANDLES

    index = corpus.load_index(H200_TRACED)
    seen = {"train": set(), "infer": set()}
    for case in index["cases"]:
        if not case.get("file"):
            continue
        cold = corpus.load_traces(H200_TRACED, case)["cold"]
        n = sum(
            1 for a, _, size, _, _ in corpus.events(cold) if a == "alloc" and size == 32 * 2**20
        )
        seen[case["spec"]["mode"]].add(n)
    assert seen == {"train": {TRAIN_HANDLES}, "infer": {1}}


@pytest.mark.parametrize("model", ["gpt2", "llama", "bert", "t5", "bart"])
def test_small_training_steps_on_the_h200_count_both_workspaces(model: str) -> None:
    """Shrunk transformers classes, trained on the H200 (2026-11-27): real peaks of 74-78
    MiB, of which 64 MiB are the two cuBLAS workspaces. Read with the profile's one handle
    the estimate was 39-42% short; with two it was 4-6% over: each handle was charged the
    profile's 33 MiB, cuBLAS's 32 and cuBLASLt's 1 measured together, as one request the
    allocator gives a 34 MiB block. With cuBLASLt's workspace made only by the forward's
    bias product, as the traces show, each is within 0.5%."""
    case, est = estimated_row(H200_SUMMARY, f"hf/{model}/train/fp32/b2")
    real = case["steps"]["warm"]["max_allocated"]
    assert abs(est.peak_allocated / real - 1) < 0.005


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_forced_math_attention_backend_is_priced_with_its_score_matrix(mode: str) -> None:
    """One attention block at 1,024 tokens in bf16 on the H200 with only SDPA's math backend
    enabled: real peaks of 1,221 MiB (training) and 739 MiB (inference), the whole score
    matrix in fp32. Traced with the host's fused kernel the estimate was 78.5% and 84.6%
    short; traced on the math path, as the caller forced, 20.7% and 8.5%. With the bool
    per score that ``_safe_softmax`` holds while it runs (64 MiB), inference is exact
    (reserved -7.3% -> +0.5%); with the product of the gradient and the softmax's output
    that CUDA's softmax backward makes before it reduces (one fp32 score matrix, 256 MiB),
    training is exact too (reserved +2.4%, device +0.3%)."""
    case, est = estimated_row(H200_SUMMARY, f"attention/sdpa/{mode}/amp-bf16/b4/sdpa_backend-math")
    warm = case["steps"]["warm"]
    assert abs(est.peak_allocated / warm["max_allocated"] - 1) < 0.005
    assert abs(est.peak_reserved / warm["max_reserved"] - 1) < 0.03


@pytest.mark.parametrize(
    "case_id",
    [
        "rnn/lstm/train/fp32/b16",
        "rnn/gru/train/fp32/b1",
        "rnn/lstm/infer/fp32/b16",
        "rnn/gru/infer/fp32/b1",
        "zoo/lstm/infer/fp32/b4",
        "zoo/lstm/infer/amp-bf16/b1",
    ],
)
def test_recurrent_layers_are_priced_as_cudnn_runs_them(case_id: str) -> None:
    """Two-layer LSTMs and GRUs on the H200 (2026-11-27): traced with the host's oneDNN
    kernels and two cuBLAS workspaces the estimate was 30% short (the LSTM language model's
    inference) to 62% over (a GRU trained at batch 1: its step makes no cuBLAS workspace).
    Run as cuDNN runs them (on the weights' one buffer, copied into one under autocast,
    its workspace and, in training, its reserve) and without the idle workspaces, every
    row is within 2%. The workspace and reserve sizes were fitted to these rows (the
    language model's inference rows were not in the fit of the workspace)."""
    case, est = estimated_row(H200_SUMMARY, case_id)
    real = case["steps"]["warm"]["max_allocated"]
    assert abs(est.peak_allocated / real - 1) < 0.02
    if case_id.startswith("rnn/"):  # no matrix product: no cuBLAS workspace was made
        steps = case["steps"]
        assert steps["warm"]["allocated_before"] == steps["cold"]["allocated_before"]


@pytest.mark.parametrize(
    ("case_id", "before", "within"),
    [
        ("rnn/gru/infer/fp32/b16", -12.5, 0.5),
        ("rnn/lstm/infer/fp32/b16", 2.2, 0.5),
        ("rnn/gru/infer/fp32/b1", 9.5, 5.0),
        ("zoo/lstm/infer/fp32/b1", -5.0, 0.5),
        ("zoo/lstm/train/fp32/b1", -1.5, 0.5),
        ("zoo/lstm/train/fp32/b4", 7.0, 0.5),
    ],
)
def test_an_fp32_recurrent_layer_runs_on_its_own_buffer_with_the_weights_in_its_workspace(
    case_id: str, before: float, within: float
) -> None:
    """A layer on a GPU holds its weights in one buffer, which ``_cudnn_rnn`` runs on as it
    is; a float32 call's workspace holds the weights' bytes (estimator/_cuda_rnn.py). The
    reserved peaks show one allocation where a copy and a workspace would be two: the GRU
    at batch 1 reserved its 14 MiB of state and one 28 MiB segment. Priced with a copy
    and a workspace, these rows' reserved peaks were ``before`` % off; as one, within
    ``within`` %, with the allocated peaks within 2% as before. Not met: the GRU trained at
    batch 1 (23.6% short, was 14.6%) and the LSTM at batch 16 (9.5% short, was 14.7%)."""
    case, est = estimated_row(H200_SUMMARY, case_id)
    warm = case["steps"]["warm"]
    assert abs(est.peak_allocated / warm["max_allocated"] - 1) < 0.02
    assert abs(100 * (est.peak_reserved / warm["max_reserved"] - 1)) <= within < abs(before)


def test_a_recorded_step_sums_gradients_out_of_place() -> None:
    """whisper-base trained in bf16 autocast at batch 1 on the H200: its tied embedding's two
    fp32 gradients (106 MB each) were summed out of place in the recorded step, since the
    recorder's dispatch mode makes ATen take every tensor for a subclass. Estimated as a
    plain step (the sum in place) it read 6.41% short; estimated as recorded it is within
    0.5%. The two estimates differ by that one gradient."""
    assert recorded_per_call(corpus.load_index(H200_TRACED))
    whisper = "zoo/whisper-base/train/amp-bf16/b1"
    case, recorded = estimated_row(H200_TRACED, whisper, recorded=True)
    _, plain = estimated_row(H200_TRACED, whisper, recorded=False)
    real = case["steps"]["warm"]["max_allocated"]
    assert abs(recorded.peak_allocated / real - 1) < 0.005
    assert plain.peak_allocated / real - 1 < -0.06
    # (the allocator's rounding and what else is live at the new peak: within 2 MiB)
    assert abs(recorded.peak_allocated - plain.peak_allocated - 51865 * 512 * 4) < 2 * 2**20


def test_the_traced_corpus_evidence_sets_the_h200_range() -> None:
    """The traced corpus' profile carries the device peak's evidence (written by
    ``estimate_accuracy.py --truth DIR --write-evidence``): over its 60 warm steps NVML read
    at most 2.5% above the estimate (40 MiB), so an estimate with that profile allows 2.5%
    of its device peak where the fixed allowance said 128 MiB; the step that fell furthest
    short is inside its range. (3.0% on 2026-11-29; 6.3% while the profile's recorded cuDNN
    workspaces had replaced the line's over-charge and CUDA's reduction buffers were not
    yet modelled; 2.4% before cuBLASLt's workspace was made apart from cuBLAS's, which took
    the 1 MiB a 33 MiB block had added to each handle.)"""
    from vramctl.estimator import load_calibration

    cal = load_calibration(H200_TRACED / "calibration.json")
    assert cal.evidence is not None and cal.evidence.steps == 60
    assert cal.evidence.shortfall_pct == pytest.approx(2.545, abs=0.01)
    assert cal.evidence.shortfall == 40 * 2**20
    case, est = estimated_row(H200_TRACED, "zoo/convnext-tiny/train/amp-bf16/b4")
    assert est.device_uncertainty == cal.evidence.allowance(est.peak_device) < 128 * 2**20
    assert est.peak_device < case["steps"]["warm"]["nvml_bytes"] <= est.peak_device_high


def test_the_traced_corpus_profile_holds_each_recorded_convolutions_workspace() -> None:
    """``cuda_truth.py workspaces DIR --write`` paired each of the H200 corpus' recorded
    convolution calls with the estimator's key for it. ResNet-50's first convolution at
    batch 4 in fp32 held a 15.3 MB workspace where the profile's line (27.7 MiB + 2.33x its
    12.8 MB output) charged 57 MiB; with the table its inference step, 23% over before, is
    within 1% (the table comes from the same recorded steps: other shapes keep the line)."""
    from _truth import workspaces
    from _truth.diff import predicted_trace

    from vramctl.estimator import load_calibration

    cal = load_calibration(H200_TRACED / "calibration.json")
    index = corpus.load_index(H200_TRACED)
    case = next(c for c in index["cases"] if c["id"] == "zoo/resnet-50/infer/fp32/b4")
    keys = predicted_trace(case["spec"], index["environment"]["gpu"]).workspace_keys
    calls = workspaces.recorded(corpus.load_traces(H200_TRACED, case)["warm"])
    got = workspaces.pair(keys, calls)
    assert isinstance(got, dict) and len(keys) == 53
    assert got[keys[0]] == 15291152
    assert all(cal.cudnn_workspaces[k] >= n for k, n in got.items())
    case, est = estimated_row(H200_TRACED, case["id"])
    assert abs(est.peak_allocated / case["steps"]["warm"]["max_allocated"] - 1) < 0.01


def test_the_h200_profiles_carry_a_line_per_kind_fitted_to_the_recorded_table() -> None:
    """``cuda_truth.py workspaces --write`` fits each kind's line to the table it wrote (the
    recorded calls and the calls the calibration measured that no step ran) and writes both
    into the summary's profile too: every call lies on or below each line that may price
    it (its kind's in its dtype, its kind's, and a weight-only backward's whole backward's)."""
    from vramctl.estimator import load_calibration
    from vramctl.estimator._conv_workspace import conv_call, workspace_lines

    traced = load_calibration(H200_TRACED / "calibration.json")
    summary = load_calibration(H200_SUMMARY / "calibration.json")
    lines = workspace_lines(traced.cudnn_workspaces)
    assert set(lines) >= {
        "forward:dense",
        "forward:dense:float32",
        "forward:dense:bfloat16",
        "forward:pointwise",
        "backward:dense",
        "backward-weight:dense",
    }
    assert traced.cudnn_workspace_lines == summary.cudnn_workspace_lines == lines
    for key, nbytes in traced.cudnn_workspaces.items():
        call = conv_call(key)
        assert call is not None
        if not call.cudnn:
            # the calibration's depthwise convolution, on PyTorch's own kernels: none
            assert nbytes == 0 and "[96, 1, 7, 7]" in key
            continue
        for kind in call.line_kinds:
            if kind in lines:  # too few calls of a kind give it no line
                fixed, per_act, per_weight = lines[kind]
                assert fixed + per_act * call.activation + per_weight * call.weight >= nbytes


@pytest.mark.parametrize(
    ("case_id", "before_pct"),
    [
        ("hf/mamba/infer/fp32/b2", 65.7),  # a depthwise 1-d convolution, off cuDNN
        ("hf/vit/infer/fp32/b2", 75.0),
        ("hf/resnet/infer/fp32/b2", 36.7),
        ("hf/whisper/infer/fp32/b2", 53.5),
    ],
)
def test_convolutions_the_table_lacks_take_their_kinds_line(
    case_id: str, before_pct: float
) -> None:
    """Out of sample: the summary's shrunk models run convolutions of shapes the traced
    corpus never recorded. With one line over every kind they were 37-75% over on the
    allocated peak; with their kinds' lines (and no workspace for a depthwise convolution
    PyTorch runs off cuDNN) they are within 12% over and never under by more than 1%."""
    case, est = estimated_row(H200_SUMMARY, case_id)
    err = 100 * (est.peak_allocated / case["steps"]["warm"]["max_allocated"] - 1)
    assert -1.0 <= err <= 12.0 < before_pct


@pytest.mark.parametrize(
    ("case_id", "line_pct"),
    [("hf/resnet/infer/fp32/b2", 4.47), ("hf/convnext/train/fp32/b2", 5.06)],
)
def test_a_convolution_recorded_at_batch_1_and_4_takes_no_more_at_2_than_both(
    case_id: str, line_pct: float
) -> None:
    """The shrunk ResNet's and ConvNeXt's stems and downsamplings are the full models'
    (recorded at batch 1 and 4); at batch 2 the kinds' lines overcharged them. Bounded by
    the recordings on both sides, the allocated peak is within 0.5%."""
    case, est = estimated_row(H200_SUMMARY, case_id)
    err = 100 * (est.peak_allocated / case["steps"]["warm"]["max_allocated"] - 1)
    assert abs(err) <= 0.5 < line_pct


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None, reason="needs torchvision (and timm)"
)
def test_a_resnet_stem_takes_the_workspace_the_calibration_measured() -> None:
    """The calibration's probe measured ResNet's 7x7/2 stem at batch 8 in fp32 (30 MiB of
    workspace; with a bias, which a forward's workspace does not depend on). torchvision's
    ResNet-18 inference at batch 8, 37-59% over with one line and 7.7% over with its kind's
    line, is exact with that call's own workspace."""
    case, est = estimated_row(H200_SUMMARY, "torchvision/resnet18/infer/fp32/b8")
    warm = case["steps"]["warm"]
    assert abs(est.peak_allocated / warm["max_allocated"] - 1) < 0.005
    assert abs(est.peak_reserved / warm["max_reserved"] - 1) < 0.005


def _profile_copy(src: Path, dst: Path, **environment: Any) -> Path:
    """A corpus folder with ``src``'s index (its environment changed as given) and its
    profile without a recorded table."""
    import json

    dst.mkdir()
    index = corpus.load_index(src)
    index["environment"].update(environment)
    corpus.save_index(dst, index)
    doc = json.loads((src / "calibration.json").read_text())
    doc.get("constants", {}).pop("cudnn_workspaces", None)
    doc.get("constants", {}).pop("cudnn_workspace_lines", None)
    (dst / "calibration.json").write_text(json.dumps(doc))
    return dst


def test_recorded_workspaces_go_into_a_profile_of_the_same_gpu_and_software(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cuda_truth.py workspaces DIR --into DIR2``: the table read off DIR's traces goes
    into DIR2's profile where DIR2 was recorded on the same GPU with the same software (a
    capture whose traces did not come back), and is refused where cuDNN differs."""
    import json

    import cuda_truth

    from vramctl.estimator._conv_workspace import probe_table, workspace_lines

    same = _profile_copy(H200_SUMMARY, tmp_path / "same")
    other = _profile_copy(H200_SUMMARY, tmp_path / "other", cudnn=90100)
    only = "zoo/resnet-50/infer/fp32/b1"
    capsys.readouterr()
    assert (
        cuda_truth.main(["workspaces", str(H200_TRACED), "--only", only, "--into", str(same)]) == 0
    )
    written = json.loads((same / "calibration.json").read_text())["constants"]
    table = written["cudnn_workspaces"]
    recorded_doc = json.loads((H200_TRACED / "calibration.json").read_text())
    recorded = recorded_doc["constants"]
    # ResNet-50's recorded calls, as the whole corpus' table has them, and the calls the
    # calibration measured (where the whole corpus recorded one, its recording is kept)
    probed = probe_table(recorded_doc["measurements"]["cudnn"])
    assert set(probed) <= set(table)
    assert any(k not in probed for k in table)
    assert all(recorded["cudnn_workspaces"][k] == n for k, n in table.items() if k not in probed)
    assert written["cudnn_workspace_lines"] == {
        k: list(v) for k, v in workspace_lines(table).items()
    }
    rc = cuda_truth.main(["workspaces", str(H200_TRACED), "--only", only, "--into", str(other)])
    err = capsys.readouterr().err
    assert rc == 2 and "cudnn" in err
    assert (
        "cudnn_workspaces" not in json.loads((other / "calibration.json").read_text())["constants"]
    )


@pytest.mark.parametrize(
    "case_id",
    ["zoo/gpt2/infer/fp32/b1", "zoo/t5-small/train/fp32/b1", "zoo/resnet-50/train/fp32/b1"],
)
def test_cublaslt_makes_its_workspace_only_at_a_bias_product(case_id: str) -> None:
    """The recorded H200 cold steps keep 32 MiB per thread that ran a product, and 1 MiB
    more (cuBLASLt's workspace) where the forward ran a product with a bias (``addmm``):
    GPT-2 and ResNet-50 do, T5 (no biases) does not, and no backward does. The estimator's
    trace of each step makes the same workspaces."""
    from _truth.diff import predicted_trace

    from vramctl.estimator import load_calibration
    from vramctl.estimator._cuda_kernels import CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE

    index = corpus.load_index(H200_TRACED)
    case = next(c for c in index["cases"] if c["id"] == case_id)
    live: dict[int, tuple[int, str | None]] = {}
    for action, addr, size, _stream, op in corpus.events(
        corpus.load_traces(H200_TRACED, case)["cold"]
    ):
        if action == "alloc":
            live[addr] = (size, op)
        elif action == "free_requested":
            live.pop(addr, None)
    real = sorted(size for size, _op in live.values() if size in (2**20, 32 * 2**20))
    trace = predicted_trace(
        case["spec"],
        index["environment"]["gpu"],
        load_calibration(H200_TRACED / "calibration.json"),
    )
    made = sorted(
        trace.records[e].nbytes
        for e in trace.events
        if e >= 0 and trace.records[e].op in (CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE)
    )
    assert made == real
    assert (2**20 in real) == (not case_id.startswith("zoo/t5"))


def test_each_case_begins_with_the_context_earlier_cases_left() -> None:
    """A capture runs every case in one process and CUDA unloads nothing: a case begins
    with what its cold step recorded (``context_before``), else with the most any earlier
    case's steps held outside the allocator."""
    from estimate_accuracy import contexts_before

    def case(cid: str, *contexts: int | None, before: int | None = None) -> dict[str, Any]:
        cold: dict[str, Any] = {"context_bytes": contexts[0]}
        if before is not None:
            cold["context_before"] = before
        return {"id": cid, "steps": {"cold": cold, "warm": {"context_bytes": contexts[-1]}}}

    index = {
        "cases": [
            case("a", 700, 702),
            {"id": "failed", "status": "error"},
            case("b", 750, 760),
            case("c", 760, 760, before=790),  # recorded: taken as it is
            case("d", None),
        ]
    }
    assert contexts_before(index) == {"failed": 702, "b": 702, "c": 790, "d": 760}
    assert contexts_before({"cases": [case("a", 0, 0), case("b", 0, 0)]}) == {}


def test_cases_after_the_side_stream_case_hold_its_pool_and_read_within_2_percent() -> None:
    """The H200 summary's process held 70 MiB more outside the allocator from its first
    case with a side stream on (the stream pool), and about 30 MiB of kernels earlier
    cases loaded: each small Hugging Face row read about 11% above its estimate. Counted
    as the process held it, the device peak is the estimate's reserved peak and context."""
    from estimate_accuracy import contexts_before

    from vramctl.estimator import load_calibration
    from vramctl.estimator._calibration import STREAM_POOL_BYTES

    index = corpus.load_index(H200_SUMMARY)
    before = contexts_before(index)
    side, est = estimated_row(H200_SUMMARY, "zoo/gpt2/train/fp32/b4/prefetch_stream")
    # the side-stream case itself is estimated with the pool (the profile did not measure
    # it: the built-in figure, which is this capture's)
    cal = load_calibration(H200_SUMMARY / "calibration.json")
    assert est.breakdown["context"] == cal.context_bytes + STREAM_POOL_BYTES
    assert any("side streams" in n for n in est.notes)
    after = [c for c in index["cases"] if c["id"].startswith("hf/") and c.get("steps")]
    assert all(before[c["id"]] - before[side["id"]] >= 70 * 2**20 for c in after)
    for cid in ("hf/bert/infer/fp32/b2", "hf/llama/train/fp32/b2"):
        case, est = estimated_row(H200_SUMMARY, cid)
        measured = case["steps"]["warm"]["nvml_bytes"]
        fresh = est.peak_device
        held = max(0, before[cid] - est.breakdown["context"])
        assert (measured - fresh) / measured > 0.09  # a fresh process' estimate: ~10% short
        assert abs(fresh + held - measured) / measured < 0.02


def test_a_cold_step_reserves_as_the_first_step_begun_from_its_recorded_segments() -> None:
    """wav2vec2-base inference at batch 4 in fp32 on the H200: the cold step reserved 626
    MiB. It began from 438 MiB of segments, among them a 40 MiB one holding parameters
    around a free 32 MiB stretch where a cuBLAS workspace had been; a fresh process makes
    the same state in 400 MiB. The estimate's first step, from a fresh process's segments,
    reserves 588 MiB (6.1% short); begun from the recorded segments, exactly 626."""
    from _truth.cases import case_allocator
    from _truth.diff import predicted_trace
    from _truth.replay import first_step_from

    from vramctl.estimator import load_calibration

    case, est = estimated_row(H200_TRACED, "zoo/wav2vec2-base/infer/fp32/b4")
    cold = corpus.load_traces(H200_TRACED, case)["cold"]
    real = case["steps"]["cold"]["max_reserved"]
    assert real == 626 * 2**20
    assert est.state_reserved == 400 * 2**20
    assert sum(s[1] for s in cold["segments_before"]) == 438 * 2**20
    assert est.first_step_peak_reserved == 588 * 2**20
    cal = load_calibration(H200_TRACED / "calibration.json")
    trace = predicted_trace(case["spec"], "NVIDIA H200", calibration=cal)
    assert first_step_from(trace, cold["segments_before"], case_allocator(case["spec"])) == real
