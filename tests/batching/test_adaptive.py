"""AdaptiveBatcher: exactly-once epochs, resume after a kill, sizes that follow free memory."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import vramctl
from vramctl import VramctlError
from vramctl.batching import AdaptiveBatcher, BatchingError

MiB = 2**20


def ids_dataset(n: int) -> TensorDataset:
    """Sample i is (i, a 16-float feature row)."""
    return TensorDataset(torch.arange(n), torch.randn(n, 16))


def drain(batcher: AdaptiveBatcher, limit: int | None = None) -> list[int]:
    """The sample ids of the batches drawn (all of the epoch, or the first ``limit`` batches)."""
    out: list[int] = []
    for count, (ids, _) in enumerate(batcher, 1):
        out.extend(ids.tolist())
        if count == limit:
            break
    return out


# -- exactly once -------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_epoch_yields_every_sample_once_while_sizes_change(shuffle: bool) -> None:
    gpu = vramctl.simulate("64MiB")
    batcher = AdaptiveBatcher(
        ids_dataset(500), device=gpu, target=1.0, per_sample_bytes="1MiB", shuffle=shuffle
    )
    seen: list[int] = []
    hog = None
    for i, (ids, feats) in enumerate(batcher):
        assert len(ids) == len(feats) > 0
        seen.extend(ids.tolist())
        # A co-tenant comes and goes: the sizes change mid-epoch.
        hog = gpu.adopt(torch.empty(40 * MiB, dtype=torch.uint8)) if i % 4 == 1 else None
    del hog
    assert sorted(seen) == list(range(500))
    assert (seen == list(range(500))) is not shuffle
    assert len(set(batcher.sizes)) > 1
    assert sum(batcher.sizes) == 500
    assert batcher.summary()["samples"] == 500


def test_each_iter_is_one_epoch_and_the_shuffled_order_changes_per_epoch() -> None:
    batcher = AdaptiveBatcher(
        ids_dataset(100), budget="10KiB", per_sample_bytes="1KiB", shuffle=True, seed=3
    )
    first, second = drain(batcher), drain(batcher)
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != second
    assert batcher.epoch == 2 and batcher.position == 0
    # The order is rebuilt from (seed, epoch), in any batcher.
    again = AdaptiveBatcher(
        ids_dataset(100), budget="10KiB", per_sample_bytes="1KiB", shuffle=True, seed=3
    )
    assert again.order(0) == first and again.order(1) == second


def test_breaking_off_and_iterating_again_continues_the_epoch() -> None:
    batcher = AdaptiveBatcher(ids_dataset(50), budget=7, per_sample_bytes=1)
    head = drain(batcher, limit=3)
    assert head == list(range(21))
    assert batcher.remaining == 29
    assert drain(batcher) == list(range(21, 50))
    assert batcher.epoch == 1


# -- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_resumed_batcher_yields_each_sample_once_across_both(shuffle: bool) -> None:
    data = ids_dataset(500)
    gpu = vramctl.simulate("64MiB")
    first = AdaptiveBatcher(
        data, device=gpu, target=1.0, per_sample_bytes="1MiB", shuffle=shuffle, seed=11
    )
    seen = drain(first, limit=5)
    state = json.loads(json.dumps(first.state_dict()))  # as saved to disk
    assert state["position"] == len(seen) == 5 * 64
    assert state["epoch"] == 0

    # A new process: another device state, so other batch sizes; the position carries over.
    other = vramctl.simulate("64MiB")
    hog = other.adopt(torch.empty(50 * MiB, dtype=torch.uint8))
    second = AdaptiveBatcher(
        data, device=other, target=1.0, per_sample_bytes="1MiB", shuffle=shuffle, seed=11
    )
    second.load_state_dict(state)
    seen += drain(second)
    del hog
    assert sorted(seen) == list(range(500))
    assert second.sizes == [14] * 12 + [12]  # 180 samples left, 14 MiB of room
    assert second.epoch == 1 and second.position == 0


def test_state_taken_after_the_last_batch_resumes_at_the_next_epoch() -> None:
    data = ids_dataset(40)
    first = AdaptiveBatcher(data, budget=16, per_sample_bytes=1, shuffle=True)
    epoch0 = drain(first)
    second = AdaptiveBatcher(data, budget=16, per_sample_bytes=1, shuffle=True)
    second.load_state_dict(first.state_dict())
    epoch1 = drain(second)
    assert second.epoch == 2
    assert sorted(epoch1) == list(range(40)) and epoch1 == first.order(1) != epoch0


CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch, vramctl
    from torch.utils.data import IterableDataset, TensorDataset
    from vramctl.batching import AdaptiveBatcher

    path, n, hog_mib, kill_at, where = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(
        sys.argv[4]), sys.argv[5]
    gpu = vramctl.simulate("64MiB")
    hog = gpu.adopt(torch.empty(hog_mib * 2**20, dtype=torch.uint8))
    data = TensorDataset(torch.arange(n))
    batcher = AdaptiveBatcher(
        data, device=gpu, target=1.0, per_sample_bytes="1MiB", shuffle=True, seed=7
    )
    done = []
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        done = saved["ids"]
        batcher.load_state_dict(saved["state"])
    for count, (ids,) in enumerate(batcher, 1):
        if where == "before_save" and count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # the batch is drawn, not yet recorded
        done.extend(ids.tolist())
        # The results and the state together, atomically: a kill cannot split them.
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"ids": done, "state": batcher.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if where == "after_save" and count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    print("finished", len(done))
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
@pytest.mark.parametrize("where", ["before_save", "after_save"])
def test_process_killed_midway_and_resumed_processes_each_sample_once(
    tmp_path: Path, where: str
) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    progress = tmp_path / "progress.json"
    n = 200

    def child(hog_mib: int, kill_at: int, mode: str) -> subprocess.CompletedProcess[str]:
        args = [str(progress), str(n), str(hog_mib), str(kill_at), mode]
        return subprocess.run(
            [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
        )

    killed = child(40, 4, where)  # 24 samples a batch
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = json.loads(progress.read_text())
    done_before = 3 * 24 if where == "before_save" else 4 * 24
    assert saved["state"]["position"] == len(saved["ids"]) == done_before

    resumed = child(54, 0, "none")  # less room now: 10 samples a batch
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.split() == ["finished", str(n)]
    ids = json.loads(progress.read_text())["ids"]
    assert len(ids) == n
    assert sorted(ids) == list(range(n))


def test_state_from_another_dataset_or_order_is_refused() -> None:
    batcher = AdaptiveBatcher(ids_dataset(100), budget=8, per_sample_bytes=1, shuffle=True)
    drain(batcher, limit=2)
    state = batcher.state_dict()
    for other in (
        AdaptiveBatcher(ids_dataset(99), budget=8, per_sample_bytes=1, shuffle=True),
        AdaptiveBatcher(ids_dataset(100), budget=8, per_sample_bytes=1, shuffle=False),
        AdaptiveBatcher(ids_dataset(100), budget=8, per_sample_bytes=1, shuffle=True, seed=1),
    ):
        with pytest.raises(BatchingError, match="state"):
            other.load_state_dict(state)
        assert other.position == 0
    bad: list[Any] = [
        {},
        {**state, "version": 99},
        {**state, "position": 101},
        {**state, "position": "3"},
        {**state, "correction": 0},
        [1, 2],
    ]
    for wrong in bad:
        with pytest.raises(BatchingError):
            batcher.load_state_dict(wrong)
    assert batcher.position == 16


def test_an_iterator_from_before_a_reload_stops() -> None:
    batcher = AdaptiveBatcher(ids_dataset(100), budget=8, per_sample_bytes=1)
    it = iter(batcher)
    next(it)
    batcher.load_state_dict(batcher.state_dict())
    with pytest.raises(BatchingError, match="stale"):
        next(it)


# -- sizes ------------------------------------------------------------------------------------


def test_sizes_shrink_at_once_under_pressure_and_grow_back_after_grow_after_draws() -> None:
    gpu = vramctl.simulate("64MiB")
    batcher = AdaptiveBatcher(
        ids_dataset(1000), device=gpu, target=0.75, per_sample_bytes="1MiB", grow_after=2
    )
    it = iter(batcher)
    sizes = [len(next(it)[0])]  # room: 48 MiB
    hog = gpu.adopt(torch.empty(32 * MiB, dtype=torch.uint8))  # a co-tenant takes 32 MiB
    sizes.append(len(next(it)[0]))
    assert batcher.last_room == 16 * MiB
    del hog  # and gives it back
    sizes += [len(next(it)[0]) for _ in range(5)]
    # Shrink at once; hold for grow_after draws; grow by at most 2x; hold again; back to 48.
    assert sizes == [48, 16, 16, 32, 32, 48, 48]
    summary = batcher.summary()
    assert (summary["shrinks"], summary["grows"], summary["starved"]) == (1, 2, 0)
    assert batcher.sizes == sizes


def test_budget_alone_and_budget_with_a_device_take_the_smaller_room() -> None:
    data = ids_dataset(100)
    assert AdaptiveBatcher(data, budget="2KiB", per_sample_bytes=100).room() == 2048
    gpu = vramctl.simulate("1MiB")
    both = AdaptiveBatcher(data, device=gpu, budget="1GiB", target=0.5, per_sample_bytes=1024)
    assert both.room() == 512 * 1024
    assert drain(both, limit=1) == list(range(100))  # clamped by the samples left
    held = AdaptiveBatcher(data, budget=1000, reserve=400, per_sample_bytes=100)
    assert held.room() == 600 and held.sizes == []
    assert [len(ids) for ids, _ in held] == [6] * 16 + [4]


def test_tiny_per_sample_cost_is_clamped_by_max_batch() -> None:
    gpu = vramctl.simulate("T4-16GB")
    batcher = AdaptiveBatcher(ids_dataset(100), device=gpu, per_sample_bytes=1, max_batch=32)
    assert [len(ids) for ids, _ in batcher] == [32, 32, 32, 4]


def test_min_batch_is_yielded_when_nothing_fits_and_recorded() -> None:
    gpu = vramctl.simulate("64MiB")
    hog = gpu.adopt(torch.empty(63 * MiB, dtype=torch.uint8))
    batcher = AdaptiveBatcher(
        ids_dataset(10), device=gpu, target=0.9, per_sample_bytes="1MiB", min_batch=3
    )
    assert [len(ids) for ids, _ in batcher] == [3, 3, 3, 1]  # never 0; the tail is what is left
    assert batcher.summary()["starved"] == 4
    assert batcher.last_room == 0
    del hog


def test_drop_last_skips_a_tail_shorter_than_min_batch() -> None:
    batcher = AdaptiveBatcher(
        ids_dataset(10), budget=3, per_sample_bytes=1, min_batch=3, drop_last=True
    )
    assert [len(ids) for ids, _ in batcher] == [3, 3, 3]
    assert batcher.epoch == 1 and batcher.position == 0


def test_notify_oom_halves_the_size_then_recovers_slowly() -> None:
    batcher = AdaptiveBatcher(ids_dataset(10_000), budget=100, per_sample_bytes=1, grow_after=1)
    it = iter(batcher)
    assert len(next(it)[0]) == 100
    batcher.notify_oom()
    assert batcher.correction == 0.5
    sizes = [len(next(it)[0]) for _ in range(12)]
    assert sizes[0] == 50  # halved at once
    assert sizes == sorted(sizes) and sizes[-1] == 100  # back over later draws, never flapping
    assert batcher.correction == 1.0
    assert batcher.summary()["ooms"] == 1
    batcher.notify_oom(batch_size=9)  # the guard reports a failed batch of 9: 4 next
    assert batcher.correction == 0.5
    assert len(next(it)[0]) == 8  # grow_after=1: grown back at once, by at most 2x


# -- the estimator's per-sample cost, in a real training loop -----------------------------


def test_estimated_cost_keeps_real_training_steps_under_the_target() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2000, 256), torch.randint(0, 10, (2000,)))
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    gpu = vramctl.simulate("T4-16GB")
    batcher = AdaptiveBatcher(
        data,
        device=gpu,
        model=model,
        model_input=lambda batch: batch[0],
        max_batch=512,
        grow_after=1,
    )
    assert batcher.per_sample_bytes >= 256 * 4  # at least the sample's own input
    assert batcher.overhead_bytes > 0  # gradients and temporaries of a step
    limit = int(0.9 * gpu.total_bytes)
    gpu.adopt(model)
    opt = torch.optim.AdamW(model.parameters())
    with gpu:
        for x, y in batcher:
            gpu.reset_peak()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            assert gpu.peak_bytes <= limit
            if len(batcher.sizes) == 1:  # a co-tenant leaves about 150 samples' room
                spare = batcher.room() - 150 * batcher.per_sample_bytes
                hog = gpu.adopt(torch.empty(spare, dtype=torch.uint8))
            if len(batcher.sizes) == 3:
                del hog
    assert batcher.sizes[0] == 512
    assert batcher.sizes[1] < 200 and batcher.sizes[2] < 200
    assert batcher.sizes[3] > batcher.sizes[2] and 512 in batcher.sizes[3:]
    assert sum(batcher.sizes) == 2000


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"per_sample_bytes": 10},  # no device, no budget
        {"budget": 10},  # no per-sample cost, no model
        {"budget": 10, "per_sample_bytes": 0},
        {"budget": "12 gigs", "per_sample_bytes": 1},
        {"budget": 10, "per_sample_bytes": -1},
        {"budget": 10, "per_sample_bytes": 1, "target": 0},
        {"budget": 10, "per_sample_bytes": 1, "target": 1.5},
        {"budget": 10, "per_sample_bytes": 1, "min_batch": 0},
        {"budget": 10, "per_sample_bytes": 1, "min_batch": 4, "max_batch": 2},
        {"budget": 10, "per_sample_bytes": 1, "grow_after": 0},
        {"budget": 10, "per_sample_bytes": 1, "grow_factor": 1.0},
        {"budget": 10, "per_sample_bytes": 1, "model": nn.Linear(16, 1)},
        {"device": "no-such-gpu", "per_sample_bytes": 1},
    ],
)
def test_bad_input_raises_batching_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(BatchingError):
        AdaptiveBatcher(ids_dataset(10), **kwargs)


def test_batching_error_is_a_vramctl_error_and_names_the_problem() -> None:
    assert issubclass(BatchingError, VramctlError)
    with pytest.raises(BatchingError, match="map-style"):
        AdaptiveBatcher(iter(range(3)), budget=1, per_sample_bytes=1)  # type: ignore[arg-type]

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

        def __len__(self) -> int:
            return 3

    with pytest.raises(BatchingError, match="map-style"):
        AdaptiveBatcher(Stream(), budget=1, per_sample_bytes=1)
    with pytest.raises(BatchingError, match="empty"):
        AdaptiveBatcher(ids_dataset(0), budget=1, model=nn.Linear(16, 1))
    with pytest.raises(BatchingError, match="estimator"):
        AdaptiveBatcher(ids_dataset(5), budget=1, model=nn.Linear(3, 1))  # wrong input width


def test_empty_dataset_yields_nothing() -> None:
    batcher = AdaptiveBatcher(ids_dataset(0), budget=1, per_sample_bytes=1)
    assert list(batcher) == []
    assert batcher.summary()["batches"] == 0


def test_a_guard_event_makes_the_next_batches_smaller() -> None:
    from vramctl.guard import GuardEvent

    data = TensorDataset(torch.arange(64))
    batcher = AdaptiveBatcher(data, budget="16KiB", per_sample_bytes=1024)
    it = iter(batcher)
    first = len(next(it)[0])
    batcher.on_guard_event(GuardEvent("grow", 0, first, 1, None))
    batcher.on_guard_event(GuardEvent("oom", 0, first, 2, first // 2))
    assert len(next(it)[0]) < first


def test_estimate_options_as_a_step_or_a_mapping_give_the_same_cost() -> None:
    torch.manual_seed(0)
    # Samples of 64 tokens and a 4096-wide layer: a sample's activations (MiBs) dwarf the
    # allocator's rounding, which can flatten the cost of a few KiB a sample to nothing.
    data = TensorDataset(torch.randn(64, 64, 1024), torch.randint(0, 10, (64,)))
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10))
    gpu = vramctl.simulate("T4-16GB")

    def cost(options: Any) -> int:
        batcher = AdaptiveBatcher(
            data,
            device=gpu,
            model=model,
            model_input=lambda batch: batch[0],
            max_batch=16,
            estimate_options=options,
        )
        return batcher.per_sample_bytes

    as_mapping = cost({"precision": "bf16"})
    assert as_mapping == cost(vramctl.Step(precision="bf16"))
    assert as_mapping < cost(None)  # bf16 activations: half the fp32 default's
