"""The service view: Prometheus metrics from one call, ``hotswap doctor``'s fleet checks, and
``hotswap cache --url`` on the fleet store."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest
import torch

import hotswap
from hotswap.cli import main
from hotswap.fleet import FleetStore
from tests.fleet.conftest import RedisServer, free_port

pytest.importorskip("prometheus_client", reason="the fleet extra is not installed")


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    samples = {}
    for line in text.decode().splitlines():
        if line.startswith("hotswap_"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@pytest.mark.slow
def test_metrics_show_tiers_serving_compiles_and_failures() -> None:
    port = free_port()
    server = hotswap.serve_metrics(port, addr="127.0.0.1")
    try:
        before = _scrape(port)
        compiled = hotswap.compile(lambda x: (x * 2).relu(), mode="async")
        x = torch.randn(64)
        compiled(x)
        pending = _scrape(port)
        hotswap.wait(compiled, timeout_s=240)
        after = _scrape(port)
    finally:
        server.shutdown()
    assert pending['hotswap_graphs_serving{tier="eager"}'] >= 1
    assert after['hotswap_graphs_serving{tier="default"}'] >= 1
    assert after["hotswap_tiers_pending"] == 0
    local = 'hotswap_compiles_total{where="local"}'
    assert after[local] - before.get(local, 0) == 1
    assert after['hotswap_compiles_total{where="remote"}'] == before[
        'hotswap_compiles_total{where="remote"}']
    assert 'hotswap_failures_total{reason="worker_crashes"}' in after
    assert after['hotswap_events_total{event="graphs"}'] - before[
        'hotswap_events_total{event="graphs"}'] == 1


def test_doctor_checks_the_store_and_says_when_the_cluster_is_out_of_reach(
        redis_server: RedisServer, fleet_key: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap.executors import dask as cluster

    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT_S", 1.0)
    code = main(["doctor", "--cache-url", redis_server.url,
                 "--executor", f"tcp://127.0.0.1:{free_port()}"])
    out = capsys.readouterr().out
    assert code == 1
    assert f"fleet store {redis_server.url}: reachable" in out and "round trip passed" in out
    assert "NOT usable" in out and "local pool" in out
    assert redis_server.client().dbsize() == 0  # the round trip left nothing behind


def test_doctor_says_why_the_store_cannot_be_used(
        redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOTSWAP_CACHE_KEY_FILE", raising=False)
    monkeypatch.delenv("HOTSWAP_EXECUTOR", raising=False)
    assert main(["doctor", "--cache-url", redis_server.url]) == 1
    assert "NOT usable: the fleet store signs entries" in capsys.readouterr().out


def test_cache_commands_work_on_the_fleet_store(
        redis_server: RedisServer, fleet_key: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = FleetStore(redis_server.url, fleet_key.read_bytes(), {"torch": "x"})
    store.put("ab" * 32, b"entry", tier="default", origin="forward (m.py:3)")
    redis_server.client().set("hotswap:e:" + "cd" * 32, os.urandom(64))
    assert main(["cache", "ls", "--url", redis_server.url]) == 0
    out = capsys.readouterr().out
    assert "abababababababab  default" in out and "forward (m.py:3)" in out
    assert main(["cache", "verify", "--url", redis_server.url]) == 1
    assert f"bad {'cd' * 8}" in capsys.readouterr().out
    assert main(["cache", "verify", "--remove", "--url", redis_server.url]) == 1
    assert f"removed {'cd' * 8}" in capsys.readouterr().out
    assert main(["cache", "clear", "--url", redis_server.url]) == 0
    assert redis_server.client().dbsize() == 0
