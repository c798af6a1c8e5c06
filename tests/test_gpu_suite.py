"""The GPU suite's plan, on the CPU: its order, its budgets, what a rerun reuses.

``benchmarks/gpu_suite.py`` runs on a GPU machine lent for a few minutes, so its plan is
checked here: capture first, the quick plan within one call of 540 s, steps that no longer
fit recorded as skipped, and steps that passed before on the same GPU and commit not run
again. The steps themselves are stand-ins (``python -c``); no GPU is used.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_suite
from gpu_suite import Decision, Step

BENCH = gpu_suite.BENCH

GPU = "NVIDIA H200"
COMMIT = "0123abcd"


def quick_steps(tmp_path: Path) -> list[Step]:
    return gpu_suite.choose(gpu_suite.steps(tmp_path), quick=True, only=None)


def actions(decisions: list[Decision]) -> dict[str, str]:
    return {d.name: d.action for d in decisions}


def row(
    exit: int = 0, gpu: str | None = GPU, commit: str | None = COMMIT, quick: bool = True
) -> dict[str, Any]:
    return {"exit": exit, "wall_s": 1.0, "gpu": gpu, "commit": commit, "quick": quick}


# -- the plan --------------------------------------------------------------------------------


def test_quick_plan_runs_capture_first_and_fits_one_call(tmp_path: Path) -> None:
    decisions = gpu_suite.plan(quick_steps(tmp_path), True, 540, None, GPU, COMMIT)
    assert [d.name for d in decisions] == list(gpu_suite.QUICK_PLAN)
    assert decisions[0].name == "capture"
    assert all(d.action == "run" for d in decisions)
    assert sum(d.budget_s for d in decisions) <= 540
    assert gpu_suite.CALL_S == 540


def test_full_tests_step_is_not_in_the_quick_plan(tmp_path: Path) -> None:
    names = [s.name for s in quick_steps(tmp_path)]
    assert "tests" not in names
    assert names == ["capture", "cuda-tests", "calibrate", "fit_search", "oom_chaos"]
    # What the CPU can do with what comes back is not run on the GPU's minutes.
    assert "truth-check" not in names and "estimate_accuracy" not in names
    full = gpu_suite.choose(gpu_suite.steps(tmp_path), quick=False, only=None)
    assert [s.name for s in full][:3] == ["capture", "truth-check", "tests"]
    assert "cuda-tests" not in [s.name for s in full]


def test_capture_takes_what_the_later_steps_leave(tmp_path: Path) -> None:
    chosen = quick_steps(tmp_path)
    later = sum(s.budget_s(True) for s in chosen[1:])

    def capture(budget: float) -> Decision:
        return gpu_suite.plan(chosen, True, budget, None, GPU, COMMIT)[0]

    assert capture(540).budget_s == min(240, 540 - later)
    assert capture(520).budget_s == 520 - later
    assert capture(2000).budget_s == 240  # its own budget at most
    assert capture(300).budget_s == 120  # its floor, and the later steps no longer all fit
    # No total: its own budget.
    assert gpu_suite.plan(chosen, True, None, None, GPU, COMMIT)[0].budget_s == 240


def test_a_step_that_no_longer_fits_is_skipped_not_dropped() -> None:
    chosen = [
        Step("a", (), (10, 10)),
        Step("b", (), (50, 50)),
        Step("c", (), (20, 20)),
        Step("d", (), (15, 15)),
    ]
    decisions = gpu_suite.plan(chosen, False, 40, None, GPU, COMMIT)
    assert [(d.name, d.action) for d in decisions] == [
        ("a", "run"),
        ("b", "skip"),
        ("c", "run"),
        ("d", "skip"),
    ]
    assert decisions[1].reason == "no time"
    assert decisions[1].budget_s == 50
    # The full budgets are used without --quick, the quick ones with it.
    assert gpu_suite.plan([Step("x", (), (90, 9))], True, 10, None, None, None)[0].action == "run"
    assert gpu_suite.plan([Step("x", (), (90, 9))], False, 10, None, None, None)[0].action == "skip"


def test_the_capture_command_gets_its_budget_less_a_margin(tmp_path: Path) -> None:
    capture = gpu_suite.steps(tmp_path)[0]
    argv = gpu_suite.command(capture, True, 145, tmp_path)
    assert argv[1:] == [
        str(BENCH / "cuda_truth.py"),
        "capture",
        "--out",
        str(tmp_path / "cuda_truth"),
        "--budget",
        str(145 - gpu_suite.CAPTURE_MARGIN_S),
    ]


# -- what a rerun reuses ----------------------------------------------------------------------


def seven_steps(tmp_path: Path) -> list[Step]:
    names = "capture,truth-check,cuda-tests,calibrate,estimate_accuracy,fit_search,oom_chaos"
    return gpu_suite.choose(gpu_suite.steps(tmp_path), True, names.split(","))


def test_a_step_that_passed_on_this_gpu_and_commit_is_reused(tmp_path: Path) -> None:
    chosen = seven_steps(tmp_path)
    previous: dict[str, Any] = {
        "steps": {
            "capture": row(),
            "truth-check": row(),
            "cuda-tests": row(exit=1),
            "calibrate": row(commit="fedc9876"),
            "estimate_accuracy": row(gpu="NVIDIA H100 80GB HBM3"),
            "fit_search": row(),
            "oom_chaos": {"exit": 0, "wall_s": 60.5},  # a row from before rows said their GPU
        }
    }
    got = actions(gpu_suite.plan(chosen, True, 540, previous, GPU, COMMIT))
    assert got == {
        "capture": "reuse",
        "truth-check": "reuse",
        "cuda-tests": "run",
        "calibrate": "run",
        "estimate_accuracy": "run",
        "fit_search": "reuse",
        "oom_chaos": "run",
    }
    forced = gpu_suite.plan(chosen, True, 540, previous, GPU, COMMIT, force=True)
    assert {d.action for d in forced} == {"run"}


def test_a_check_of_a_new_capture_runs_again(tmp_path: Path) -> None:
    chosen = seven_steps(tmp_path)
    previous = {"steps": {"capture": row(exit=124), "truth-check": row()}}
    got = actions(gpu_suite.plan(chosen, True, 540, previous, GPU, COMMIT))
    assert got["capture"] == "run"
    assert got["truth-check"] == "run"
    # Asked for alone, the check of the corpus already there stands.
    alone = [s for s in chosen if s.name == "truth-check"]
    assert actions(gpu_suite.plan(alone, True, 540, previous, GPU, COMMIT)) == {
        "truth-check": "reuse"
    }


def test_a_full_run_does_not_reuse_a_quick_row(tmp_path: Path) -> None:
    chosen = [s for s in gpu_suite.steps(tmp_path) if s.name == "fit_search"]
    quick_row = {"steps": {"fit_search": row(quick=True)}}
    full_row = {"steps": {"fit_search": row(quick=False)}}
    assert gpu_suite.plan(chosen, False, None, quick_row, GPU, COMMIT)[0].action == "run"
    assert gpu_suite.plan(chosen, False, None, full_row, GPU, COMMIT)[0].action == "reuse"
    assert gpu_suite.plan(chosen, True, 540, full_row, GPU, COMMIT)[0].action == "reuse"


def test_reused_steps_leave_their_time_to_capture(tmp_path: Path) -> None:
    chosen = quick_steps(tmp_path)
    previous = {"steps": {n: row() for n in gpu_suite.QUICK_PLAN if n != "capture"}}
    decisions = gpu_suite.plan(chosen, True, 540, previous, GPU, COMMIT)
    assert decisions[0] == Decision("capture", "run", 240)


# -- the command line ----------------------------------------------------------------------


def test_list_prints_the_plan_in_order_without_torch() -> None:
    t0 = time.monotonic()
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import gpu_suite; "
        "rc = gpu_suite.main(['--list', '--quick']); "
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported'); "
        "sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(BENCH)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 10
    lines = done.stdout.splitlines()
    assert lines[-1] == "torch not imported"
    listed = [ln.split()[0] for ln in lines[1 : 1 + len(gpu_suite.QUICK_PLAN)]]
    assert listed == list(gpu_suite.QUICK_PLAN)
    total = next(ln for ln in lines if ln.startswith("total "))
    assert int(total.split()[1]) <= 540
    assert "does not fit" not in total and "fits in the 540 s" in total
    assert not any(ln.startswith("skipped") for ln in lines)
    assert any(ln.startswith("other steps") and "tests" in ln for ln in lines)


def test_list_runs_as_a_script() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_suite.py"), "--list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].split()[0] == "capture"
    assert "does not fit in the 540 s of one call" in done.stdout  # the full plan


def test_without_a_gpu_one_line_and_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_suite, "gpu_facts", lambda env: {"torch": "2.11.0", "driver": None})
    out = tmp_path / "r"
    assert gpu_suite.main(["--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no usable CUDA device" in err
    assert not out.exists()


# -- a whole run, with stand-in steps ----------------------------------------------------------

#: Writes a corpus index where it is told to, and prints its arguments as its figures.
CAPTURE = (
    "import json, pathlib, sys; p = pathlib.Path(sys.argv[2]); "
    "p.mkdir(parents=True, exist_ok=True); (p / 'index.json').write_text('{}'); "
    "print(json.dumps({'argv': sys.argv[1:]}))"
)


#: Fails unless the corpus is unpacked where it is told to look.
CHECK = (
    "import pathlib, sys; assert (pathlib.Path(sys.argv[1]) / 'index.json').is_file(); "
    "print('{\"ok\": true}')"
)


def stand_ins(out: Path) -> list[Step]:
    py = sys.executable
    return [
        Step(
            "capture",
            (py, "-c", CAPTURE, "capture", str(out / "cuda_truth")),
            (60, 60),
            quick=(),
            shrinks_to=30,
        ),
        Step("truth-check", (py, "-c", CHECK, str(out / "cuda_truth")), (10, 10), checks="capture"),
        Step("fails", (py, "-c", "raise SystemExit(1)"), (10, 10)),
        Step("slow", (py, "-c", "pass"), (1000, 1000)),
        Step("late", (py, "-c", "pass"), (10, 10)),
    ]


def test_a_run_and_its_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_suite, "steps", stand_ins)
    monkeypatch.setattr(gpu_suite, "gpu_facts", lambda env: {"gpu": GPU, "driver": "580"})
    monkeypatch.setattr(gpu_suite, "git_commit", lambda: COMMIT)
    out = tmp_path / "r"
    argv = ["--out", str(out), "--only", "capture,truth-check,fails,slow,late", "--budget", "200"]

    assert gpu_suite.main(argv) == 1  # "fails" failed
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["steps"]
    assert list(rows) == ["capture", "truth-check", "fails", "slow", "late"]
    for name in ("capture", "truth-check", "fails", "late"):
        assert rows[name]["gpu"] == GPU and rows[name]["commit"] == COMMIT
        assert rows[name]["started"][:2] == "20" and "T" in rows[name]["started"]
    # capture shrank to its floor: the later steps ask for more than the 200 s
    assert rows["capture"]["budget_s"] == 30
    assert rows["capture"]["result"]["argv"][-2:] == ["--budget", "10"]
    assert rows["truth-check"]["exit"] == 0
    assert rows["slow"]["skipped"] == "no time" and "exit" not in rows["slow"]
    assert rows["late"]["exit"] == 0
    assert summary["failed"] == ["fails"]
    assert summary["skipped"] == ["slow"]
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == summary
    # The corpus comes back as one file: truth-check read it unpacked, and it was packed again.
    assert sorted(p.name for p in out.iterdir()) == [
        "cuda_truth.tar.gz",
        "logs.txt",
        "summary.json",
    ]
    with tarfile.open(out / "cuda_truth.tar.gz") as tar:
        assert "cuda_truth/index.json" in tar.getnames()

    # The rerun: what passed is kept and marked; the failed step runs again.
    (out / "cuda_truth.tar.gz").unlink()  # a capture that ran again would write it anew
    first = rows
    assert gpu_suite.main([*argv, "--only", "capture,truth-check,fails,late"]) == 1
    rows = json.loads((out / "summary.json").read_text())["steps"]
    for name in ("capture", "truth-check", "late"):
        assert rows[name]["reused"] is True
        assert rows[name]["started"] == first[name]["started"]
    assert "reused" not in rows["fails"]
    assert rows["slow"] == first["slow"]  # not in this plan: kept as it was
    assert not (out / "cuda_truth.tar.gz").exists() and not (out / "cuda_truth").exists()

    # --force runs them all again: capture writes its corpus anew.
    argv_force = [*argv, "--only", "capture,truth-check,late", "--force"]
    assert gpu_suite.main(argv_force) == 0
    rows = json.loads((out / "summary.json").read_text())["steps"]
    assert not any(rows[n].get("reused") for n in ("capture", "truth-check", "late"))
    assert (out / "cuda_truth.tar.gz").is_file()


def test_truth_check_is_skipped_without_a_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_suite, "steps", stand_ins)
    monkeypatch.setattr(gpu_suite, "gpu_facts", lambda env: {"gpu": GPU})
    monkeypatch.setattr(gpu_suite, "git_commit", lambda: None)
    out = tmp_path / "r"
    assert gpu_suite.main(["--out", str(out), "--only", "truth-check"]) == 0
    rows = json.loads((out / "summary.json").read_text())["steps"]
    assert rows["truth-check"]["skipped"].startswith("no corpus")
    assert rows["truth-check"]["commit"] is None


def test_truth_check_runs_again_after_a_new_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_suite, "steps", stand_ins)
    monkeypatch.setattr(gpu_suite, "gpu_facts", lambda env: {"gpu": GPU})
    monkeypatch.setattr(gpu_suite, "git_commit", lambda: COMMIT)
    out = tmp_path / "r"
    (out / "cuda_truth").mkdir(parents=True)
    (out / "cuda_truth" / "index.json").write_text("{}")
    earlier = {"steps": {"capture": row(exit=124, quick=False), "truth-check": row(quick=False)}}
    (out / "summary.json").write_text(json.dumps(earlier))
    assert gpu_suite.main(["--out", str(out), "--only", "capture,truth-check"]) == 0
    rows = json.loads((out / "summary.json").read_text())["steps"]
    assert rows["capture"]["exit"] == 0 and "reused" not in rows["capture"]
    assert rows["truth-check"]["exit"] == 0 and "reused" not in rows["truth-check"]
    assert rows["truth-check"]["result"] == {"ok": True}


def test_a_packed_corpus_is_unpacked_for_the_steps_that_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A corpus that came back packed, copied to a new output folder, is checked there."""
    monkeypatch.setattr(gpu_suite, "steps", stand_ins)
    monkeypatch.setattr(gpu_suite, "gpu_facts", lambda env: {"gpu": GPU})
    monkeypatch.setattr(gpu_suite, "git_commit", lambda: COMMIT)
    out = tmp_path / "r"
    (out / "cuda_truth").mkdir(parents=True)
    (out / "cuda_truth" / "index.json").write_text("{}")
    gpu_suite.pack_corpus(out)
    assert not (out / "cuda_truth").exists()
    assert gpu_suite.main(["--out", str(out), "--only", "truth-check"]) == 0
    rows = json.loads((out / "summary.json").read_text())["steps"]
    assert rows["truth-check"]["exit"] == 0 and rows["truth-check"]["result"] == {"ok": True}
    assert not (out / "cuda_truth").exists() and (out / "cuda_truth.tar.gz").is_file()


def test_the_profile_is_kept_beside_the_corpus_after_calibrate(tmp_path: Path) -> None:
    (tmp_path / "calibration.json").write_text('{"schema": "x"}')
    gpu_suite.keep_profile("calibrate", {"exit": 1}, tmp_path)
    assert not (tmp_path / "cuda_truth").exists()  # no corpus: nothing to keep it beside
    (tmp_path / "cuda_truth").mkdir()
    gpu_suite.keep_profile("calibrate", {"exit": 1}, tmp_path)
    assert not (tmp_path / "cuda_truth" / "calibration.json").exists()  # it failed
    gpu_suite.keep_profile("calibrate", {"exit": 0}, tmp_path)
    assert (tmp_path / "cuda_truth" / "calibration.json").read_text() == '{"schema": "x"}'


# -- the test steps: their order and what they record ---------------------------------------


def test_a_test_steps_outcomes_and_times_are_read_from_its_lines() -> None:
    lines = [
        "tests/estimator/test_a.py::test_one PASSED 12.908s",
        "tests/estimator/test_a.py::test_two[x-1] FAILED 65.01ms",
        "tests/fit/test_b.py::test_three SKIPPED 151.9us",
        "tests/fit/test_b.py::test_four PASSED 1.0s",
        "tests/fit/test_b.py::test_four ERROR 0.5s",  # its teardown failed: the last counts
        "tests/jobs/test_c.py::test_five PASSED [ 50%]",  # pytest's default style: no time
        "FAILED tests/estimator/test_a.py::test_two[x-1] - assert 1 == 2",  # -r summary
        "==== 2 passed, 1 failed in 14.2s ====",
    ]
    outcomes, seconds = gpu_suite.test_outcomes(lines)
    assert outcomes == {
        "passed": ["tests/estimator/test_a.py::test_one", "tests/jobs/test_c.py::test_five"],
        "failed": ["tests/estimator/test_a.py::test_two[x-1]"],
        "skipped": ["tests/fit/test_b.py::test_three"],
        "error": ["tests/fit/test_b.py::test_four"],
    }
    assert seconds == {
        "tests/estimator/test_a.py::test_one": 12.908,
        "tests/estimator/test_a.py::test_two[x-1]": 0.065,
        "tests/fit/test_b.py::test_three": 0.0,
        "tests/fit/test_b.py::test_four": 1.5,
    }


def test_tests_that_passed_before_on_this_gpu_model_are_named(tmp_path: Path) -> None:
    def summary(gpu: str, passed: list[str], failed: list[str]) -> dict[str, Any]:
        tests = {"passed": passed, "failed": failed}
        return {"gpu": gpu, "steps": {"cuda-tests": {**row(1, gpu=gpu), "tests": tests}}}

    a, b, c = (f"tests/x.py::test_{n}" for n in "abc")
    (tmp_path / "2026-12-01-nvidia-h200-summary.json").write_text(
        json.dumps(summary(GPU, [a], [b]))
    )
    (tmp_path / "2026-12-02-nvidia-h100-summary.json").write_text(
        json.dumps(summary("NVIDIA H100 80GB HBM3", [c], []))
    )
    (tmp_path / "2026-12-03-nvidia-h200-summary.json").write_text("not json")
    (tmp_path / "2026-12-04-nvidia-h200-calibration.json").write_text("{}")
    assert gpu_suite.passed_before(GPU, tmp_path) == {a}
    assert gpu_suite.passed_before("NVIDIA H100 80GB HBM3", tmp_path) == {c}
    assert gpu_suite.passed_before(None, tmp_path) == set()
    assert gpu_suite.passed_before(GPU, tmp_path / "none") == set()

    path = gpu_suite.write_test_order(tmp_path, GPU, tmp_path)
    order = json.loads(path.read_text())
    assert order == {"first": list(gpu_suite.TESTS_FIRST), "last": [a]}


def test_the_test_steps_run_pytest_in_the_order_file_with_each_tests_time(
    tmp_path: Path,
) -> None:
    # The real plugin in a real pytest run: the suite's own pytest arguments, on a tree
    # of three test files.
    import os

    import _test_order

    assert gpu_suite.ORDER_ENV == _test_order.ORDER_ENV
    step = {s.name: s for s in gpu_suite.steps(tmp_path)}["cuda-tests"]
    assert step.argv[1:3] == ("-m", "pytest") and step.argv[-2:] == ("-m", "cuda")
    for folder, name in (("a", "test_one"), ("b", "test_two"), ("c", "test_three")):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / f"{name}.py").write_text(
            "def test_x():\n    pass\n\ndef test_y():\n    pass\n"
        )
    (tmp_path / "order.json").write_text(
        json.dumps({"first": ["tests/c/", "tests/b/"], "last": ["tests/c/test_three.py::test_x"]})
    )
    argv = [a for a in step.argv[:-2] if not a.startswith("--junitxml")]
    env = dict(os.environ, PYTHONPATH=str(BENCH), VRAMCTL_TEST_ORDER=str(tmp_path / "order.json"))
    done = subprocess.run(
        [*argv, "tests"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    outcomes, seconds = gpu_suite.test_outcomes(done.stdout.splitlines())
    assert outcomes["passed"] == [
        "tests/c/test_three.py::test_y",
        "tests/b/test_two.py::test_x",
        "tests/b/test_two.py::test_y",
        "tests/a/test_one.py::test_x",
        "tests/a/test_one.py::test_y",
        "tests/c/test_three.py::test_x",  # it passed before: last
    ]
    assert set(seconds) == set(outcomes["passed"])

    # Without the variable the collection order is kept.
    env.pop("VRAMCTL_TEST_ORDER")
    done = subprocess.run(
        [*argv, "tests"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    outcomes, _ = gpu_suite.test_outcomes(done.stdout.splitlines())
    assert outcomes["passed"][0] == "tests/a/test_one.py::test_x"
