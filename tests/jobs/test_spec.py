"""Job specs: parsing (dict, JSON, TOML, files), one clear problem per mistake, pricing a
need on a device, whether any device can take it, and the batch plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import vramctl
from tests.fake_nvml import FakeGpu
from vramctl.device import ComputeCapability
from vramctl.jobs import (
    BATCH_SIZE_ENV,
    GRAD_ACCUM_ENV,
    DeviceConstraints,
    GuardOptions,
    JobSpec,
    JobSpecError,
    MemoryNeed,
    ModelNeed,
    batch_plan,
    check_placeable,
    load_spec,
    price,
)
from vramctl.jobs._need import job_env, matching_devices

GiB = 2**30

FULL_TOML = """
name = "llama-finetune"
command = ["python", "train.py", "--lr", "3e-4"]
cwd = "/srv/jobs/llama"
memory = {estimate = {model = "gpt2", batch_size = 8, seq_len = 512, precision = "bf16", mode = "train"}}
batch_size = 8
effective_batch = 64
priority = 5
wait_timeout = "30m"
run_timeout = 7200
retries = 2

[env]
HF_HOME = "/cache/hf"

[labels]
team = "nlp"

[devices]
model = "A100"
count = 2
min_capability = "8.0"
"""  # noqa: E501


def base(**extra: Any) -> dict[str, Any]:
    return {"name": "job", "command": ["python", "train.py"], "memory": "20GiB", **extra}


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_dict(data)
    return info.value.problems


def one_problem(data: dict[str, Any]) -> str:
    found = problems_of(data)
    assert len(found) == 1, found
    return found[0]


# -- parsing and round trips ----------------------------------------------------------


def test_full_toml_spec_reads_every_field() -> None:
    spec = JobSpec.from_toml(FULL_TOML)
    assert spec.name == "llama-finetune"
    assert spec.command == ("python", "train.py", "--lr", "3e-4")
    assert spec.entry_point is None
    assert spec.cwd == "/srv/jobs/llama"
    assert spec.env == {"HF_HOME": "/cache/hf"}
    assert spec.labels == {"team": "nlp"}
    assert spec.memory == MemoryNeed(
        "estimate", estimate=ModelNeed("gpt2", 8, 512, precision="bf16", mode="train")
    )
    assert (spec.batch_size, spec.effective_batch, spec.target_batch) == (8, 64, 64)
    assert spec.priority == 5
    assert spec.wait_timeout == 1800.0
    assert spec.run_timeout == 7200.0
    assert spec.retries == 2
    assert spec.devices == DeviceConstraints("A100", 2, ComputeCapability(8, 0))


def test_defaults() -> None:
    spec = JobSpec.from_dict(base())
    assert spec.memory == MemoryNeed("size", size=20 * GiB)
    assert spec.env == {} and spec.labels == {} and spec.args == ()
    assert spec.cwd is None and spec.batch_size is None and spec.target_batch is None
    assert (spec.priority, spec.retries, spec.wait_timeout, spec.run_timeout) == (0, 0, None, None)
    assert spec.devices == DeviceConstraints(model=None, count=1, min_capability=None)


@pytest.mark.parametrize(
    "spec",
    [
        JobSpec.from_toml(FULL_TOML),
        JobSpec.from_dict(base()),
        JobSpec.from_dict(
            base(
                command=None,
                entry_point="mypkg.train:main",
                args=["--epochs", "3", ""],
                memory={"learned": {"first": "8GiB", "margin": 0.2}},
                batch_size=16,
                wait_timeout=0,
                priority=-3,
            )
        ),
        JobSpec.from_dict(base(memory=12345, devices={"min_capability": "sm_90"})),
        JobSpec.from_dict(base(memory={"estimate": {"model": "mypkg.models:small"}})),
        JobSpec.from_dict(base(guard={"function": "lib.steps:train", "optimizer": "lib:opt"})),
    ],
    ids=["toml", "minimal", "entry-point-learned", "odd-bytes", "estimate-defaults", "guard"],
)
def test_round_trips_through_dict_json_and_toml(spec: JobSpec, tmp_path: Path) -> None:
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert JobSpec.from_json(spec.to_json()) == spec
    path = tmp_path / "job.json"
    path.write_text(spec.to_json())
    assert load_spec(path) == spec


def test_the_json_schema_has_every_field_and_takes_every_written_spec() -> None:
    # The job service's OpenAPI schema comes from the spec's own field table.
    jsonschema = pytest.importorskip("jsonschema")
    schema = JobSpec.json_schema()
    assert list(schema["properties"]) == list(JobSpec.FIELDS)
    assert schema["required"] == ["name", "memory"] and schema["additionalProperties"] is False
    guard = schema["properties"]["guard"]["oneOf"][1]
    assert list(guard["properties"]) == list(GuardOptions.FIELDS)
    validator = jsonschema.Draft202012Validator(schema)
    for spec in [
        JobSpec.from_toml(FULL_TOML),
        JobSpec.from_dict(base(guard="lib.steps:embed", rerun_lost=True, retries=2)),
        JobSpec.from_dict(base(command=None, entry_point="m:f", wait_timeout="90s")),
    ]:
        assert not list(validator.iter_errors(spec.to_dict()))
    assert list(validator.iter_errors({"name": "x", "memory": "1GiB", "retries": -1}))
    schema["properties"]["args"]["items"]["type"] = "integer"  # a copy: the next one is whole
    assert JobSpec.json_schema()["properties"]["args"]["items"] == {"type": "string"}


def test_a_guard_is_a_function_or_a_table() -> None:
    short = JobSpec.from_dict(base(guard="lib.steps:embed"))
    assert short.guard == GuardOptions("lib.steps:embed")
    assert short.to_dict()["guard"] == {"function": "lib.steps:embed"}
    assert JobSpec.from_dict(base()).guard is None and "guard" not in base()
    with pytest.raises(JobSpecError, match=r"guard\.model: must be of the form"):
        GuardOptions("m:f", model="model")


def test_to_dict_writes_sizes_exactly_and_readably() -> None:
    assert JobSpec.from_dict(base(memory="1.5GiB")).to_dict()["memory"] == "1536MiB"
    assert JobSpec.from_dict(base(memory=1000)).to_dict()["memory"] == 1000
    learned = JobSpec.from_dict(base(memory={"learned": {"first": "8G"}}))
    assert learned.to_dict()["memory"] == {"learned": {"first": "8GiB", "margin": 0.1}}


def test_compact_and_full_memory_forms_agree() -> None:
    size = MemoryNeed("size", size=20 * GiB)
    assert JobSpec.from_dict(base(memory="20GiB")).memory == size
    assert JobSpec.from_dict(base(memory={"size": "20GiB"})).memory == size
    assert JobSpec.from_dict(base(memory=20 * GiB)).memory == size
    assert MemoryNeed.of_size("20GiB") == size
    by_name = JobSpec.from_dict(base(memory={"estimate": "gpt2"})).memory
    assert by_name == MemoryNeed("estimate", estimate=ModelNeed("gpt2"))
    assert MemoryNeed.learned("8GiB", 0.2) == MemoryNeed("learned", first=8 * GiB, margin=0.2)


def test_toml_file_and_json_file(tmp_path: Path) -> None:
    toml = tmp_path / "job.toml"
    toml.write_text(FULL_TOML)
    spec = load_spec(toml)
    js = tmp_path / "job.JSON"
    js.write_text(json.dumps(spec.to_dict()))
    assert load_spec(str(js)) == spec


def test_spec_is_frozen_and_its_maps_read_only() -> None:
    spec = JobSpec.from_dict(base(env={"A": "1"}))
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.env["B"] = "2"  # type: ignore[index]


def test_constructing_directly_validates_too() -> None:
    spec = JobSpec("job", MemoryNeed.of_size("1GiB"), command=["python", "x.py"])  # type: ignore[arg-type]
    assert spec.command == ("python", "x.py")
    with pytest.raises(JobSpecError, match="retries: must be a whole number"):
        JobSpec("job", MemoryNeed.of_size("1GiB"), command=("x",), retries=-1)
    with pytest.raises(JobSpecError, match=r"memory\.estimate\.batch_size: must be a positive"):
        ModelNeed("gpt2", batch_size=-2)
    with pytest.raises(JobSpecError, match=r"devices\.count"):
        DeviceConstraints(count=0)
    with pytest.raises(JobSpecError, match=r"memory: must be a positive size"):
        MemoryNeed("size", size=0)
    with pytest.raises(JobSpecError, match=r"memory\.size: only goes with kind 'size'"):
        MemoryNeed("learned", size=3, first=5)


# -- one clear problem per mistake ------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (base(memroy="1GiB"), "unknown field 'memroy' (did you mean 'memory'?)"),
        (
            base(memory={"estimate": {"model": "gpt2", "batchsize": 8}}),
            "unknown field 'memory.estimate.batchsize' (did you mean 'batch_size'?)",
        ),
        (base(devices={"gpu": "A100"}), "unknown field 'devices.gpu'"),
        (base(memory={"learnd": {"first": "1G"}}), "unknown field 'memory.learnd'"),
        (base(memory="-3GiB"), "memory: invalid size '-3GiB': a size cannot be negative"),
        (base(memory=-5), "memory: invalid size -5: a size cannot be negative"),
        (base(memory="0GiB"), "memory: must be a positive size, got '0GiB'"),
        (base(memory="20 gigs"), "memory: invalid size '20 gigs'"),
        (base(memory="2048TiB"), "memory: '2048TiB' is more than 1 PiB; check the unit"),
        (base(memory=True), "memory: must be a size such as"),
        (base(memory={}), "memory: empty"),
        (
            base(memory={"size": "1G", "learned": {"first": "1G"}}),
            "memory: give one of size, learned, not 2",
        ),
        (base(memory={"learned": {"margin": 0.2}}), "memory.learned.first: missing"),
        (base(memory={"learned": {"first": "1G", "margin": -1}}), "memory.learned.margin"),
        (base(memory={"learned": "8GiB"}), "memory.learned: must be a table"),
        (
            base(memory={"estimate": {"model": "gpt2", "batch_size": -2}}),
            "memory.estimate.batch_size: must be a positive integer, got -2",
        ),
        (
            base(memory={"estimate": {"model": "gpt2", "precision": "fp64"}}),
            "memory.estimate.precision: must be one of fp32, bf16, fp16, amp-bf16, amp-fp16, "
            "got 'fp64'",
        ),
        (
            base(memory={"estimate": {"model": "gpt2", "mode": "training"}}),
            "memory.estimate.mode: must be one of train, infer, generate, got 'training'",
        ),
        (
            base(memory={"estimate": {"model": "gtp2"}}),
            "memory.estimate.model: unknown model 'gtp2' (did you mean 'gpt2'?)",
        ),
        (base(memory={"estimate": {"model": "pkg:"}}), "memory.estimate.model: 'pkg:' is not"),
        (base(memory={"estimate": {"seq_len": 5}}), "memory.estimate.model: missing"),
        (base(command=None), "command: missing"),
        (base(command=[]), "command: empty; give the program and its arguments"),
        (base(command=["", "x"]), "command[0]: the program cannot be an empty string"),
        (base(command=["python", 3]), "command[1]: must be a string, got 3"),
        (base(command={"a": 1}), "command: must be a list of strings"),
        (base(entry_point="pkg.mod:main"), "command: give either command or entry_point"),
        (base(command=None, entry_point="pkg.mod"), "entry_point: must be of the form"),
        (base(command=None, entry_point="pkg mod:f"), "entry_point: must be of the form"),
        (base(args=["--x"]), "args: only go with entry_point"),
        (base(env={"SEED": 3}), 'env.SEED: must be a string, got 3 (write "3")'),
        (base(env={"BAD-NAME": "x"}), "env.BAD-NAME: not an environment variable name"),
        (base(env=["A=1"]), "env: must be a table of names to strings"),
        (base(labels={"team": None}), "labels.team: must be a string, got None"),
        (base(cwd=""), "cwd: must be a directory path"),
        (base(name=None), "name: missing"),
        (base(name="my job!"), "name: must be 1 to 128 letters"),
        (base(name=7), "name: must be 1 to 128 letters"),
        (base(batch_size=0), "batch_size: must be a positive integer, got 0"),
        (base(batch_size=8.0), "batch_size: must be a positive integer, got 8.0"),
        (base(batch_size=8, effective_batch=-8), "effective_batch: must be a positive integer"),
        (base(batch_size=8, effective_batch=4), "effective_batch: 4 is smaller than batch_size 8"),
        (base(batch_size=8, effective_batch=20), "effective_batch: 20 is not a multiple of"),
        (base(effective_batch=64), "effective_batch: needs batch_size"),
        (base(priority="high"), "priority: must be an integer, got 'high'"),
        (base(retries=-1), "retries: must be a whole number, 0 or more, got -1"),
        (base(retries=True), "retries: must be a whole number"),
        (base(wait_timeout=-5), "wait_timeout: cannot be negative, got -5"),
        (base(run_timeout="soon"), "run_timeout: must be seconds or a duration"),
        (base(run_timeout=0), "run_timeout: must be more than 0 seconds"),
        (base(devices={"count": 0}), "devices.count: must be a positive integer, got 0"),
        (base(devices={"min_capability": "eight"}), "devices.min_capability: must be a compute"),
        (base(devices={"model": ""}), "devices.model: must be part of a GPU name"),
        (base(devices="A100"), "devices: must be a table"),
        (base(guard="steps"), "guard.function: must be of the form 'module:function'"),
        (base(guard={"optimizer": "m:o"}), "guard.function: missing"),
        (base(guard={"function": "m:f", "optimiser": "m:o"}), "unknown field 'guard.optimiser'"),
        (base(guard={"function": "m:f", "optimizer": "m"}), "guard.optimizer: must be of the"),
        (base(guard="__main__:step"), "guard.function: the script run as __main__ cannot be"),
        (base(guard=["m:f"]), "guard: must be 'module:function' or a table"),
    ],
)
def test_each_mistake_gives_its_one_problem(data: dict[str, Any], expected: str) -> None:
    problem = one_problem(data)
    assert problem.startswith(expected), problem


def test_a_shell_string_command_is_refused_with_the_argv_to_write() -> None:
    problem = one_problem(base(command="python train.py --name 'a b'"))
    assert "not a shell string" in problem
    assert '["python", "train.py", "--name", "a b"]' in problem
    # Even an unparseable string is refused, never handed to a shell.
    assert "not a shell string" in one_problem(base(command="echo 'unbalanced"))


def test_every_problem_is_reported_at_once_one_per_line() -> None:
    data = {
        "name": "job",
        "command": "rm -rf /",
        "memory": {"estimate": {"model": "gpt2", "batch_size": -2, "precision": "fp8"}},
        "retries": -1,
        "devices": {"count": 0, "min_capability": "x"},
        "colour": "blue",
    }
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_dict(data)
    problems = info.value.problems
    assert len(problems) == 7, problems
    message = str(info.value)
    assert message.splitlines()[0] == "invalid job spec (7 problems):"
    assert message.splitlines()[1:] == [f"  {p}" for p in problems]
    # In the spec's field order, unknown fields last.
    assert problems[0].startswith("command:")
    assert problems[-1].startswith("unknown field 'colour'")
    assert isinstance(info.value, vramctl.VramctlError)


def test_numbers_and_durations() -> None:
    spec = JobSpec.from_dict(base(wait_timeout="90s", run_timeout="1.5h"))
    assert (spec.wait_timeout, spec.run_timeout) == (90.0, 5400.0)
    assert JobSpec.from_dict(base(run_timeout="2d")).run_timeout == 172800.0
    spec = JobSpec.from_dict(base(devices={"min_capability": 8.6}))
    assert spec.devices.min_capability == ComputeCapability(8, 6)


def test_bad_syntax_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match=r"invalid TOML: .*line 2, column 10"):
        JobSpec.from_toml('name = "x"\nmemory = \n')
    with pytest.raises(JobSpecError, match=r"invalid JSON: .*line 3, column"):
        JobSpec.from_json('{\n"name": "x",\n}')
    with pytest.raises(JobSpecError, match="must be a JSON object, got list"):
        JobSpec.from_json("[1, 2]")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nmemory = \n')
    with pytest.raises(JobSpecError, match=r"bad\.toml: invalid TOML: .*line 2"):
        load_spec(bad)


def test_load_spec_names_the_file_and_its_problems(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match=r"missing\.toml: no such file"):
        load_spec(tmp_path / "missing.toml")
    other = tmp_path / "job.yaml"
    other.write_text("name: x")
    with pytest.raises(JobSpecError, match=r"unknown spec format '\.yaml'; use a \.toml or \.json"):
        load_spec(other)
    bad = tmp_path / "job.toml"
    bad.write_text('name = "x"\ncommand = "python x.py"\nmemory = "1G"\n')
    with pytest.raises(JobSpecError) as info:
        load_spec(bad)
    assert str(info.value).startswith(f"invalid job spec {bad}: command: must be a list")


# -- pricing ----------------------------------------------------------------------------


def test_price_of_a_size_and_of_a_learned_need() -> None:
    assert price(JobSpec.from_dict(base(memory="3GiB")), "cpu") == 3 * GiB
    learned = JobSpec.from_dict(base(memory={"learned": {"first": "8GiB", "margin": 0.25}}))
    assert price(learned, "cpu") == 8 * GiB
    assert price(learned, "cpu", learned_peak=4 * GiB) == 5 * GiB
    with pytest.raises(ValueError, match="negative"):
        price(learned, "cpu", learned_peak=-1)


MODEL = {"estimate": {"model": "lstm", "batch_size": 2, "seq_len": 16, "mode": "infer"}}


def test_price_of_an_estimate_is_what_vramctl_estimate_predicts() -> None:
    spec = JobSpec.from_dict(base(memory=MODEL))
    gpu = vramctl.simulate("A10G-24GB")
    for device in ("cpu", gpu):
        direct = vramctl.estimate(
            "lstm", device=device, batch_size=2, seq_len=16, mode="infer", precision="fp32"
        )
        assert price(spec, device) == direct.judged_peak > 0
    # On a GPU the need is the safe end of what nvidia-smi may show, context included.
    on_gpu = vramctl.estimate("lstm", device=gpu, batch_size=2, seq_len=16, mode="infer")
    assert price(spec, gpu) == on_gpu.peak_device_high > on_gpu.peak_reserved


def test_price_takes_the_jobs_batch_and_a_lowered_one() -> None:
    spec = JobSpec.from_dict(
        base(memory={"estimate": {"model": "lstm", "seq_len": 16, "mode": "infer"}}, batch_size=8)
    )
    at_8 = vramctl.estimate("lstm", device="cpu", batch_size=8, seq_len=16, mode="infer")
    at_1 = vramctl.estimate("lstm", device="cpu", batch_size=1, seq_len=16, mode="infer")
    assert price(spec, "cpu") == at_8.judged_peak
    assert price(spec, "cpu", batch_size=1) == at_1.judged_peak < at_8.judged_peak


def test_price_of_a_model_that_cannot_be_built_names_the_job() -> None:
    spec = JobSpec.from_dict(base(memory={"estimate": {"model": "no_such_pkg_xyz:make"}}))
    with pytest.raises(JobSpecError, match=r"cannot price job 'job': memory\.estimate: "):
        price(spec, "cpu")


# -- placeable --------------------------------------------------------------------------


def test_a_need_that_fits_some_device_is_placeable() -> None:
    check_placeable(JobSpec.from_dict(base(memory="20GiB")), [vramctl.simulate("A10G-24GB")])


def test_a_need_larger_than_every_device_says_so() -> None:
    devices = [vramctl.simulate("T4-16GB"), vramctl.simulate("A10G-24GB")]
    with pytest.raises(JobSpecError) as info:
        check_placeable(JobSpec.from_dict(base(memory="30GiB")), devices)
    assert str(info.value) == (
        "job 'job' cannot be placed: memory: needs 30.00 GiB but the largest device, "
        "sim:A10G-24GB, has 22.06 GiB"
    )
    learned = JobSpec.from_dict(base(memory={"learned": {"first": "30GiB"}}))
    with pytest.raises(JobSpecError, match=r"needs 30\.00 GiB"):
        check_placeable(learned, devices)
    check_placeable(learned, devices, learned_peak=10 * GiB)


def test_an_estimate_is_priced_on_each_candidate() -> None:
    spec = JobSpec.from_dict(base(memory=MODEL))
    need = price(spec, vramctl.simulate("24GiB"))
    roomy = vramctl.simulate(need + 2**20)
    tight = vramctl.simulate(need // 2)
    check_placeable(spec, [tight, roomy])
    with pytest.raises(JobSpecError, match=r"memory: needs .* but the largest device, sim:"):
        check_placeable(spec, [tight])


def test_constraints_say_which_device_each_excluded(gpus: list[FakeGpu]) -> None:
    # Two A100s (8.0) and a T4 (7.5) behind the NVML stand-in.
    spec = JobSpec.from_dict(base(memory="10GiB", devices={"model": "H100"}))
    with pytest.raises(JobSpecError) as info:
        check_placeable(spec)
    message = str(info.value)
    assert "needs 1 device but no device meets the constraints" in message
    assert "cuda:0 (NVIDIA A100-SXM4-80GB) excluded by model 'H100'" in message
    assert "cuda:2 (Tesla T4) excluded by model 'H100'" in message

    spec = JobSpec.from_dict(base(memory="10GiB", devices={"min_capability": "8.0", "count": 3}))
    with pytest.raises(JobSpecError) as info:
        check_placeable(spec)
    assert "needs 3 devices but only 2 of them meet the constraints" in str(info.value)
    assert "cuda:2 (Tesla T4) excluded by min_capability 8.0 (it has 7.5)" in str(info.value)

    spec = JobSpec.from_dict(base(memory="10GiB", devices={"model": "a100", "count": 2}))
    check_placeable(spec)
    assert [d.id for d in matching_devices(spec, vramctl.gpus())] == ["cuda:0", "cuda:1"]


def test_count_needs_that_many_devices_with_the_room() -> None:
    devices = [vramctl.simulate("T4-16GB"), vramctl.simulate("A10G-24GB")]
    spec = JobSpec.from_dict(base(memory="20GiB", devices={"count": 2}))
    with pytest.raises(JobSpecError, match=r"on each of 2 devices .* only 1 device can"):
        check_placeable(spec, devices)
    check_placeable(JobSpec.from_dict(base(memory="10GiB", devices={"count": 2})), devices)


def test_placeable_counts_the_schedulers_safety_margin() -> None:
    # 14 GiB fits a T4's 14.58 GiB, but not with the 10% the scheduler's ledger adds.
    spec = JobSpec.from_dict(base(memory="14GiB"))
    t4 = [vramctl.simulate("T4-16GB")]
    check_placeable(spec, t4)
    with pytest.raises(JobSpecError) as info:
        check_placeable(spec, t4, margin=0.1)
    assert str(info.value) == (
        "job 'job' cannot be placed: memory: needs 15.40 GiB with the 10% margin but the "
        "largest device, sim:T4-16GB, has 14.58 GiB"
    )
    check_placeable(JobSpec.from_dict(base(memory="13GiB")), t4, margin=0.1)


def test_unknown_capability_does_not_meet_a_minimum() -> None:
    spec = JobSpec.from_dict(base(memory="1GiB", devices={"min_capability": "7.0"}))
    with pytest.raises(JobSpecError, match=r"sim:4GiB excluded by min_capability 7\.0 \(its"):
        check_placeable(spec, [vramctl.simulate("4GiB")])
    check_placeable(spec, [vramctl.simulate("T4-16GB")])


def test_no_devices_at_all() -> None:
    with pytest.raises(JobSpecError, match="there are no devices"):
        check_placeable(JobSpec.from_dict(base()), [])


# -- batch plan -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "effective", "fitted", "plan"),
    [
        (32, 96, 100, (32, 3)),  # never above the declared batch
        (32, 96, 32, (32, 3)),
        (32, 96, 20, (16, 6)),  # the largest divisor of 96 not above 20
        (32, 96, 5, (4, 24)),
        (32, 96, 1, (1, 96)),
        (7, 7, 6, (1, 7)),  # a prime: down to 1
        (8, None, 5, (4, 2)),  # no effective batch: the declared batch is kept
    ],
)
def test_batch_plan(batch: int, effective: int | None, fitted: int, plan: tuple[int, int]) -> None:
    spec = JobSpec.from_dict(base(batch_size=batch, effective_batch=effective))
    got = batch_plan(spec, fitted)
    assert got == plan
    assert got[0] * got[1] == (effective or batch)
    assert got[0] <= min(fitted, batch)


def test_batch_plan_refuses_what_cannot_be_planned() -> None:
    spec = JobSpec.from_dict(base(batch_size=8, effective_batch=16))
    with pytest.raises(JobSpecError, match="not even a batch of 1 fits"):
        batch_plan(spec, 0)
    with pytest.raises(JobSpecError, match="declares no batch"):
        batch_plan(JobSpec.from_dict(base()), 4)


def test_job_env_adds_the_batch_and_accumulation() -> None:
    spec = JobSpec.from_dict(base(env={"HF_HOME": "/h"}, batch_size=8, effective_batch=32))
    env = job_env(spec, *batch_plan(spec, 3))
    assert env == {"HF_HOME": "/h", BATCH_SIZE_ENV: "2", GRAD_ACCUM_ENV: "16"}
    assert (BATCH_SIZE_ENV, GRAD_ACCUM_ENV) == ("VRAMCTL_BATCH_SIZE", "VRAMCTL_GRAD_ACCUM")
    assert spec.env == {"HF_HOME": "/h"}
    with pytest.raises(ValueError, match="accum must be a positive integer"):
        job_env(spec, 2, 0)
