"""Prometheus metrics: names, units, labels, and a real HTTP endpoint with its token rule."""

from __future__ import annotations

import http.client
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import vramctl
from tests.fake_nvml import FakeGpu
from vramctl.monitor import AddressError, Monitor, UsageRule, _prometheus, serve_prometheus
from vramctl.monitor._prometheus import metrics_text

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
    from vramctl.monitor._http import parse_address

    with pytest.raises(AddressError):
        parse_address(text)


def _get(url: str, host: str | None = None, headers: dict[str, str] | None = None) -> int:
    """GET ``url`` (with ``Host: host`` when given); returns the status."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.putrequest("GET", parts.path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_without_a_token_only_this_machines_names_are_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A web page whose own name resolves to 127.0.0.1 (DNS rebinding) must not read it.
    monkeypatch.delenv("VRAMCTL_TOKEN", raising=False)
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    mon.sample()
    srv = serve_prometheus(mon, "127.0.0.1", 0)
    try:
        for host in ("evil.example", f"evil.example:{srv.port}", f"127.0.0.1.nip.io:{srv.port}"):
            assert _get(srv.url, host) == 403, host
        for host in (f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", "localhost", "[::1]:80"):
            assert _get(srv.url, host) == 200, host
    finally:
        srv.close()
    # Behind a token, any name is answered (a scraper on another machine).
    srv = serve_prometheus(mon, "127.0.0.1", 0, token="s3cret")
    try:
        assert _get(srv.url, "gpu-node-1:9400") == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert _get(srv.url, "gpu-node-1:9400", auth) == 200
    finally:
        srv.close()


def test_a_port_just_freed_can_be_served_again() -> None:
    # The endpoint closes each connection first, so a stopped one leaves its port in TIME_WAIT
    # for a minute: served again at once, the port is not "already in use".
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    mon.sample()
    srv = serve_prometheus(mon, "127.0.0.1", 0)
    port = srv.port
    try:
        for _ in range(3):
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            while conn.recv(65536):  # read until the server hangs up
                pass
            conn.close()
    finally:
        srv.close()
    again = serve_prometheus(mon, "127.0.0.1", port)
    again.close()


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_served_on_ipv6_loopback() -> None:
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    mon.sample()
    srv = serve_prometheus(mon, "::1", 0)
    try:
        assert srv.url.startswith("http://[::1]:")
        assert b"vramctl_" in urllib.request.urlopen(srv.url, timeout=5).read()
    finally:
        srv.close()


def test_a_silent_client_does_not_hold_a_connection(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Connections that send nothing, or half a request, are closed after a while, quietly.
    monkeypatch.setattr(_prometheus._QuietHandler, "timeout", 0.5)
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    mon.sample()
    srv = serve_prometheus(mon, "127.0.0.1", 0)
    try:
        for start in (b"", b"GET /metrics HTTP/1.1\r\n"):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as conn:
                conn.sendall(start)
                t0 = time.monotonic()
                assert conn.recv(100) == b""  # hung up on, not left waiting
                assert time.monotonic() - t0 < 5
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # and a client that goes away
        assert b"vramctl_" in urllib.request.urlopen(srv.url, timeout=5).read()
    finally:
        srv.close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_scrape_for_some_names_returns_them() -> None:
    # Prometheus's ``?name[]=`` asks for some metrics only.
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    mon.sample()
    srv = serve_prometheus(mon, "127.0.0.1", 0)
    try:
        query = "?name[]=vramctl_monitor_samples_total&name[]=vramctl_memory_total_bytes"
        text = urllib.request.urlopen(srv.url + query, timeout=5).read().decode()
    finally:
        srv.close()
    assert set(families(text)) == {"vramctl_monitor_samples_total", "vramctl_memory_total_bytes"}


def test_every_metric_is_described(gpus: list[FakeGpu]) -> None:
    # What the registry is told a scrape may hold covers every family a scrape gives (the
    # allocator's fragmentation and retries come from the same table as the others).
    sim = vramctl.simulate("T4-16GB")
    mon = Monitor(["cuda:0", sim, "cpu"], interval=1.0, rules=[UsageRule(0.001, 0.002, kind=None)])
    mon.sample()
    mon.record("guard", event="oom")
    collector = _prometheus._Collector(mon)
    described = {fam.name for fam in collector.describe()}
    collected = {fam.name for fam in collector.collect()}
    assert len(collected) >= 15
    assert collected <= described


def test_events_of_any_shape_do_not_break_a_scrape() -> None:
    # Events recorded by hand may carry anything: the labels become strings, the scrape works.
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    mon.sample()
    mon.record("guard", event="oom")
    mon.record("guard", event=None)
    mon.record("guard", event=3)
    mon.record("alert", level=2, rule=None)
    fams = families(metrics_text(mon))
    kinds = {lab["kind"]: v for lab, v in fams["vramctl_guard_events_total"]}
    assert kinds == {"oom": 1.0, "": 1.0, "3": 1.0}
    assert ({"level": "2", "rule": ""}, 1.0) in fams["vramctl_alerts_total"]
