"""Prometheus metrics: names, units, labels, and a real HTTP endpoint with its token rule."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import vramctl
from tests.fake_nvml import FakeGpu
from vramctl.monitor import AddressError, Monitor, UsageRule, metrics_text, serve_prometheus

MiB = 2**20


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_names_units_and_labels(gpus: list[FakeGpu]) -> None:
    gpus[0].used = 20 * 2**30
    mon = Monitor(["cuda:0", "cpu"], interval=1.0, rules=[UsageRule(0.1, 0.2, kind=None)])
    mon.sample()
    fams = families(metrics_text(mon))
    assert all(name.startswith("vramctl_") for name in fams)
    used = {lab["device"]: (lab, v) for lab, v in fams["vramctl_memory_used_bytes"]}
    assert used["cuda:0"][1] == 20 * 2**30
    assert used["cuda:0"][0]["uuid"] == gpus[0].uuid
    assert used["cpu"][0]["uuid"] == ""
    ratio = {lab["device"]: v for lab, v in fams["vramctl_memory_utilization_ratio"]}
    assert 0 <= ratio["cpu"] <= 1
    assert ratio["cuda:0"] == pytest.approx(20 * 2**30 / gpus[0].total)
    # Per-process figures carry a pid.
    procs = fams["vramctl_process_memory_bytes"]
    assert procs and all({"device", "uuid", "pid"} <= set(lab) for lab, _ in procs)
    # Counters end in _total.
    assert "vramctl_monitor_samples_total" in fams
    assert any(lab["rule"] == "memory" for lab, _ in fams["vramctl_alerts_total"])
    active = {(lab["device"], lab["level"]) for lab, _ in fams["vramctl_alerts_active"]}
    assert ("cuda:0", "critical") in active


def test_allocator_figures_of_a_simulated_gpu() -> None:
    sim = vramctl.simulate("T4-16GB")
    mon = Monitor([sim], interval=1.0, rules=[])
    with sim:
        x = torch.empty(32 * MiB, dtype=torch.uint8)
        mon.sample()
        del x
    fams = families(metrics_text(mon))
    (alloc,) = fams["vramctl_allocator_allocated_bytes"]
    assert alloc[1] == 32 * MiB
    assert alloc[0]["device"] == "sim:T4-16GB"
    assert fams["vramctl_allocator_ooms_total"][0][1] == 0


def test_a_scrape_before_any_sample_takes_one() -> None:
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    assert "vramctl_memory_total_bytes" in metrics_text(mon)
    assert mon.samples_taken == 1


def test_served_over_http_with_and_without_a_token() -> None:
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    mon.sample()
    srv = serve_prometheus(mon, "127.0.0.1", 0)
    try:
        body = urllib.request.urlopen(srv.url, timeout=5).read().decode()
        assert 'vramctl_memory_total_bytes{device="cpu"' in body
    finally:
        srv.close()

    srv = serve_prometheus(mon, "127.0.0.1", 0, token="s3cret")
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(srv.url, timeout=5)
        assert info.value.code == 401
        req = urllib.request.Request(srv.url, headers={"Authorization": "Bearer s3cret"})
        assert b"vramctl_" in urllib.request.urlopen(req, timeout=5).read()
        bad = urllib.request.Request(srv.url, headers={"Authorization": "Bearer nope"})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(bad, timeout=5)
    finally:
        srv.close()


def test_other_addresses_need_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VRAMCTL_TOKEN", raising=False)
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    with pytest.raises(AddressError, match="give a token"):
        serve_prometheus(mon, "0.0.0.0", 0)


def test_a_port_in_use_is_a_clear_error() -> None:
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(AddressError, match=f"port {port} on 127.0.0.1 is already in use"):
            serve_prometheus(mon, "127.0.0.1", port)


@pytest.mark.parametrize("text", ["abc", ":port", "host:99999"])
def test_bad_addresses(text: str) -> None:
    from vramctl.monitor import parse_address

    with pytest.raises(AddressError):
        parse_address(text)
