"""One rank of a distributed step, estimated in this process: DDP, FSDP2, ZeRO, tensor parallel.

What these check is the estimator's own arithmetic and wiring, on fake tensors; the real
per-rank peaks of gloo runs are compared in test_distributed_truth.py.
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from typer.testing import CliRunner

import vramctl
from vramctl.cli._app import app
from vramctl.estimator import EstimateError, Parallel, ParallelError, estimate, max_batch_size
from vramctl.estimator._distributed import _buckets, zero_model_states


class Blocks(nn.Module):
    """Four residual MLP blocks and a head: a model FSDP shards block by block."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.float().pow(2).mean()


def _est(parallel: Parallel | str | None, **kw: object) -> vramctl.Estimate:
    return estimate(
        Blocks(),
        torch.randn(32, 256),
        parallel=parallel,
        device="cpu",
        loss_fn=_loss,
        **kw,  # type: ignore[arg-type]
    )


PARAM_BYTES = sum(p.numel() for p in Blocks().parameters()) * 4


# -- the layout --------------------------------------------------------------------------


def test_parse_and_describe() -> None:
    p = Parallel.parse("fsdp:8,no_reshard_after_forward,param_dtype=bf16,ranks_per_node=4")
    assert (p.strategy, p.world_size, p.reshard_after_forward) == ("fsdp", 8, False)
    assert p.param_dtype == "bf16" and p.nodes == 2
    assert p.describe() == (
        "fsdp over 8 ranks (ranks_per_node=4, no reshard_after_forward, param_dtype=bf16)"
    )
    assert Parallel.parse("ddp:4,bucket_cap_mb=50").bucket_cap_mb == 50.0
    assert Parallel.parse("zero3:16,offload").zero_stage == 3
    assert Parallel.parse("zero2", world_size=3).world_size == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pipeline:4", "strategy must be one of"),
        ("ddp:x", "world size must be an integer"),
        ("ddp:0", "at least 1"),
        ("ddp:4,bucket_cap=3", "unknown parallel option 'bucket_cap'"),
        ("ddp:4,bucket_cap_mb", "needs a value"),
        ("fsdp:4,param_dtype=int8", "param_dtype must be one of"),
        ("fsdp:4,ranks_per_node=3", "ranks_per_node must divide"),
        ("tp:2", "needs the model's plan"),
        ("ddp:2,offload", "offload applies to fsdp"),
    ],
)
def test_bad_layouts_say_why(text: str, message: str) -> None:
    with pytest.raises(ParallelError, match=message):
        Parallel.parse(text)


def test_inference_is_refused() -> None:
    with pytest.raises(EstimateError, match="training step"):
        _est("ddp:2", mode="infer")


# -- DDP ---------------------------------------------------------------------------------


def test_ddp_buckets_hold_every_gradient() -> None:
    one = _est(None)
    ddp = _est("ddp:4")
    assert ddp.breakdown["buckets"] == PARAM_BYTES
    assert ddp.world_size == 4 and ddp.parallel == "ddp over 4 ranks"
    # the buckets are extra to the gradients autograd makes, and live through the step
    assert ddp.logical_peak == pytest.approx(one.logical_peak + PARAM_BYTES, rel=0.02)
    # as views, the gradients are the buckets: no second copy
    view = _est("ddp:4,gradient_as_bucket_view")
    assert view.logical_peak < ddp.logical_peak - PARAM_BYTES // 2
    assert view.breakdown["buckets"] + view.breakdown["gradients"] <= PARAM_BYTES * 1.01


def test_bucket_assignment_caps() -> None:
    ts = [torch.empty(256 * 1024) for _ in range(10)]  # 1 MiB each
    buckets = _buckets(ts, cap=3 * 1024 * 1024)
    # the first bucket closes at 1 MiB, the rest at the cap
    assert [len(b) for b in buckets] == [1, 3, 3, 3]
    mixed = _buckets([torch.empty(10), torch.empty(10, dtype=torch.bfloat16)], cap=1 << 20)
    assert len(mixed) == 2  # one dtype per bucket


# -- FSDP2 -------------------------------------------------------------------------------


def test_fsdp_shards_parameters_and_optimizer_state() -> None:
    for world in (2, 4):
        est = _est(f"fsdp:{world}")
        assert est.breakdown["parameters"] == pytest.approx(PARAM_BYTES / world, rel=0.01)
        assert est.breakdown["optimizer"] == pytest.approx(2 * PARAM_BYTES / world, rel=0.01)
        assert est.breakdown["unsharded"] > 0
    assert not dist.is_initialized()  # the fake process group is gone with the estimate


def test_fsdp_keeping_gathered_parameters_costs_memory() -> None:
    resharded = _est("fsdp:4")
    kept = _est("fsdp:4,no_reshard_after_forward")
    assert kept.logical_peak > resharded.logical_peak
    assert kept.breakdown["unsharded"] > resharded.breakdown["unsharded"]


def test_fsdp_offload_moves_state_to_the_host() -> None:
    on_device = _est("fsdp:4")
    offloaded = _est("fsdp:4,offload,ranks_per_node=2")
    assert offloaded.breakdown["parameters"] == offloaded.breakdown["optimizer"] == 0
    assert offloaded.host_per_rank >= 3 * PARAM_BYTES / 4 * 0.99
    assert offloaded.host_per_node == 2 * offloaded.host_per_rank
    assert offloaded.logical_peak < on_device.logical_peak


def test_fsdp_mixed_precision_gathers_half_parameters() -> None:
    full = _est("fsdp:4")
    half = _est("fsdp:4,param_dtype=bf16")
    assert half.breakdown["parameters"] == full.breakdown["parameters"]  # fp32 shards
    assert half.breakdown["unsharded"] < full.breakdown["unsharded"]


def test_a_gloo_reduce_scatter_holds_a_copy_of_its_input() -> None:
    from torch.profiler import profile

    from vramctl.estimator._distributed import FakeWorld, _gloo_reduce_scatter_copies

    def allocated(copies: bool) -> list[int]:
        grads, shard = torch.ones(1 << 16), torch.empty(1 << 15)
        copying = _gloo_reduce_scatter_copies() if copies else contextlib.nullcontext()
        with profile(profile_memory=True) as prof, copying:
            dist.reduce_scatter_single(shard, grads)
        return [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]

    original = dist.reduce_scatter_single
    world = FakeWorld(2)
    try:
        assert 4 << 16 not in allocated(False)  # the fake group reduces nothing
        assert 4 << 16 in allocated(True)  # gloo's copy of the whole input
    finally:
        world.close()
    assert dist.reduce_scatter_single is original


def test_concurrent_fsdp_estimates_leave_fsdp_and_gloo_as_they_were() -> None:
    import threading

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    names = ("unshard", "wait_for_unshard", "post_backward")
    methods = {n: vars(FSDPParamGroup)[n] for n in names}
    scatter = dist.reduce_scatter_tensor
    errors: list[BaseException] = []
    peaks: list[int] = []
    go = threading.Barrier(3)

    def run() -> None:
        try:
            go.wait(timeout=60)
            for _ in range(3):
                peaks.append(_est("fsdp:2").peak_allocated)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    # each trace swapped these in and out for the whole process before, and restored them
    # out of order: a later trace put back an earlier one's wrapper for good
    assert {n: vars(FSDPParamGroup)[n] for n in names} == methods
    assert dist.reduce_scatter_tensor is scatter
    assert len(set(peaks)) == 1 and len(peaks) == 9  # the same step, whichever thread


def test_a_process_group_already_there_is_not_replaced() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(EstimateError, match="already has a process group"):
            _est("fsdp:2")
        assert _est("ddp:2").world_size == 2  # DDP's stand-in needs no group
    finally:
        dist.destroy_process_group()


# -- ZeRO ---------------------------------------------------------------------------------


def test_zero_stages_shard_more_each() -> None:
    peaks = [_est(f"zero{s}:4").breakdown for s in (1, 2, 3)]
    one = _est(None).breakdown
    assert peaks[0]["optimizer"] == pytest.approx(one["optimizer"] / 4, rel=0.01)
    assert peaks[0]["parameters"] == one["parameters"]
    assert peaks[2]["parameters"] == pytest.approx(one["parameters"] / 4, rel=0.01)
    assert peaks[2]["unsharded"] > 0


def test_zero_model_states_match_deepspeeds_definitions() -> None:
    psi, n = 1_000_000, 8
    # bf16 with Adam: 2 bytes of parameters, 2 of gradients, 12 of optimizer (fp32 master,
    # momentum, variance), sharded by stage
    z1 = zero_model_states(
        Parallel("zero1", n), parameters=psi, param_bytes=2, state_elements=2,
        largest_block=0, half=True,
    )  # fmt: skip
    assert (z1.parameters, z1.gradients, z1.optimizer) == (2 * psi, 2 * psi, 12 * psi // n)
    z2 = zero_model_states(
        Parallel("zero2", n), parameters=psi, param_bytes=2, state_elements=2,
        largest_block=0, half=True,
    )  # fmt: skip
    assert z2.gradients == 2 * psi // n
    z3 = zero_model_states(
        Parallel("zero3", n, prefetch_bucket_size=0), parameters=psi, param_bytes=2,
        state_elements=2, largest_block=1000, half=True,
    )  # fmt: skip
    assert z3.parameters + z3.gradients + z3.optimizer == 16 * psi // n
    assert z3.unsharded == 2 * 1000
    off = zero_model_states(
        Parallel("zero3", n, offload=True), parameters=psi, param_bytes=2,
        state_elements=2, largest_block=0, half=True,
    )  # fmt: skip
    assert off.optimizer == off.parameters == 0 and off.host == 12 * psi // n + 2 * psi // n + (
        4 * math.ceil(psi / n)
    )


def test_zero_beside_deepspeeds_own_estimate() -> None:
    ds = pytest.importorskip("deepspeed.runtime.zero.stage3")
    psi, n = 10_000_000, 4
    _cpu, gpu, _largest = ds.estimate_zero3_model_states_mem_needs(
        psi, largest_layer_params=0, num_gpus_per_node=n, cpu_offload=False
    )
    z3 = zero_model_states(
        Parallel("zero3", n, prefetch_bucket_size=0), parameters=psi, param_bytes=2,
        state_elements=2, largest_block=0, half=True,
    )  # fmt: skip
    # DeepSpeed counts 18 bytes a parameter over the ranks (16 of states and 2 of
    # buffers); ours are the 16 of states
    assert z3.parameters + z3.gradients + z3.optimizer == pytest.approx(gpu * 16 / 18, rel=0.01)


# -- tensor parallel ---------------------------------------------------------------------


def test_tensor_parallel_splits_the_planned_layers() -> None:
    plan = {"blocks.*.0": "colwise", "blocks.*.2": "rowwise"}
    one = _est(None)
    tp = _est(Parallel("tp", 4, plan=plan))
    head = (256 * 10 + 10) * 4
    # the blocks' weights are split four ways (row-wise biases stay whole); the head is not
    assert tp.breakdown["parameters"] < (one.breakdown["parameters"] - head) / 4 * 1.05 + head
    with pytest.raises(ParallelError, match="colwise, rowwise"):
        Parallel("tp", 2, plan={"blocks.*.0": "diagonal"})


# -- the largest micro-batch, the command line --------------------------------------------


def test_largest_micro_batch_per_rank_grows_with_sharding() -> None:
    def batch(b: int) -> torch.Tensor:
        return torch.randn(b, 16, 1024)

    common = {"device": "2GiB", "loss_fn": _loss, "target_utilization": 1.0, "safe": False}
    single = max_batch_size(Blocks(1024), batch, **common)  # type: ignore[arg-type]
    sharded = max_batch_size(Blocks(1024), batch, parallel="fsdp:8", **common)  # type: ignore[arg-type]
    assert sharded.batch_size > single.batch_size >= 1
    assert sharded.estimate is not None and sharded.estimate.parallel == "fsdp over 8 ranks"


def test_cli_estimates_a_rank() -> None:
    runner = CliRunner()
    res = runner.invoke(
        app,
        ["estimate", "lstm", "--seq-len", "32", "--device", "cpu", "--parallel", "fsdp:4",
         "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["inputs"]["parallel"]["world_size"] == 4
    est = doc["estimates"][0]
    assert est["parallel"] == "fsdp over 4 ranks" and est["breakdown_bytes"]["unsharded"] > 0
    text = runner.invoke(
        app, ["estimate", "lstm", "--seq-len", "32", "--device", "cpu", "--parallel", "ddp:2"]
    )
    assert text.exit_code == 0 and "per rank: ddp over 2 ranks" in text.output
    bad = runner.invoke(app, ["estimate", "lstm", "--world-size", "4"])
    assert bad.exit_code != 0 and "need --parallel" in bad.output


# -- the planner's parallel axis ----------------------------------------------------------


def test_plan_prices_each_layout_per_rank() -> None:
    def batch(b: int) -> torch.Tensor:
        return torch.randn(b, 16, 1024)

    result = vramctl.plan(
        Blocks(1024),
        batch,
        device="6GiB",
        effective_batch=16,
        loss_fn=_loss,
        precisions=["fp32"],
        checkpointing=["none"],
        offload=["none"],
        optimizers=["adamw"],
        parallel=["ddp:4", "fsdp:4", "zero2:3"],
    )
    assert any("zero2 over 3 ranks" in s and "do not divide" in s for s in result.skipped)
    layouts = {p.parallel for p in result.plans}
    assert layouts == {"ddp over 4 ranks", "fsdp over 4 ranks"}
    for p in result.plans:
        if p.fits:
            assert p.effective_batch == 16 and p.data_parallel == 4
            assert p.estimate is not None and p.estimate.parallel == p.parallel
    assert result.best is not None and result.best.label.startswith(result.best.parallel or "")


def test_the_model_given_is_left_as_it_was() -> None:
    model = Blocks()
    before = {n: (type(p), p.data_ptr()) for n, p in model.named_parameters()}
    estimate(model, torch.randn(8, 256), device="cpu", loss_fn=_loss, parallel="fsdp:2")
    estimate(model, torch.randn(8, 256), device="cpu", loss_fn=_loss, parallel="ddp:2")
    assert type(model) is Blocks
    assert {n: (type(p), p.data_ptr()) for n, p in model.named_parameters()} == before
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # type: ignore[attr-defined]
