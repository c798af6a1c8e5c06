"""CPU kernel scratch, random values and eager linear: the estimate follows the real step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vramctl
from tests.estimator.real_steps import cpu_infer_peak, cpu_step_peak
from vramctl.estimator import _cpu_kernels
from vramctl.estimator._spec import StepSpec


class PosConv(nn.Module):
    """wav2vec2's positional convolution in small: grouped, a long kernel, weight-norm free."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(256, 256, kernel_size=64, padding=32, groups=16)
        self.head = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.gelu(self.conv(x)).transpose(1, 2))


def test_convolution_scratch_is_measured_and_matches_the_real_step() -> None:
    torch.manual_seed(0)
    model, batch = PosConv(), torch.randn(2, 256, 50)
    est = vramctl.estimate(model, batch, device="cpu")
    truth = cpu_step_peak(model, batch, StepSpec())
    # oneDNN's weight-gradient scratch for this grouped convolution is several weights.
    assert est.breakdown["workspaces"] > model.conv.weight.nbytes
    assert abs(est.logical_peak - truth) / truth < 0.01


def test_too_large_kernels_fall_back_to_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, batch = PosConv(), torch.randn(2, 256, 50)
    measured = vramctl.estimate(model, batch, device="cpu")
    _cpu_kernels.probe_cache_clear()
    monkeypatch.setattr(_cpu_kernels, "PROBE_BYTES_LIMIT", 0)
    ruled = vramctl.estimate(model, batch, device="cpu")
    _cpu_kernels.probe_cache_clear()
    # The rule knows the fp32 forward's output reorder only, not the backward's scratch.
    assert ruled.breakdown["workspaces"] < measured.breakdown["workspaces"]
    assert ruled.logical_peak < measured.logical_peak


class Lm(nn.Module):
    """A two-layer LSTM language model: oneDNN keeps a workspace per layer for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.lstm = nn.LSTM(64, 64, 2, batch_first=True)
        self.head = nn.Linear(64, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(ids))[0])


@pytest.mark.parametrize("measure", [True, False])
def test_a_training_lstm_counts_its_onednn_workspace(
    measure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model, batch = Lm(), torch.randint(0, 100, (16, 24))
    _cpu_kernels.probe_cache_clear()
    if not measure:  # too large to run: the bytes-per-unit rule
        monkeypatch.setattr(_cpu_kernels, "PROBE_BYTES_LIMIT", 0)
    est = vramctl.estimate(model, batch, device="cpu")
    _cpu_kernels.probe_cache_clear()
    truth = cpu_step_peak(model, batch, StepSpec())
    # The meta kernel returns an empty workspace; the real one is ~64 bytes per
    # (step, sample, hidden unit) per layer, larger than the layer's output.
    workspace = 2 * 24 * 16 * 64 * 60
    assert est.logical_peak > workspace
    assert abs(est.logical_peak - truth) / truth < (0.03 if measure else 0.05)


class LayerDrop(nn.Module):
    """Layers skipped at random in training, as wav2vec2 and HuBERT do."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.5:
                continue
            x = torch.tanh(layer(x))
        return x


def test_a_random_layer_drop_is_taken_as_no_drop() -> None:
    batch = torch.randn(64, 512)
    runs = [vramctl.estimate(LayerDrop(), batch, device="cpu") for _ in range(3)]
    assert len({r.logical_peak for r in runs}) == 1  # no randomness in the estimate
    est = runs[0]
    # Every layer ran: each one's weight and bias have a gradient.
    assert est.breakdown["gradients"] == sum(p.nbytes for p in LayerDrop().parameters())
    assert any("random" in a for a in est.assumptions)


class PermutedLinear(nn.Module):
    """ConvNeXt's pattern: a Linear on a permuted (not contiguous) 4-D activation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 64, 3, padding=1)
        self.fc = nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).permute(0, 2, 3, 1))


def test_linear_on_a_permuted_input_adds_its_bias_in_place_as_eager_does() -> None:
    torch.manual_seed(0)
    model, batch = PermutedLinear().eval(), torch.randn(4, 8, 32, 32)
    est = vramctl.estimate(model, batch, mode="infer", device="cpu")
    truth = cpu_infer_peak(model, batch)
    out_bytes = 4 * 32 * 32 * 256 * 4
    # An out-of-place bias add would hold a second fc output at the peak.
    assert est.logical_peak < truth + out_bytes // 2
    assert abs(est.logical_peak - truth) / truth < 0.03


class TruncInit(nn.Module):
    """Weight init by rejection sampling (``nn.init.trunc_normal_`` loops on ``.any()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        nn.init.trunc_normal_(self.fc.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        while (h > 0).any():  # a loop on values the trace cannot know
            h = h - 1
        return h


def test_loops_on_unknown_values_end_at_build_and_in_the_step() -> None:
    est = vramctl.estimate(TruncInit, torch.randn(4, 64), mode="infer", device="cpu")
    assert any("then false" in a for a in est.assumptions)


def test_a_rank_probes_kernels_with_its_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, batch = PosConv(), torch.randn(2, 256, 50)
        _cpu_kernels.probe_cache_clear()
        two = vramctl.estimate(model, batch, device="cpu").breakdown["workspaces"]
        with _cpu_kernels.rank_threads(1) as alone:
            assert alone == torch.get_num_threads() == 2  # one rank on the host: as it is
        with _cpu_kernels.rank_threads(4) as shared:
            # torchrun starts each of several ranks with one intra-op thread
            assert shared == torch.get_num_threads() == 1
            one = vramctl.estimate(model, batch, device="cpu").breakdown["workspaces"]
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        with _cpu_kernels.rank_threads(4) as told:
            assert told == torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
        _cpu_kernels.probe_cache_clear()
    # oneDNN's weight-gradient reduction keeps a copy per thread
    assert 0 < one < two
