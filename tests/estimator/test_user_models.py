"""Models users bring: outputs, attention, bad arguments, errors, and their module left alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vramctl
from tests.estimator.real_steps import cpu_step_peak
from vramctl.estimator import EstimateError


class ConvNet(nn.Module):
    """Batch norm, dropout, a frozen head and a hook: state the estimator must not change."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 2)
        self.head.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.drop(self.bn(self.conv(x))).mean((2, 3)))
        return out


def _state(m: nn.Module) -> tuple[object, ...]:
    return (
        [(mod.training, len(mod._forward_hooks)) for mod in m.modules()],
        [(n, p.data_ptr(), p.requires_grad, p.device, p.grad) for n, p in m.named_parameters()],
        [(n, b.data_ptr(), b.clone()) for n, b in m.named_buffers()],
    )


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    flags_a, params_a, bufs_a = a
    flags_b, params_b, bufs_b = b
    return (
        flags_a == flags_b
        and params_a == params_b
        and all(
            n1 == n2 and p1 == p2 and torch.equal(t1, t2)
            for (n1, p1, t1), (n2, p2, t2) in zip(bufs_a, bufs_b, strict=True)  # type: ignore[call-overload]
        )
    )


def test_the_users_model_is_left_as_it_was() -> None:
    m = ConvNet().eval()
    m.conv.register_forward_hook(lambda *_: None)
    before = _state(m)
    x = torch.randn(2, 3, 16, 16)
    vramctl.estimate(m, x, device="cpu")  # a training step: train mode while it is traced
    vramctl.estimate(m, x, device="T4-16GB", precision="amp-fp16")
    vramctl.max_batch_size(m, lambda b: torch.randn(b, 3, 16, 16), device="1GiB", limit=8)
    assert _same(before, _state(m))
    m.train()
    vramctl.estimate(m, x, device="cpu", mode="infer")
    assert all(mod.training for mod in m.modules())


def test_checkpointing_is_switched_off_again_on_a_users_hf_model() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    m = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 512, (2, 32))
    est = vramctl.estimate(m, {"input_ids": ids, "labels": ids}, device="cpu", checkpointing=True)
    assert not any(mod.training for mod in m.modules())
    assert not any(getattr(mod, "gradient_checkpointing", False) for mod in m.modules())
    full = vramctl.estimate(m, {"input_ids": ids, "labels": ids}, device="cpu")
    assert est.logical_peak < full.logical_peak  # the second estimate did not checkpoint


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 128)
        self.out = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> Output:
        h = torch.relu(self.proj(x))
        return Output(self.out(h) * scale, h)


class SharedModule(nn.Module):
    """One module registered under three paths, as timm's CoaT shares its positional
    convolution with every block, and a weight tied between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(64, 64)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64)) for _ in range(2)])
        for block in self.blocks:
            block.pos = self.pos
        self.head = nn.Linear(64, 64, bias=False)
        self.head.weight = self.blocks[0][0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block.pos(block[0](x))
        out: torch.Tensor = self.head(x)
        return out


def test_a_module_shared_under_several_paths_is_estimated_and_left_as_it_was() -> None:
    """PyTorch's ``_reparametrize_module`` took the shared module's paths for tied values
    given apart (an error), and swapped its one attribute once per path, leaving a fake
    tensor in the model."""
    torch.manual_seed(0)
    m = SharedModule()
    before = _state(m)
    real = m.pos.weight
    x = torch.randn(16, 64)
    est = vramctl.estimate(m, x, device="cpu")
    assert m.pos.weight is real and m.blocks[1].pos.weight is real
    assert m.head.weight is m.blocks[0][0].weight
    assert _same(before, _state(m))
    assert vramctl.estimate(m, x, device="cpu").logical_peak == est.logical_peak
    truth = cpu_step_peak(SharedModule(), x)
    assert abs(est.logical_peak - truth) / truth < 0.01


def test_a_dataclass_output_gives_the_loss_and_matches_the_real_step() -> None:
    torch.manual_seed(0)
    batch = {"x": torch.randn(16, 64), "scale": 2.0}
    est = vramctl.estimate(DataclassModel(), batch, device="cpu")
    truth = cpu_step_peak(DataclassModel(), batch)
    assert abs(est.logical_peak - truth) / truth < 0.01


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_scaled_dot_product_attention_scratch_on_cpu(mode: str) -> None:
    # The CPU flash-attention kernels keep per-thread blocks (forward) and gradient
    # accumulators (backward) that are not outputs: 5-10% of this step.
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64)
    est = vramctl.estimate(Attention(), x, device="cpu", mode=mode)
    from vramctl.estimator._spec import StepSpec

    truth = cpu_step_peak(Attention(), x, StepSpec(mode=mode))
    assert abs(est.logical_peak - truth) / truth < 0.01


@pytest.mark.parametrize("size", [0, -1, 2.5, "3", True])
def test_a_bad_batch_size_is_refused(size: object) -> None:
    with pytest.raises(EstimateError, match="batch_size must be a positive integer"):
        vramctl.estimate(nn.Linear(4, 4), lambda b: torch.randn(b, 4), batch_size=size)  # type: ignore[arg-type]


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        raise ValueError(f"unexpected input of {h.shape[0]} rows")


def test_an_error_in_the_models_code_comes_through_as_the_models() -> None:
    with pytest.raises(EstimateError, match=r"Broken raised ValueError at Broken \(forward\)") as e:
        vramctl.estimate(Broken(), torch.randn(3, 4), device="cpu")
    assert "unexpected input of 3 rows" in str(e.value)
    assert "op " not in str(e.value)  # no operator of the trace failed
    assert isinstance(e.value.__cause__, ValueError)


def test_a_batch_on_the_meta_device_is_traced_like_a_real_one() -> None:
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    real = vramctl.estimate(m, torch.randn(4, 64), device="cpu")
    meta = vramctl.estimate(m, torch.empty(4, 64, device="meta"), device="cpu")
    assert meta.logical_peak == real.logical_peak
    assert meta.breakdown["inputs"] == 4 * 64 * 4


class MovesToTheGpu(nn.Module):
    """Code written for a GPU: positions made on ``cuda`` and the input moved there."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.pos = nn.Embedding(16, 32)
        self.head = nn.Linear(32, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to("cuda").cuda()
        positions = torch.arange(ids.shape[1], device="cuda")
        self.to("cuda").cuda()  # already "there" for the trace: no-ops
        out: torch.Tensor = self.head(self.emb(ids) + self.pos(positions))
        return out


class SameOnTheHost(MovesToTheGpu):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(ids) + self.pos(torch.arange(ids.shape[1])))
        return out


def test_tensors_made_on_the_gpu_in_the_forward_are_traced_on_the_host() -> None:
    ids = torch.randint(0, 100, (4, 16))
    on_gpu = vramctl.estimate(MovesToTheGpu(), ids, device="cpu", loss_fn=lambda o, b: o.sum())
    on_host = vramctl.estimate(SameOnTheHost(), ids, device="cpu", loss_fn=lambda o, b: o.sum())
    assert on_gpu.logical_peak == on_host.logical_peak
    assert on_gpu.breakdown == on_host.breakdown


class CachedBias(nn.Module):
    """A wide layer, then a bias made in the first forward in eval mode and kept in a plain
    dict (as timm's LeViT keeps its attention biases): made after the step's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(64, 4096)
        self.out = nn.Linear(4096, 64)
        self.table = nn.Parameter(torch.randn(64))
        self.cache: dict[str, torch.Tensor] = {}

    def bias(self, device: torch.device) -> torch.Tensor:
        if self.training:
            return self.table.repeat(512, 1)
        key = str(device)
        if key not in self.cache:
            self.cache[key] = self.table.repeat(512, 1)  # 128 KiB, kept between steps
        return self.cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(torch.relu(self.wide(x)))
        return h + self.bias(x.device)[: x.shape[0]]


def test_a_tensor_a_forward_makes_once_and_keeps_is_live_through_the_next_steps() -> None:
    """The loop's peak, not the first step's: the first step made the cache after its
    peak; every later step holds it from its start and does not make it again. timm's
    LeViT inference read 23.7% over a truth that left such a cache out, then 4.3% under
    with the cache counted, before the estimate took the loop's peak (now 0.00%)."""
    from tests.estimator.real_steps import profiled_peak, storages_bytes
    from vramctl.estimator._spec import StepSpec, prepare_model, run_step

    torch.manual_seed(0)
    x = torch.randn(256, 64)
    est = vramctl.estimate(CachedBias(), x, mode="infer", device="cpu")
    m, spec = CachedBias(), StepSpec(mode="infer")
    prepare_model(m, spec)
    run_step(m, x, spec, None)  # the first step makes the cache
    cache = storages_bytes(list(m.cache.values()))
    assert cache == 512 * 64 * 4
    held = storages_bytes([*m.parameters(), x, *m.cache.values()])
    real = held + profiled_peak(lambda: run_step(m, x, spec, None))
    assert abs(est.peak_allocated - real) <= 0.01 * real
    assert est.peak_allocated == est.logical_peak
    assert sum(est.breakdown.values()) == est.peak_allocated
    # the first step alone reads a cache's bytes less: made after the peak
    first, _ = est_trace_first_peak(x)
    assert est.logical_peak - first == cache


def est_trace_first_peak(x: torch.Tensor) -> tuple[int, int]:
    """The first step's own logical peak of :class:`CachedBias`' inference, traced."""
    from vramctl.estimator._rates import RATES
    from vramctl.estimator._session import make_batch_for, open_session

    session = open_session(CachedBias(), vramctl.Step(mode="infer", device="cpu"), RATES)
    try:
        real, size = make_batch_for(session, x, None, None, None)
        return session.trace(real, size).trace.peak()
    finally:
        session.close()


def test_a_trace_ends_with_its_step() -> None:
    """Storages that die after the step (the model's, once its session is closed and a
    later estimate lets go of it) are no events of the step's trace: a trace read afterwards
    (a benchmark's, a loop's replay) frees no parameter. What the step names as dying with
    it (its batch, which the loop's next batch replaces) dies at its end."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramctl.estimator._trace import Tracer

    fake = FakeTensorMode()
    with fake:
        weight, batch = torch.empty(64, 64), torch.empty(4, 64)
    tracer = Tracer(fake)
    kept, dying = tracer.register(weight), tracer.register(batch)
    with fake, tracer:
        out = batch @ weight
    assert kept is not None and dying is not None
    tracer.close({dying})
    events = list(tracer.trace.events)
    assert events[-1] == ~dying
    del weight, batch, out
    gc.collect()
    assert tracer.trace.events == events
