"""vramctl.optimize: each optimization applied where it can, skipped with its reason where it
cannot, and the model still runs."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

import vramctl
from tests.optimize.models import DetHead, FakeCuda, convnet, encoder, mlp
from vramctl.optimize import (
    OptimizationReport,
    Optimized,
    OptimizeError,
    StepHelper,
    optimize,
)

#: The implementation module (``vramctl.optimize`` as an attribute is the function).
_apply = importlib.import_module("vramctl.optimize._apply")


def _train(model: nn.Module, step: StepHelper, batch: torch.Tensor, steps: int = 3) -> None:
    for _ in range(steps):
        with step.autocast():
            loss = model(batch).float().square().mean()
        step.backward(loss)
        step.step()


# -- the function and what it returns -----------------------------------------------


def test_the_top_level_name_is_the_package_called_as_the_function() -> None:
    assert vramctl.optimize.optimize is optimize and callable(vramctl.optimize)
    assert vramctl.OptimizationReport is OptimizationReport


def test_it_returns_the_same_model_a_step_and_a_report() -> None:
    model = mlp()
    result = optimize(model, device="cpu")
    assert isinstance(result, Optimized)
    m, step, report = result
    assert m is model
    assert isinstance(step, StepHelper)
    assert isinstance(report, OptimizationReport)
    assert report.names == list(_apply.ORDER)
    with pytest.raises(AttributeError):
        result.model = mlp()  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "eval"}, "mode must be one of"),
        ({"level": "max"}, "level must be one of"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"checkpointing": "half"}, "checkpointing must be one of"),
        ({"compile": "yes"}, "compile must be True, False or 'auto'"),
        ({"optimizer": "adamw"}, "optimizer must be a torch.optim.Optimizer"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(OptimizeError, match=message):
        optimize(mlp(), device="cpu", **kwargs)  # type: ignore[arg-type]


def test_a_malformed_override_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMCTL_AMP", "sometimes")
    with pytest.raises(OptimizeError, match="VRAMCTL_AMP must be 0 or 1"):
        optimize(mlp(), device="cpu")


# -- precision ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "precision", "scaler", "why"),
    [
        ("A10G-24GB", "bf16", False, "compute capability 8.6) has bf16 tensor cores"),
        ("T4-16GB", "fp16", True, "compute capability 7.5) has fp16 tensor cores"),
        ("V100-16GB", "fp16", True, "compute capability 7.0) has fp16 tensor cores"),
        ("cpu", "fp32", False, "the CPU's default"),
        ("16GiB", "fp32", False, "compute capability is unknown"),
    ],
)
def test_precision_follows_the_compute_capability(
    device: str, precision: str, scaler: bool, why: str
) -> None:
    _, step, report = optimize(mlp(), device=device)
    assert step.precision == precision
    assert (step.scaler is not None) is scaler
    assert step.device_type == "cpu"  # a simulated GPU runs its kernels on the CPU
    entry = report["precision"]
    assert entry.applied is (precision != "fp32")
    assert why in entry.reason


def test_fp16_for_inference_has_no_scaler() -> None:
    _, step, report = optimize(mlp(), device="T4-16GB", mode="infer")
    assert step.precision == "fp16"
    assert step.scaler is None
    assert "GradScaler" not in report["precision"].reason


def test_bf16_asked_on_the_cpu_is_cpu_autocast() -> None:
    model = mlp()
    _, step, report = optimize(model, device="cpu", precision="bf16")
    assert report["precision"].applied
    assert report["precision"].reason == "bf16 autocast, as asked"
    with step.autocast():
        out = model(torch.randn(2, 16))
    assert out.dtype == torch.bfloat16


def test_bf16_asked_on_a_gpu_without_it_says_so() -> None:
    _, step, report = optimize(mlp(), device="T4-16GB", precision="bf16")
    assert step.precision == "bf16"
    assert "no native bf16" in report["precision"].reason


@pytest.mark.parametrize(
    ("env", "device", "precision", "why"),
    [
        ({"VRAMCTL_AMP": "0"}, "A10G-24GB", "fp32", "VRAMCTL_AMP=0"),
        ({"VRAMCTL_AMP": "1"}, "cpu", "bf16", "VRAMCTL_AMP=1"),
        ({"VRAMCTL_AMP": "1"}, "T4-16GB", "fp16", "VRAMCTL_AMP=1"),
        ({"VRAMCTL_AMP_DTYPE": "fp16"}, "A10G-24GB", "fp16", "VRAMCTL_AMP_DTYPE=fp16"),
        ({"VRAMCTL_AMP": "1", "VRAMCTL_AMP_DTYPE": "bf16"}, "cpu", "bf16", "VRAMCTL_AMP_DTYPE"),
        ({"VRAMCTL_AMP": "0", "VRAMCTL_AMP_DTYPE": "bf16"}, "cpu", "fp32", "VRAMCTL_AMP=0"),
    ],
)
def test_env_overrides_precision(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], device: str, precision: str, why: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _, step, report = optimize(mlp(), device=device)
    assert step.precision == precision
    assert why in report["precision"].reason


def test_env_beats_an_explicit_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMCTL_AMP", "0")
    _, step, report = optimize(mlp(), device="cpu", precision="bf16")
    assert step.precision == "fp32"
    assert not report["precision"].applied
    assert report["precision"].reason == "fp32: VRAMCTL_AMP=0"


def test_an_op_without_a_bf16_kernel_falls_back_to_fp32() -> None:
    model = DetHead()
    x = torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError):
        model(x)  # the premise: linalg.det has no bf16 CPU kernel
    _, step, report = optimize(model, device="cpu", precision="bf16", example_batch=x)
    assert step.precision == "fp32"
    entry = report["precision"]
    assert not entry.applied
    assert "failed under bf16 autocast" in entry.reason
    assert "BFloat16" in entry.reason
    with step.autocast():
        assert model(x).shape == (8,)  # the model still runs


def test_the_precision_check_leaves_buffers_and_random_state_alone() -> None:
    model = convnet()
    x = torch.randn(4, 3, 8, 8) + 5
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    optimize(model, device="cpu", precision="bf16", example_batch=x)
    for a, b in zip(model.buffers(), stats, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), rng)


# -- a real training step -----------------------------------------------------------


def test_a_cpu_training_step_through_the_helper_changes_the_weights() -> None:
    torch.manual_seed(0)
    model = encoder(layers=2, width=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    model, step, report = optimize(model, device="cpu", optimizer=opt, precision="bf16")
    assert report["precision"].applied and report["optimizer"].applied
    _train(model, step, torch.randn(4, 8, 32))
    changed = [not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)]
    assert all(changed)
    assert step.optimizer is not opt
    assert all(step.optimizer.state[p]["step"].item() == 3 for p in model.parameters())


def test_the_fp16_step_scales_the_loss() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    twin = copy.deepcopy(model)
    model, step, _ = optimize(model, device="T4-16GB", optimizer=opt)
    assert step.precision == "fp16"
    assert isinstance(step.scaler, torch.amp.GradScaler)
    scale = step.scaler.get_scale()
    assert scale == 65536.0
    x = torch.randn(8, 16)
    with step.autocast():
        out = model(x)
        loss = out.float().square().mean()
    assert out.dtype == torch.float16
    step.backward(loss)
    scaled = [p.grad.clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        twin(x).float().square().mean().backward()
    for g, t in zip(scaled, twin.parameters(), strict=True):
        torch.testing.assert_close(g / scale, t.grad, rtol=1e-2, atol=1e-4)
    step.step(max_grad_norm=1e6)
    assert all(p.grad is None for p in model.parameters())
    # Unscaled before the step: the weights moved by lr x gradient, not lr x scaled gradient.
    for b, p, t in zip(before, model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), b - 0.1 * t.grad, rtol=1e-2, atol=1e-3)


def test_a_step_without_an_optimizer_says_what_to_pass() -> None:
    _, step, report = optimize(mlp(), device="cpu")
    assert report["optimizer"].reason == "no optimizer given (optimizer=...)"
    with pytest.raises(OptimizeError, match="pass optimizer="):
        step.step()


# -- the optimizer ------------------------------------------------------------------


def test_the_rebuilt_optimizer_keeps_groups_settings_and_state() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-2},
            {"params": model[2].parameters(), "lr": 1e-3, "weight_decay": 0.5},
        ],
        betas=(0.8, 0.95),
        eps=1e-6,
    )
    x = torch.randn(8, 16)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    twin, twin_opt = copy.deepcopy((model, opt))

    _, step, report = optimize(model, device="cpu", optimizer=opt)
    new = step.optimizer
    assert report["optimizer"].applied
    assert "fused=True" in report["optimizer"].reason
    assert type(new) is torch.optim.AdamW and new is not opt
    for g_new, g_old in zip(new.param_groups, opt.param_groups, strict=True):
        assert g_new["fused"] is True
        assert g_new["params"] == g_old["params"]
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
            assert g_new[key] == g_old[key], key
    for p in model.parameters():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(new.state[p][key], opt.state[p][key], rtol=0, atol=0)

    # The next step is the one the old optimizer would have taken.
    model(x).square().mean().backward()
    new.step()
    twin(x).square().mean().backward()
    twin_opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda ps: torch.optim.LBFGS(ps), "LBFGS has no fused or foreach option"),
        (lambda ps: torch.optim.RMSprop(ps), "foreach kernels run on cuda"),
        (lambda ps: torch.optim.Adam(ps, fused=True), "Adam is already fused"),
    ],
)
def test_an_optimizer_that_cannot_be_faster_is_kept(make: object, reason: str) -> None:
    model = mlp()
    opt = make(model.parameters())  # type: ignore[operator]
    _, step, report = optimize(model, device="cpu", optimizer=opt)
    assert step.optimizer is opt
    assert not report["optimizer"].applied
    assert reason in report["optimizer"].reason


def test_inference_keeps_the_optimizer() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    _, step, report = optimize(model, device="cpu", optimizer=opt, mode="infer")
    assert step.optimizer is opt
    assert report["optimizer"].reason == "inference takes no optimizer step"


# -- TF32, cuDNN, channels-last, threads ----------------------------------------------


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        ("cpu", "not a CUDA device"),
        ("A10G-24GB", "not a CUDA device (a simulated GPU runs its kernels on the CPU)"),
    ],
)
def test_tf32_and_cudnn_skip_off_cuda(device: str, reason: str) -> None:
    _, _, report = optimize(convnet(), device=device)
    assert report["tf32"].reason == reason
    assert report["cudnn_benchmark"].reason == reason
    assert not report["tf32"].applied and not report["cudnn_benchmark"].applied


def test_tf32_and_cudnn_benchmark_on_an_ampere_gpu() -> None:
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    _, step, report = optimize(convnet(), device=FakeCuda("8.0"))
    assert report["tf32"].applied and report["cudnn_benchmark"].applied
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.cudnn.benchmark
    assert (step.precision, step.device_type) == ("bf16", "cuda")


def test_tf32_skips_before_ampere_and_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _, _, report = optimize(mlp(), device=FakeCuda("7.0"), precision="fp32")
    assert "has no TF32 tensor cores (8.0 and later)" in report["tf32"].reason
    assert not torch.backends.cuda.matmul.allow_tf32
    monkeypatch.setenv("VRAMCTL_TF32", "0")
    _, _, report = optimize(mlp(), device=FakeCuda("9.0"))
    assert report["tf32"].reason == "VRAMCTL_TF32=0"
    assert not torch.backends.cuda.matmul.allow_tf32


def test_cudnn_benchmark_skips_without_convolutions_or_static_shapes() -> None:
    torch.backends.cudnn.benchmark = False
    _, _, report = optimize(mlp(), device=FakeCuda())
    assert (
        report["cudnn_benchmark"].reason == "no convolution or recurrent layers for cuDNN to tune"
    )
    _, _, report = optimize(convnet(), device=FakeCuda(), static_shapes=False)
    assert report["cudnn_benchmark"].reason.startswith("static_shapes=False")
    assert not torch.backends.cudnn.benchmark


def test_channels_last_for_convolutions_only() -> None:
    _, _, report = optimize(mlp(), device="cpu")
    assert report["channels_last"].reason == "no Conv2d layers: the memory format changes nothing"
    model = convnet()
    _, step, report = optimize(model, device="cpu")
    assert report["channels_last"].applied
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    with step.autocast():
        assert model(torch.randn(2, 3, 8, 8)).shape == (2, 2)


def test_channels_last_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    model = convnet()
    _, _, report = optimize(model, device="cpu", channels_last=False)
    assert report["channels_last"].reason == "channels_last=False"
    assert model[0].weight.is_contiguous()
    monkeypatch.setenv("VRAMCTL_CHANNELS_LAST", "0")
    _, _, report = optimize(model, device="cpu", channels_last=True)
    assert report["channels_last"].reason == "VRAMCTL_CHANNELS_LAST=0"
    monkeypatch.setenv("VRAMCTL_CHANNELS_LAST", "1")
    _, _, report = optimize(model, device="cpu", channels_last=False)
    assert report["channels_last"].applied  # the variable beats the argument


def test_cpu_threads_capped_at_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(2)
    monkeypatch.setattr(_apply, "usable_cores", lambda: 1)
    _, _, report = optimize(mlp(), device="cpu")
    assert report["cpu_threads"].applied
    assert (
        "2 intra-op threads for 1 usable core (CPU affinity, cgroup quota): set to 1"
        in report["cpu_threads"].reason
    )
    assert torch.get_num_threads() == 1
    _, _, report = optimize(mlp(), device="cpu")
    assert report["cpu_threads"].reason == "1 intra-op thread for 1 usable core: nothing to change"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _, _, report = optimize(mlp(), device="cpu")
    assert report["cpu_threads"].reason == "OMP_NUM_THREADS=1 sets the threads"
    _, _, report = optimize(mlp(), device=FakeCuda())
    assert report["cpu_threads"].reason == "the step runs on the GPU"


def test_usable_cores_read_the_cgroup_quota_of_any_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The quota is read by the device layer: v1's cfs files and a nested cgroup count (only
    # the root's v2 cpu.max did before).
    from vramctl.device import _host

    (tmp_path / "cpu" / "docker" / "abc").mkdir(parents=True)
    (tmp_path / "cpu" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "self_cgroup").write_text("3:cpu,cpuacct:/docker/abc\n0::/\n")
    monkeypatch.setattr(_host, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(_host, "SELF_CGROUP", tmp_path / "self_cgroup")
    assert _apply.usable_cores() == 1  # half a CPU: one core, never none
    (tmp_path / "cpu" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("-1\n")
    assert _apply.usable_cores() == _host.affinity_cpus()


# -- quantization -------------------------------------------------------------------


def _linear_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).eval()


def test_int8_quantization_for_cpu_inference() -> None:
    torch.manual_seed(0)
    model = _linear_model()
    x = torch.randn(16, 64)
    expected = model(x).detach()
    _, _, report = optimize(model, device="cpu", mode="infer", level="aggressive")
    entry = report["quantization"]
    assert entry.applied
    assert entry.memory_delta_bytes == -3 * (64 * 256 + 256 * 64)
    assert "quantize_dynamic" in type(model[0]).__module__ or "dynamic" in type(model[0]).__module__
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"mode": "train", "level": "aggressive"}, "int8 dynamic quantization is for inference"),
        ({"mode": "infer", "device": "A10G-24GB", "level": "aggressive"}, "runs on the CPU only"),
        ({"mode": "infer"}, "level='basic' keeps the weights exact"),
        ({"mode": "infer", "level": "aggressive", "quantize": False}, "quantize=False"),
        ({"mode": "infer", "precision": "bf16", "quantize": True}, "bf16 autocast is on"),
    ],
)
def test_quantization_skipped_where_it_cannot_apply(kwargs: dict[str, object], reason: str) -> None:
    model = _linear_model()
    kwargs.setdefault("device", "cpu")
    _, _, report = optimize(model, **kwargs)  # type: ignore[arg-type]
    assert reason in report["quantization"].reason
    assert not report["quantization"].applied
    assert type(model[0]) is nn.Linear


def test_quantization_skipped_where_linear_layers_are_a_small_share() -> None:
    model = convnet()
    model[0] = nn.Conv2d(3, 8, 9, padding=4)  # convolution weights dominate
    _, _, report = optimize(model, device="cpu", mode="infer", level="aggressive")
    assert "nn.Linear holds" in report["quantization"].reason
    _, _, report = optimize(nn.Conv2d(3, 3, 3), device="cpu", mode="infer", quantize=True)
    assert report["quantization"].reason == "no nn.Linear layers to quantize"


# -- checkpointing ------------------------------------------------------------------


def test_checkpointing_skipped_without_repeated_blocks() -> None:
    _, _, report = optimize(mlp(), device="cpu", checkpointing="full")
    entry = report["checkpointing"]
    assert not entry.applied
    assert entry.reason.startswith("Sequential has no repeated blocks to checkpoint")


def test_checkpointing_off_at_basic_and_in_inference() -> None:
    _, _, report = optimize(encoder(), device="cpu")
    assert report["checkpointing"].reason.startswith("level='basic' leaves it off")
    _, _, report = optimize(encoder(), device="cpu", mode="infer", checkpointing="full")
    assert report["checkpointing"].reason == "inference keeps no activations for a backward pass"


def test_checkpointing_asked_is_applied_with_its_predicted_saving() -> None:
    model = encoder(layers=3, width=64)
    x = torch.randn(8, 64, 64)
    _, _, report = optimize(model, device="A10G-24GB", checkpointing="selective", example_batch=x)
    entry = report["checkpointing"]
    assert entry.applied
    assert entry.reason.startswith("selective: 3 repeated blocks under torch.utils.checkpoint")
    assert entry.memory_delta_bytes is not None and entry.memory_delta_bytes < 0
    assert all("forward" in layer.__dict__ for layer in model.layers)


def test_aggressive_checkpoints_only_where_the_step_does_not_fit() -> None:
    model = encoder(layers=2, width=32)
    _, _, report = optimize(
        model, device="cpu", level="aggressive", example_batch=torch.randn(2, 8, 32)
    )
    assert report["checkpointing"].reason.startswith("the step fits without it")
    assert not any("forward" in layer.__dict__ for layer in model.layers)
    # Without a batch to price, aggressive checkpoints selectively.
    _, _, report = optimize(model, device="cpu", level="aggressive")
    assert report["checkpointing"].applied
    assert report["checkpointing"].reason.startswith("selective")


def test_the_checkpointing_variable_beats_the_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMCTL_CHECKPOINTING", "full")
    model = encoder()
    _, _, report = optimize(model, device="cpu", checkpointing="none")
    assert report["checkpointing"].applied
    assert report["checkpointing"].reason.endswith("(VRAMCTL_CHECKPOINTING=full)")


def test_a_second_call_does_not_checkpoint_twice() -> None:
    model = encoder()
    optimize(model, device="cpu", checkpointing="full")
    wrapper = model.layers[0].forward
    _, _, report = optimize(model, device="cpu", checkpointing="selective")
    assert report["checkpointing"].reason == "the model checkpoints its activations already"
    assert model.layers[0].forward is wrapper


# -- compile ------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _refusing_backend(gm: torch.fx.GraphModule, example_inputs: object) -> object:
    raise RuntimeError("this backend refuses every graph")


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compile_error_falls_back_and_the_model_still_runs() -> None:
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(4, 16)
    expected = model(x)
    _, _, report = optimize(
        model, device="cpu", compile=True, compile_options={"backend": _refusing_backend}
    )
    assert report["compile"].applied  # until the first call
    with pytest.warns(RuntimeWarning, match="torch.compile of Sequential failed"):
        out = model(x)
    torch.testing.assert_close(out, expected)
    entry = report["compile"]
    assert not entry.applied
    assert entry.reason == (
        "torch.compile failed, runs eagerly: BackendCompilerFailed: RuntimeError: this backend "
        "refuses every graph"
    )
    torch.testing.assert_close(model(x), expected)  # eager from now on, no second warning


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_models_own_error_is_not_blamed_on_compile() -> None:
    model = mlp()
    optimize(model, device="cpu", compile=True, compile_options={"backend": "eager"})
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        model(torch.randn(4, 3))
    assert model(torch.randn(4, 16)).shape == (4, 4)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_model_is_not_compiled_again() -> None:
    model = mlp()
    optimize(model, device="cpu", compile=True, compile_options={"backend": "eager"})
    wrapper = model.forward
    _, _, report = optimize(model, device="cpu", compile=True)
    assert report["compile"].reason == "the model is compiled already"
    assert model.forward is wrapper
    _, _, report = optimize(torch.compile(mlp(), backend="eager"), device="cpu", compile=True)
    assert report["compile"].reason == "the model is compiled already"


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_with_a_memory_budget_instead_of_wrapping() -> None:
    budgets: list[float] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        from torch._functorch import config

        budgets.append(config.activation_memory_budget)
        return gm.forward

    model = encoder(layers=2, width=32, dropout=0.0)
    x = torch.randn(2, 8, 32)
    expected = model(x)
    _, _, report = optimize(
        model, device="cpu", level="aggressive", compile=True, compile_options={"backend": backend}
    )
    assert report["compile"].applied
    assert "activation_memory_budget=0.5" in report["checkpointing"].reason
    assert not any("forward" in layer.__dict__ for layer in model.layers)  # not wrapped
    torch.testing.assert_close(model(x), expected)
    assert budgets and set(budgets) == {0.5}
    from torch._functorch import config

    assert config.activation_memory_budget == 1.0  # only while compiling and running


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_off_unless_asked_or_aggressive_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, report = optimize(mlp(), device="cpu")
    assert report["compile"].reason.startswith("level='basic' does not compile")
    _, _, report = optimize(mlp(), device="cpu", level="aggressive")
    assert "compile='auto' compiles on a CUDA GPU only" in report["compile"].reason
    _, _, report = optimize(mlp(), device=FakeCuda(), level="none")
    assert report["compile"].reason.startswith("would apply")
    monkeypatch.setenv("VRAMCTL_COMPILE", "0")
    model = mlp()
    _, _, report = optimize(model, device="cpu", compile=True)
    assert report["compile"].reason == "VRAMCTL_COMPILE=0"
    assert "forward" not in model.__dict__


# -- level none, predictions, the report ----------------------------------------------


def test_level_none_changes_nothing_and_says_what_would_apply() -> None:
    model = convnet()
    opt = torch.optim.AdamW(model.parameters())
    _, step, report = optimize(model, device="A10G-24GB", optimizer=opt, level="none")
    assert not report.applied
    for name in ("precision", "channels_last", "optimizer"):
        assert report[name].reason.startswith("would apply (level='none' changes nothing)")
    assert step.precision == "fp32" and step.optimizer is opt and step.scaler is None
    assert model[0].weight.is_contiguous()


def test_predicted_effects_come_from_the_estimator() -> None:
    model = encoder(layers=2, width=64)
    x = torch.randn(4, 32, 64)
    _, _, report = optimize(model, device="A10G-24GB", example_batch=x)
    fp32 = vramctl.estimate(model, x, device="A10G-24GB", precision="fp32")
    bf16 = vramctl.estimate(model, x, device="A10G-24GB", precision="amp-bf16")
    entry = report["precision"]
    assert entry.memory_delta_bytes == bf16.peak_device - fp32.peak_device
    if fp32.step_seconds is None or bf16.step_seconds is None:
        assert entry.time_delta_seconds is None
    else:
        assert entry.time_delta_seconds == pytest.approx(bf16.step_seconds - fp32.step_seconds)
    assert report.notes[0].startswith("effects predicted by the estimator on sim:A10G-24GB")


def test_no_example_batch_no_predictions() -> None:
    _, _, report = optimize(encoder(), device="A10G-24GB", checkpointing="full")
    assert report["precision"].applied and report["checkpointing"].applied
    assert all(o.memory_delta_bytes is None and o.time_delta_seconds is None for o in report)
    assert "pass example_batch=" in report.notes[0]


def test_the_report_as_a_table_and_a_dict() -> None:
    _, _, report = optimize(convnet(), device="cpu")
    text = str(report)
    assert text.splitlines()[0] == "optimizations for cpu (level basic, train):"
    assert text.splitlines()[1].split() == ["optimization", "applied", "memory", "time", "reason"]
    assert "channels_last    yes" in text
    d = report.to_dict()
    assert d["device"] == "cpu" and d["level"] == "basic"
    assert [o["name"] for o in d["optimizations"]] == report.names
    assert set(d["optimizations"][0]) == {
        "name",
        "applied",
        "reason",
        "memory_delta_bytes",
        "time_delta_seconds",
    }
    with pytest.raises(KeyError, match="no optimization 'fp8'"):
        report["fp8"]
