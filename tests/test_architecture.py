"""The package's shape: callers outside the device layer never ask what kind a device is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "vramctl"

#: A device's kind tested outside the device layer: isinstance against a device class, or
#: ``.kind`` compared with a device kind ("cuda", "mig", "cpu", "sim").
_KINDS = r"""["'](?:cuda|mig|cpu|sim)["']"""
_PATTERNS = {
    "isinstance of a device class": re.compile(
        r"isinstance\([^)]*\b(?:Simulated|Cuda|Cpu)Device\b"
    ),
    "a device kind compared": re.compile(
        rf"\.kind\s*(?:==|!=|\bin\b|\bnot in\b)\s*[(\[{{]?\s*{_KINDS}"
    ),
    "a device kind compared (reversed)": re.compile(rf"{_KINDS}\s*(?:==|!=)\s*\w+\.kind\b"),
    # The same question asked of a torch.device: ``Device.is_cuda`` answers it.
    "a torch device type compared with cuda": re.compile(
        r"""\.type\s*(?:==|!=|\bin\b|\bnot in\b)\s*[(\[{]?[^)\]}:#]*["']cuda["']"""
    ),
    "a torch device type compared with cuda (reversed)": re.compile(
        r"""["']cuda["']\s*(?:==|!=)\s*[\w.()]+\.type\b"""
    ),
}

#: Lines that compare a ``torch.device``'s type where no vramctl ``Device`` is in hand, and why.
#: Each is the line's text (wherever its module moves), and must still be in the tree.
_ALLOWED = {
    # measure_throughput(device) takes a torch device ("cuda:0", "cpu") of the caller's, to
    # synchronize CUDA around its timings: a torch.device, not a vramctl Device.
    'cuda = dev.type == "cuda"',
    # A LightningModule's own torch.device (where Lightning put its parameters), read when no
    # vramctl device was named or is active, to resolve the CUDA device it is on.
    'if not dev.active and module.device.type == "cuda":',
    # transformers' offloaded KV cache runs on CUDA only (its prefetch stream): a generate
    # run for real checks the model's own parameters' torch device, where no vramctl
    # device is in hand.
    'if param is None or param.device.type != "cuda":',
}


def _outside_device_layer() -> list[Path]:
    files = sorted(SRC.rglob("*.py"))
    return [p for p in files if (SRC / "device") not in p.parents]


def _offences(text: str) -> list[str]:
    return [name for name, rx in _PATTERNS.items() if rx.search(text)]


def test_no_caller_branches_on_the_kind_of_device() -> None:
    found, allowed = [], set()
    for path in _outside_device_layer():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip() in _ALLOWED:
                allowed.add(line.strip())
                continue
            for what in _offences(line):
                found.append(f"{path.relative_to(SRC.parent)}:{n}: {what}: {line.strip()}")
    assert not found, "ask the Device (a method or property), not its kind:\n" + "\n".join(found)
    assert allowed == _ALLOWED, f"allowed lines no longer in the tree: {_ALLOWED - allowed}"


@pytest.mark.parametrize(
    "line",
    [
        "if isinstance(dev, SimulatedDevice):",
        "return device if isinstance(device, (SimulatedDevice, CpuDevice)) else None",
        'if device.kind in ("cuda", "mig"):',
        'if dev.kind == "cpu":',
        "if w.dev.kind != 'sim':",
        'if "cpu" == dev.kind:',
        'if d.kind not in ("cuda",):',
        'if self.device.type == "cuda":',
        "cuda = dev.torch_device.type != 'cuda'",
        'if device.type in ("cuda", "mig"):',
        'x if torch.device(device).type not in ("cpu", "cuda") else y',
        'if "cuda" == dev.torch_device.type:',
    ],
)
def test_the_check_sees_kind_branches(line: str) -> None:
    assert _offences(line)


@pytest.mark.parametrize(
    "line",
    [
        'if event.kind == "alert":',
        "if self.kind is None or self.kind == scope:",
        "if dev.is_cuda and not dev.is_mig:",
        'f"{dev.id} is a {dev.kind} device"',
        'if t.device.type != "cpu":',  # a tensor on the host or not: no device kind
        'if device is None or torch.device(device).type in ("cpu", "meta"):',
        'if msg.type == "cudagraph":',
        "if dev.is_cuda:",
    ],
)
def test_the_check_passes_other_kinds(line: str) -> None:
    assert not _offences(line)
