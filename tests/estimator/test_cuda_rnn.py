"""Recurrent layers as cuDNN runs them on a CUDA target (estimator/_cuda_rnn.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vramctl
from vramctl.estimator._cuda_rnn import WORKSPACE_FIXED, RnnCall

H200 = "H200-141GB"


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module], head: bool = False) -> None:
        super().__init__()
        self.rnn = cell(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 10) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rnn(x)[0]
        return self.head(y) if self.head is not None else y


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.float().square().mean()


def _estimate(model: nn.Module, mode: str, device: str = H200, **kw: object) -> vramctl.Estimate:
    return vramctl.estimate(
        model,
        torch.randn(8, 32, 64),
        device=device,
        mode=mode,
        calibration=False,
        loss_fn=_loss,
        **kw,  # type: ignore[arg-type]
    )


def test_the_call_takes_cudnns_sizes() -> None:
    call = RnnCall("lstm", 2, 1, True, True, torch.float32, 2, 128, 16, 256, 512)
    # the workspace: the fixed part, then per sample and step one layer's gates, one
    # layer's output and the input; the reserve: 5.5 hidden vectors per step and layer
    assert call.workspace_bytes() == WORKSPACE_FIXED + 16 * 128 * (5 * 512 + 256) * 4
    assert call.reserve_bytes() == 16 * 128 * int(5.5 * 512 * 2) * 4
    inference = RnnCall("gru", 2, 1, True, False, torch.bfloat16, 1, 128, 16, 256, 512)
    assert inference.reserve_bytes() == 0
    assert inference.workspace_bytes() == WORKSPACE_FIXED + 16 * 128 * (4 * 512 + 256) * 2
    # a float32 call's workspace holds its weights' bytes too; a bfloat16 one's does not
    assert call.workspace_bytes(1000) == call.workspace_bytes() + 4000
    assert inference.workspace_bytes(1000) == inference.workspace_bytes()


@pytest.mark.parametrize(("autocast", "copies"), [(False, 0), (True, 1)])
def test_the_weights_are_copied_only_where_they_are_not_one_buffer(
    autocast: bool, copies: int
) -> None:
    """On a GPU a layer's weights are one buffer, which cuDNN runs on as it is; under
    autocast they are cast one by one, and the casts are copied into one buffer."""
    from vramctl.estimator._cuda_rnn import CudnnRnn

    rnn = nn.GRU(8, 16, num_layers=2, batch_first=True)
    weights = sum(p.numel() for p in rnn.parameters())
    x = torch.randn(2, 5, 8)
    made: list[int] = []

    class Sizes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.new_empty.default:
                made.append(out.numel())
            return out

    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with torch.no_grad(), CudnnRnn(), Sizes(), cast:
        rnn(x)
    assert made.count(weights) == copies


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_cuda_target_runs_the_recurrent_layer_as_cudnn(cell: type[nn.Module], mode: str) -> None:
    est = _estimate(Recurrent(cell), mode)
    host = _estimate(Recurrent(cell), mode, device="cpu")
    # cuDNN's workspace alone is larger than the host's whole step here
    assert est.peak_allocated > WORKSPACE_FIXED > host.peak_allocated
    assert est.breakdown["workspaces"] >= WORKSPACE_FIXED or mode == "train"


def test_a_step_with_no_matrix_product_makes_no_cublas_workspace() -> None:
    cublas = 4096 * 1024 * 8  # one handle's, from Hopper (the head on the GRU's output: mm)
    without = _estimate(Recurrent(nn.GRU), "infer")
    with_head = _estimate(Recurrent(nn.GRU, head=True), "infer")
    head_output = 8 * 32 * 10 * 4
    # the head's product makes the workspace (and the head its output, after the GRU's peak)
    assert with_head.peak_allocated - without.peak_allocated >= cublas
    assert with_head.peak_allocated - without.peak_allocated <= cublas + head_output + 8192


@pytest.mark.parametrize("autocast", [False, True])
def test_the_stand_in_returns_the_layers_outputs_and_every_weights_gradient(
    autocast: bool,
) -> None:
    from vramctl.estimator._cuda_rnn import CudnnRnn

    rnn = nn.LSTM(8, 16, num_layers=2, batch_first=True)
    x = torch.randn(2, 5, 8)
    expected = rnn(x)
    # outside a trace the values are garbage (none are computed): shapes and gradients only
    with CudnnRnn(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, (h, c) = rnn(x)
        loss = out.float().square().mean()
    assert out.shape == expected[0].shape and h.shape == expected[1][0].shape
    assert c.shape == expected[1][1].shape
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
    loss.backward()
    # every weight got a gradient of its own shape and dtype (views of one buffer, or their
    # fp32 casts under autocast)
    for p in rnn.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype


def test_packed_sequences_keep_the_hosts_kernels() -> None:
    from vramctl.estimator._cuda_rnn import CudnnRnn

    rnn = nn.LSTM(8, 16, batch_first=True)
    x = torch.randn(2, 5, 8)
    # packed sequences take the host's path
    packed = nn.utils.rnn.pack_padded_sequence(x, [5, 3], batch_first=True)
    with CudnnRnn():
        out_packed, _ = rnn(packed)
    assert torch.equal(out_packed.data, rnn(packed)[0].data)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_gpus_lstm_step_peaks_as_estimated(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.LSTM(256, 512, num_layers=2, batch_first=True).cuda().train(mode == "train")
    x = torch.randn(16, 128, 256, device="cuda")
    opt = torch.optim.AdamW(model.parameters()) if mode == "train" else None
    est = vramctl.estimate(
        model,
        x,
        device="cuda:0",
        mode=mode,
        calibration=False,
        loss_fn=lambda out, _b: out[0].float().square().mean(),
        optimizer="adamw",
    )

    def step() -> None:
        if opt is None:
            with torch.no_grad():
                model(x)
            return
        model(x)[0].float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state, as the estimate holds it
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated()
    # the sizes were fitted on an H200; other GPUs' cuDNN may choose other workspaces
    assert abs(est.peak_allocated / real - 1) < 0.05


def test_a_gpu_holds_each_recurrent_layers_weights_in_one_buffer() -> None:
    from vramctl.estimator._cuda_rnn import flat_weight_bytes

    model = nn.Sequential(nn.Linear(4, 64), nn.LSTM(64, 32, num_layers=2), nn.GRU(32, 16))
    flat = flat_weight_bytes(model)
    lstm = sum(p.numel() * 4 for p in model[1].parameters())
    gru = sum(p.numel() * 4 for p in model[2].parameters())
    assert flat["1.weight_ih_l0"] == lstm and flat["2.weight_ih_l0"] == gru
    assert sum(flat.values()) == lstm + gru  # the other weights are views of those buffers
    assert "0.weight" not in flat  # not a recurrent layer
    # the estimate's parameters are the same bytes, held as the buffers
    est = vramctl.estimate(
        Recurrent(nn.LSTM), torch.randn(2, 8, 64), device=H200, mode="infer", calibration=False
    )
    assert est.breakdown["parameters"] == sum(
        p.numel() * 4 for p in Recurrent(nn.LSTM).parameters()
    )
