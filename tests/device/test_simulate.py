"""The simulated budget, with real tensors and real PyTorch training steps."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import vramctl
from vramctl import (
    InvalidSizeError,
    SimulatedOutOfMemoryError,
    UnknownDeviceError,
    VramctlError,
)

MiB = 2**20


def live_bytes(*objs: object) -> int:
    """Bytes of the distinct storages behind tensors in modules, optimizers and tensors."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for obj in objs:
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                add(p)
                add(p.grad)
            for b in obj.buffers():
                add(b)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for v in state.values():
                    add(v)
        else:
            add(obj)  # type: ignore[arg-type]
    return sum(seen.values())


def mlp(width: int = 256) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def test_a_model_that_fits_runs_a_full_training_step() -> None:
    torch.manual_seed(0)
    with vramctl.simulate("T4-16GB") as gpu:
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(32, 256), torch.randn(32, 256)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        del loss
        gc.collect()
        # What is alive now: params, grads, Adam's two moments and step counters, x, y.
        assert gpu.allocated_bytes == live_bytes(model, opt, x, y)
        assert gpu.peak_bytes > gpu.allocated_bytes  # activations were alive during backward
        mem = gpu.memory()
        assert mem.allocated == gpu.allocated_bytes
        assert mem.total == vramctl.gpu_spec("T4-16GB").cuda_total_bytes
        assert mem.free == mem.total - mem.used  # type: ignore[operator]
        assert mem.peak_allocated == gpu.peak_bytes


def test_the_model_that_does_not_fit_raises_a_real_oom_at_the_crossing_allocation() -> None:
    # 65536 x 65536 fp32 weights = 16 GiB: more than a T4 offers. The budget refuses
    # it before any real memory is taken.
    with vramctl.simulate("T4-16GB") as gpu, pytest.raises(torch.OutOfMemoryError) as err:
        nn.Linear(65536, 65536)
    exc = err.value
    assert isinstance(exc, SimulatedOutOfMemoryError)
    assert exc.requested == 65536 * 65536 * 4
    msg = str(exc)
    assert msg.startswith("CUDA out of memory. Tried to allocate 16.00 GiB.")
    assert "T4-16GB" in msg and "total capacity of 14.58 GiB" in msg
    assert gpu.allocated_bytes == 0 and gpu.memory().ooms == 1


def test_oom_at_the_activation_that_crosses_the_budget() -> None:
    budget = 8 * MiB
    with vramctl.simulate(budget) as gpu:
        model = nn.Linear(512, 512)  # 1 MiB of parameters
        x = torch.randn(1024, 512)  # 2 MiB
        h = model(x)  # 2 MiB: 5 MiB alive
        before = gpu.allocated_bytes
        assert before == live_bytes(model, x, h)
        with pytest.raises(torch.OutOfMemoryError) as err:
            torch.cat([h, h])  # 4 MiB more: 9 MiB > 8 MiB
        assert err.value.requested == 4 * MiB  # type: ignore[attr-defined]
        assert before + 4 * MiB > budget >= before
        gc.collect()
        assert gpu.allocated_bytes == before  # the refused output is not counted


def test_a_full_step_that_does_not_fit_fails_and_a_smaller_batch_then_fits() -> None:
    with vramctl.simulate("16MiB") as gpu:
        model = mlp(256)  # ~2 MiB of parameters
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(batch: int) -> None:
            x = torch.randn(batch, 256)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        with pytest.raises(torch.OutOfMemoryError):
            step(4096)
        gc.collect()
        step(64)  # the failed attempt's tensors were given back
        assert gpu.allocated_bytes == live_bytes(model, opt)


def test_freed_tensors_give_their_bytes_back() -> None:
    with vramctl.simulate("64MiB") as gpu:
        a = torch.zeros(1024, 1024)
        b = torch.ones(512, 1024)
        assert gpu.allocated_bytes == 6 * MiB
        del a
        assert gpu.allocated_bytes == 2 * MiB
        del b
        assert gpu.allocated_bytes == 0
        assert gpu.peak_bytes == 6 * MiB
        gpu.reset_peak()
        assert gpu.peak_bytes == 0


def test_views_and_in_place_ops_do_not_double_count() -> None:
    with vramctl.simulate("64MiB") as gpu:
        a = torch.zeros(1024, 1024)
        views = [a.view(-1), a[10:20], a.t(), a.reshape(2048, 512), a.as_strided((4,), (1,))]
        a.add_(1).mul_(2)
        a[0].fill_(3)
        torch.relu_(a)
        torch.add(a, 1, out=a)
        assert gpu.allocated_bytes == 4 * MiB
        del a
        assert gpu.allocated_bytes == 4 * MiB  # the views keep the storage alive
        del views
        assert gpu.allocated_bytes == 0


def test_resizing_a_storage_counts_the_growth() -> None:
    with vramctl.simulate("64MiB") as gpu:
        a = torch.empty(0)
        a.resize_(1024, 1024)
        assert gpu.allocated_bytes == 4 * MiB
        out = torch.empty(0)
        torch.mul(torch.ones(256, 1024), 2, out=out)
        assert gpu.allocated_bytes == 5 * MiB


def test_tensors_made_outside_are_not_counted_until_adopted() -> None:
    model = nn.Linear(1024, 1024)
    outside = torch.zeros(1024, 1024)
    with vramctl.simulate("64MiB") as gpu:
        outside.add_(1)  # in place on a host tensor: no new device memory
        _ = outside[0]
        assert gpu.allocated_bytes == 0
        assert gpu.adopt(model) is model
        assert gpu.allocated_bytes == live_bytes(model)
        gpu.adopt(model)  # adopting twice counts once
        assert gpu.allocated_bytes == live_bytes(model)
        with pytest.raises(torch.OutOfMemoryError):
            gpu.adopt([torch.zeros(8 * 1024 * 1024) for _ in range(2)])  # 64 MiB more


def test_grads_and_fresh_python_data_are_counted() -> None:
    with vramctl.simulate("64MiB") as gpu:
        w = torch.zeros(1024, 256, requires_grad=True)  # 1 MiB
        (w * 2).sum().backward()
        assert w.grad is not None
        assert gpu.allocated_bytes == 2 * MiB
        t = torch.tensor([1.0] * 1024)  # built from Python data
        assert gpu.allocated_bytes == 2 * MiB + t.untyped_storage().nbytes()


def test_catalog_names_sizes_and_reserve() -> None:
    assert vramctl.simulate("a100-80gb").name == "A100-80GB"
    sim = vramctl.simulate("2GiB", reserve="512MiB")
    assert sim.name == "2GiB" and sim.id == "sim:2GiB"
    mem = sim.memory()
    assert mem.total == 2 * 2**30 and mem.used == 512 * MiB and mem.free == 1536 * MiB
    with sim, pytest.raises(torch.OutOfMemoryError, match="held back as reserve"):
        torch.empty(1600 * MiB, dtype=torch.uint8)


def test_bad_simulate_input() -> None:
    with pytest.raises(UnknownDeviceError, match="T4-16GB"):
        vramctl.simulate("Z9-1GB")
    with pytest.raises(VramctlError, match="12 gigs"):
        vramctl.simulate("12 gigs")
    with pytest.raises(InvalidSizeError, match="cannot be negative"):
        vramctl.simulate("-3GiB")
    with pytest.raises(InvalidSizeError, match="cannot be negative"):
        vramctl.simulate("sim:-3GiB")
    assert vramctl.simulate("sim:2GiB").total_bytes == 2 * 2**30
    with pytest.raises(VramctlError, match="leaves nothing"):
        vramctl.simulate("1GiB", reserve="2GiB")
    sim = vramctl.simulate("1GiB")
    with sim, pytest.raises(VramctlError, match="already active"), sim:
        pass


def test_counting_stops_outside_the_context() -> None:
    sim = vramctl.simulate("64MiB")
    with sim:
        pass
    _ = torch.zeros(1024, 1024)
    assert sim.allocated_bytes == 0


def test_inference_under_no_grad_and_inference_mode() -> None:
    with vramctl.simulate("64MiB") as gpu:
        model = mlp(128)
        params = gpu.allocated_bytes
        with torch.inference_mode():
            out = model(torch.randn(16, 128))
        assert gpu.allocated_bytes == params + out.untyped_storage().nbytes()


def test_views_of_a_large_tensor_are_not_refused_as_new_allocations() -> None:
    # view/expand/as_strided take a size but allocate nothing; nor does matmul's
    # _unsafe_view of its own output, nor resize_ to the size a storage already has.
    with vramctl.simulate("10MiB") as gpu:
        x = torch.zeros(6 * 2**20 // 4)  # 6 MiB of 10
        before = gpu.allocated_bytes
        x.view(2, 3 * 2**18)
        torch.zeros(1).expand(10**8)
        x.as_strided((2**21,), (0,))
        x.resize_(x.numel())
        assert gpu.allocated_bytes == before and gpu.ooms == 0
        del x
        a = torch.zeros(2, 2**19, 1)  # 4 MiB
        c = a @ torch.zeros(1, 1)  # 4 MiB more: 8 of 10
        assert gpu.allocated_bytes == 8 * 2**20 and c.shape == (2, 2**19, 1)


def test_growing_in_place_or_out_is_refused_before_it_runs() -> None:
    with vramctl.simulate("10MiB") as gpu:
        x = torch.zeros(2**18)  # 1 MiB
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 4\.00 GiB"):
            x.resize_(2**30)
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(2**30, out=x)
        assert gpu.allocated_bytes == 2**20
        torch.zeros(2**20, out=x)  # grows to 4 MiB: fits
        assert gpu.allocated_bytes == 4 * 2**20


def test_numpy_memory_is_not_counted_but_a_copy_of_it_is() -> None:
    import numpy as np

    arr = np.ones(10**6)  # 8 MB of host memory numpy allocated, not the simulated device
    with vramctl.simulate("1GiB") as gpu:
        shared = torch.from_numpy(arr)
        also_shared = torch.as_tensor(arr)
        assert gpu.allocated_bytes == 0
        copy = torch.tensor(arr)
        assert gpu.allocated_bytes == copy.nbytes == 8_000_000
        del shared, also_shared


# -- with a caching allocator model ---------------------------------------------------


def test_with_an_allocator_model_reserved_memory_is_its_segments() -> None:
    """Every storage is a request to the model: a small tensor takes a 2 MiB small-pool
    segment, a 12 MiB one a 14 MiB segment (rounded to 2 MiB); a freed block stays cached
    until the cache is given back."""
    from vramctl.estimator import CachingAllocatorModel

    with vramctl.simulate("64MiB", allocator=CachingAllocatorModel()) as gpu:
        x = torch.zeros(1000)
        assert (gpu.memory().allocated, gpu.memory().reserved) == (4000, 2 * MiB)
        y = torch.zeros(3 * MiB + 10)
        assert gpu.memory().reserved == 2 * MiB + 14 * MiB
        del y
        assert gpu.memory().allocated == 4000 and gpu.memory().reserved == 16 * MiB
        gpu.release_cache()
        assert gpu.memory().reserved == 2 * MiB
        assert gpu.memory().used == 2 * MiB
        del x


def test_with_an_allocator_model_the_cache_is_given_back_before_an_oom() -> None:
    """A request that fits only once the cached segments are released succeeds (the
    model's retry, counted), and one that does not fit even then is refused; a refused
    request leaves nothing behind."""
    from vramctl.estimator import CachingAllocatorModel

    model = CachingAllocatorModel()
    with vramctl.simulate("64MiB", allocator=model) as gpu:
        a = torch.zeros(10 * MiB)  # a 40 MiB segment
        del a  # cached
        b = torch.zeros(8 * MiB)  # 32 MiB: fits in the cached 40 MiB segment
        del b
        c = torch.zeros(12 * MiB)  # 48 MiB: not with 40 cached; the cache goes, then it fits
        assert gpu.memory().alloc_retries == 1
        before = (gpu.memory().allocated, gpu.memory().reserved)
        with pytest.raises(torch.OutOfMemoryError, match="reserved in the allocator model"):
            torch.zeros(8 * MiB)  # 32 MiB more than 64 holds
        assert (gpu.memory().allocated, gpu.memory().reserved) == before
        del c


def test_capped_limits_the_allocator_model_and_gives_its_capacity_back() -> None:
    from vramctl.estimator import CachingAllocatorModel

    model = CachingAllocatorModel()
    with vramctl.simulate("64MiB", reserve="8MiB", allocator=model) as gpu:
        assert model.config.capacity == 56 * MiB
        with pytest.raises(RuntimeError, match="boom"), gpu.capped(24 * MiB):
            assert model.config.capacity == 16 * MiB  # the budget less the reserve
            with pytest.raises(torch.OutOfMemoryError):
                torch.zeros(5 * MiB)  # 20 MiB
            raise RuntimeError("boom")
        assert model.config.capacity == 56 * MiB
        x = torch.zeros(5 * MiB)
        del x
