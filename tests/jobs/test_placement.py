"""Placement policies, cluster state, the fragmentation measure and the ledger."""

from __future__ import annotations

import random

import pytest
import torch

from vramctl.jobs import (
    AdmissionError,
    BestFit,
    ClusterState,
    Fragmentation,
    LeastLoaded,
    Ledger,
    MostFree,
    Placement,
    Policy,
    Request,
    Workload,
)

POLICIES = [BestFit(), MostFree(), LeastLoaded(), Fragmentation()]


def test_every_policy_is_a_policy() -> None:
    for p in POLICIES:
        assert isinstance(p, Policy)


def test_state_layout() -> None:
    s = ClusterState([2, 0, 3], [1000, 500, 800])
    assert s.num_nodes == 3 and s.num_gpus == 5
    assert s.gpu_node.tolist() == [0, 0, 2, 2, 2]
    assert s.capacity.tolist() == [1000, 1000, 800, 800, 800]
    assert s.slots.tolist() == [[0, 1, -1], [-1, -1, -1], [2, 3, 4]]


def test_single_gpu_choices() -> None:
    s = ClusterState([2, 1], 1000)
    s.allocate(Request(600), Placement(0, (0,)))
    r = Request(300)
    assert BestFit().choose(s, r) == Placement(0, (0,))  # 100 left, the tightest
    assert MostFree().choose(s, r) == Placement(0, (1,))  # 700 left, lowest index
    assert LeastLoaded().choose(s, r) == Placement(0, (1,))  # no job there
    # 400 is no longer enough; of the two whole GPUs, the one on the node left with less
    assert BestFit().choose(s, Request(500)) == Placement(1, (2,))


def test_least_loaded_counts_jobs_not_memory() -> None:
    s = ClusterState([1, 1], 1000)
    for _ in range(3):
        s.allocate(Request(10), Placement(0, (0,)))
    s.allocate(Request(800), Placement(1, (1,)))
    assert LeastLoaded().choose(s, Request(100)) == Placement(1, (1,))
    assert MostFree().choose(s, Request(100)) == Placement(0, (0,))


def test_multi_gpu_choices() -> None:
    s = ClusterState([4, 2], 1000)
    r = Request(1000, gpus=2)
    assert BestFit().choose(s, r) == Placement(1, (4, 5))  # leaves the 4-GPU node whole
    assert MostFree().choose(s, r) == Placement(0, (0, 1))
    s.allocate(Request(200), Placement(0, (1,)))
    got = BestFit().choose(s, Request(500, gpus=3))
    assert got is not None and got.node == 0 and sorted(got.gpus) == [0, 1, 2]
    assert BestFit().choose(s, Request(900, gpus=4)) is None  # GPU 1 has 800 left


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
def test_constraints(policy: Policy) -> None:
    s = ClusterState(
        [2, 2, 2],
        1000,
        node_cpu=[1, 8, 8],
        node_memory=[64, 64, 4],
        node_model=["T4", "V100", "V100"],
    )
    assert policy.choose(s, Request(100, cpu=4)) in {
        Placement(1, (2,)),
        Placement(1, (3,)),
        Placement(2, (4,)),
        Placement(2, (5,)),
    }
    got = policy.choose(s, Request(100, cpu=4, memory=32))
    assert got is not None and got.node == 1
    got = policy.choose(s, Request(100, model="T4"))
    assert got is not None and got.node == 0
    assert policy.choose(s, Request(100, model="A100")) is None
    assert policy.choose(s, Request(100, gpus=3)) is None
    assert policy.choose(s, Request(1001)) is None
    got = policy.choose(s, Request(0, gpus=0, cpu=8, memory=8))
    assert got is not None and got.node == 1 and got.gpus == ()


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
def test_max_jobs_per_gpu(policy: Policy) -> None:
    s = ClusterState([1, 1], 1000, max_jobs_per_gpu=1)
    s.allocate(Request(100), Placement(0, (0,)))
    assert policy.choose(s, Request(100)) == Placement(1, (1,))
    s.allocate(Request(100), Placement(1, (1,)))
    assert policy.choose(s, Request(1)) is None


def test_allocate_release_round_trip_and_checks() -> None:
    s = ClusterState([2], 1000, node_cpu=[8], node_memory=[16])
    r = Request(250, gpus=2, cpu=3, memory=5)
    s.allocate(r, Placement(0, (0, 1)))
    assert s.free.tolist() == [750, 750] and s.jobs.tolist() == [1, 1]
    assert s.cpu_free.tolist() == [5] and s.memory_free.tolist() == [11]
    assert s.allocated_share() == pytest.approx(0.25)
    s.release(r, Placement(0, (0, 1)))
    assert s.free.tolist() == [1000, 1000] and s.jobs.tolist() == [0, 0]
    with pytest.raises(ValueError):
        s.allocate(r, Placement(0, (0,)))
    with pytest.raises(ValueError):
        ClusterState([1, 1], [1000])
    with pytest.raises(ValueError):
        Request(-1)


def test_fragmentation_by_hand() -> None:
    # Half the mix asks for 500 of one GPU, half for a whole GPU (1000).
    w = Workload({Request(500): 1, Request(1000): 1})
    free = torch.tensor([[600.0, 300.0], [1000.0, -1.0], [200.0, 200.0]])
    # node 0: a 500 job fits (on the 600), the 300 is a fragment for it; a 1000 job does
    #   not fit, so all 900 are: 0.5 * 300 + 0.5 * 900 = 600
    # node 1: both fit, nothing is a fragment
    # node 2: neither fits: 400
    assert w.fragmentation(free).tolist() == [600.0, 0.0, 400.0]


def test_fragmentation_counts_cpu_and_gpu_count() -> None:
    w = Workload({Request(500, cpu=4): 3, Request(1000, gpus=2): 1, Request(0, gpus=0): 5})
    free = torch.tensor([[1000.0, 1000.0], [1000.0, 400.0]])
    # node 0 with CPU 2: the 500 job (3/4 of the mix) lacks CPU: 3/4 * 2000 = 1500; the
    # two-GPU job fits: 0. Node 1 with CPU 8: the 500 job fits, its fragment is the 400:
    # 3/4 * 400 = 300; the two-GPU job does not fit: 1/4 * 1400 = 350.
    got = w.fragmentation(free, torch.tensor([2.0, 8.0]))
    assert got.tolist() == pytest.approx([1500.0, 650.0])
    with pytest.raises(ValueError):
        Workload({Request(0, gpus=0): 1})


def test_workload_keeps_the_popular_kinds() -> None:
    kinds = {Request(500, cpu=4): 50, Request(1000): 30, Request(250, cpu=2): 15, Request(100): 5}
    w = Workload(kinds, popular=0.8)  # 50 + 30 reach 80%
    assert set(w.kinds) == {Request(500, cpu=4), Request(1000)}
    assert sorted(w.need.tolist()) == [500.0, 1000.0]
    free = torch.tensor([[600.0, 100.0]])
    # renormalised over the two kept: 5/8 * 100 (the 500 job's fragment) + 3/8 * 700
    assert w.fragmentation(free).tolist() == pytest.approx([5 / 8 * 100 + 3 / 8 * 700])
    assert set(Workload(kinds, popular=0.81).kinds) == set(kinds) - {Request(100)}
    assert set(Workload(kinds).kinds) == set(kinds)
    # kinds are counted by their shape (GPU count, need, CPU, model), memory aside
    many = [Request(500, memory=m) for m in (1, 2, 3)] + [Request(1000)] * 2
    assert set(Workload.from_requests(many, popular=0.5).kinds) == set(many[:3])
    with pytest.raises(ValueError):
        Workload(kinds, popular=0)


def test_workload_jobs_with_no_gpu_find_every_gpu_fragmented() -> None:
    kinds = {Request(500): 3, Request(0, gpus=0, cpu=4): 1}
    free = torch.tensor([[1000.0, 300.0]])
    # without them: the 500 job fits, the 300 is its fragment
    assert Workload(kinds).fragmentation(free).tolist() == [300.0]
    # with them: 3/4 * 300 + 1/4 * 1300
    got = Workload(kinds, no_gpu=True).fragmentation(free)
    assert got.tolist() == pytest.approx([3 / 4 * 300 + 1 / 4 * 1300])
    # they count in the popularity too: the 500 job alone is 75%
    assert set(Workload(kinds, popular=0.75, no_gpu=True).kinds) == {Request(500)}


def test_workload_kind_of_another_model_finds_the_node_fragmented() -> None:
    w = Workload({Request(500, model="A100"): 1, Request(500): 1})
    free = torch.tensor([[1000.0], [1000.0], [1000.0]])
    # node 0 is an A100: both kinds fit; node 1 a T4: the A100 kind finds all 1000
    # fragmented; node 2 names no model: the same
    got = w.fragmentation(free, models=["A100", "T4", None])
    assert got.tolist() == [0.0, 500.0, 500.0]
    assert w.fragmentation(free).tolist() == [0.0, 0.0, 0.0]  # models not given
    assert w.model_aware and not Workload({Request(500): 1}).model_aware


def test_fragmentation_policy_keeps_a_model_for_the_kinds_that_ask_for_it() -> None:
    s = ClusterState([1, 1], 1000, node_model=["A100", "T4"])
    r = Request(500)
    # the mix's jobs all ask for an A100: a job that can run anywhere goes to the T4
    frag = Fragmentation(Workload({Request(1000, model="A100"): 1}))
    assert frag.choose(s, r) == Placement(1, (1,))
    got = frag.delta(s, r)
    assert got is not None and got[1].tolist() == [500.0, -500.0]
    # without the model in the mix, the two are alike: the lowest index
    assert Fragmentation(Workload({Request(1000): 1})).choose(s, r) == Placement(0, (0,))


def test_row_ids_group_equal_rows_even_when_hashes_collide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vramctl.jobs import _placement

    rng = random.Random(2)
    rows = torch.tensor(
        [[float(rng.choice([0, 250, 500, 1000])) for _ in range(3)] for _ in range(200)],
        dtype=torch.float64,
    )

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool((a[:, None] == a[None, :]).eq(b[:, None] == b[None, :]).all())

    assert same(_placement._row_ids(rows), _placement._row_ids_exact(rows))
    monkeypatch.setattr(_placement, "_HASH", torch.zeros(64, dtype=torch.int64))
    assert same(_placement._row_ids(rows), _placement._row_ids_exact(rows))


def test_fragmentation_policy_avoids_stranding() -> None:
    s = ClusterState([1, 1], 1000)
    s.allocate(Request(400), Placement(0, (0,)))
    r = Request(200)
    # best fit takes the 600 GPU, leaving 400: too little for the mix's 500 jobs
    assert BestFit().choose(s, r) == Placement(0, (0,))
    # FGD keeps it able to host them and uses the whole GPU, which stays able too
    frag = Fragmentation(Workload.from_requests([Request(500)] * 3))
    assert frag.choose(s, r) == Placement(1, (1,))
    got = frag.delta(s, r)
    assert got is not None
    cands, grow = got
    assert cands.node.tolist() == [0, 1] and grow.tolist() == [400.0, 0.0]


def test_fragmentation_learns_the_mix() -> None:
    frag = Fragmentation()
    s = ClusterState([1, 1], 1000)
    s.allocate(Request(400), Placement(0, (0,)))
    for _ in range(5):
        frag.observe(Request(500))
    assert frag.choose(s, Request(200)) == Placement(1, (1,))
    assert frag.workload is not None and Request(200) in frag.workload.kinds


def test_ledger_margin_and_outside_use() -> None:
    ledger = Ledger([1000, 1000], margin=0.1, min_margin=20)
    assert ledger.margin_for(100) == 20 and ledger.margin_for(500) == 50
    a = ledger.reserve("a", 0, 500)
    assert a.total == 550 and ledger.reserved(0) == 550 and ledger.available(0) == 450
    # Someone outside vramctl took memory: the device reports 600 free; job a has not
    # allocated yet, so 550 of it is already promised.
    assert ledger.available(0, reported_free=600) == 50
    ledger.mark_used("a", 500)  # a holds 500 now; the device's 600 free already leaves it out
    assert ledger.available(0, reported_free=600) == 450
    with pytest.raises(AdmissionError):
        ledger.reserve("b", 0, 500, reported_free=600)
    with pytest.raises(AdmissionError):
        ledger.reserve("a", 1, 10)
    assert ledger.release("a") == a and ledger.available(0) == 1000
    with pytest.raises(KeyError):
        ledger.release("a")


def test_ledger_max_concurrent_jobs_and_place() -> None:
    ledger = Ledger([1000, 2000], margin=0.0, max_concurrent_jobs=2)
    got = ledger.place("a", 700, BestFit())
    assert got is not None and got.device == 0
    got = ledger.place("b", 700, BestFit())
    assert got is not None and got.device == 1  # 300 left on device 0
    got = ledger.place("c", 100, MostFree())
    assert got is not None and got.device == 1
    assert ledger.jobs(1) == 2
    assert ledger.place("d", 100, LeastLoaded()) is not None  # device 0: one job
    assert ledger.place("e", 1, LeastLoaded()) is None  # both devices hold two jobs
    assert ledger.place("f", 50, BestFit(), reported_free=[0, 0]) is None


def test_ledger_never_over_commits() -> None:
    rng = random.Random(0)
    cap = [1000, 3000, 500]
    ledger = Ledger(cap, margin=0.05, max_concurrent_jobs=3)
    live: list[str] = []
    placed = 0
    for i in range(2000):
        if live and rng.random() < 0.4:
            ledger.release(live.pop(rng.randrange(len(live))))
            continue
        # memory taken outside vramctl, on top of what the jobs already hold
        reported = [c - rng.randrange(0, c // 2) - ledger.reserved(d) for d, c in enumerate(cap)]
        before = [ledger.reserved(d) for d in range(len(cap))]
        got = ledger.place(f"j{i}", rng.randrange(1, 600), rng.choice(POLICIES), reported)
        if got is not None:
            live.append(got.job)
            placed += 1
            # the new reservation fits in what the device reported free, less what the
            # jobs already admitted there may still allocate (all of it: none marked used)
            assert got.total <= reported[got.device] - before[got.device]
        for d, c in enumerate(cap):
            assert ledger.reserved(d) <= c
            assert ledger.jobs(d) <= 3
    assert placed > 100


@pytest.mark.parametrize("policy", [BestFit(), MostFree(), LeastLoaded()])
def test_pick_on_plain_numbers_is_the_tensor_rule(policy: BestFit) -> None:
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randrange(1, 6)
        cap = rng.choice([None, 1, 2])
        state = ClusterState([1] * n, [1000.0] * n, max_jobs_per_gpu=cap)
        free = [float(rng.choice([0, 100, 250, 400, 400, 1000])) for _ in range(n)]
        jobs = [rng.randrange(0, 3) for _ in range(n)]
        state.free = torch.tensor(free, dtype=torch.float64)
        state.jobs = torch.tensor(jobs, dtype=torch.int64)
        asked = float(rng.choice([50, 100, 300, 400, 900]))
        got = policy.choose(state, Request(asked))
        assert policy.pick(free, jobs, asked, cap) == (None if got is None else got.gpus[0])


def test_ledger_places_a_need_priced_per_device() -> None:
    ledger = Ledger([1000, 1000, 1000], margin=0.0)
    ledger.reserve("x", 1, 100)
    # The job needs 700 on device 0, 850 on device 1 and cannot go on device 2: best fit
    # compares what each device has left after the job's own need there.
    got = ledger.place("a", {0: 700, 1: 850}, BestFit())
    assert got is not None and (got.device, got.total) == (1, 850)  # 50 left, not 300
    assert ledger.place("b", {2: 2000}, BestFit()) is None
    assert ledger.place("c", {}, BestFit()) is None
    frag = ledger.place("d", {0: 200, 2: 900}, Fragmentation())
    assert frag is not None and frag.device in (0, 2)


def test_ledger_restores_what_a_store_recorded() -> None:
    ledger = Ledger([1000], margin=0.1, max_concurrent_jobs=2)
    # Admitted earlier on a device that has less room now: held all the same, no check.
    held = ledger.restore("old", 0, 1200, used=300)
    assert held.total == 1200 and ledger.reserved(0) == 1200 and ledger.jobs(0) == 1
    assert ledger.available(0) == 0 and ledger.outstanding(0) == 900
    assert ledger.largest() == 0
    ledger.release("old")
    assert ledger.largest() == 1000 and ledger.outstanding(0) == 0
    with pytest.raises(AdmissionError):
        ledger.restore("x", 3, 10)


def test_fragmentation_gives_a_tie_to_the_first_node_or_to_the_tightest_fit() -> None:
    """Two placements whose fragmentation grows alike: by default the GPU left with the
    least takes the job; with ``ties="order"`` the first node in the cluster's order does
    (a fixed priority, as FGD's simulator breaks ties)."""
    s = ClusterState([1, 1], 1000)
    s.allocate(Request(300), Placement(1, (1,)))
    mix = Workload({Request(100): 1})  # every free GPU can host the mix: no growth
    r = Request(100)
    assert Fragmentation(mix).choose(s, r) == Placement(1, (1,))
    assert Fragmentation(mix, ties="order").choose(s, r) == Placement(0, (0,))
    with pytest.raises(ValueError, match="ties"):
        Fragmentation(mix, ties="random")
