"""Two "machines" (separate cache directories) behind one Redis fleet store, with a compiler
that compiles nothing (hotswap.testing.fake): compile-once across the fleet, a store that is
down at start or goes down mid-run, and a replica without the fleet key."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hotswap
from hotswap.cache import ArtifactCache
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options
from hotswap.engine.sources import cache_access
from hotswap.engine.sources.cache_access import CacheAccess
from hotswap.fleet import FleetStore
from hotswap.testing.fake import FakeCompiler
from tests.fleet.conftest import RedisServer, free_port

TIERS = ["default", "max-autotune"]


def _model(width: int = 16) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 4)), (torch.randn(3, 8),)


def _replica(tmp_path: Path, name: str, url: str, fake: FakeCompiler,
             model: torch.nn.Module) -> tuple[Coordinator, Any]:
    options = Options.create(mode="progressive", tiers=TIERS, gate=False,
                             cache_dir=str(tmp_path / name), cache_url=url)
    coordinator = Coordinator(options, compiler=fake, measure=fake.measure)
    return coordinator, torch.compile(model, backend=coordinator)


def _remote_keys(server: RedisServer) -> set[str]:
    return {k.decode()[len("hotswap:e:"):] for k in server.client().scan_iter("hotswap:e:*")}


def test_each_tier_compiles_once_across_machines_and_replicas(
        tmp_path: Path, redis_server: RedisServer, fleet_key: Path) -> None:
    model, inputs = _model()
    expected = model(*inputs)
    # max-autotune a second after default: each replica loads default before max-autotune
    # serves (it would keep default otherwise, and load one entry fewer from the cache)
    fakes = [FakeCompiler(hold=True, delay_s={"max-autotune": 1.0}) for _ in range(4)]
    # Two machines, two replicas each, started together: every first call is served eagerly
    # while every compile is held; then all compiles may go.
    replicas = [_replica(tmp_path, f"machine{i // 2}", redis_server.url, fake, model)
                for i, fake in enumerate(fakes)]
    with hotswap.counters_delta() as d:
        for _, compiled in replicas:
            torch.testing.assert_close(compiled(*inputs), expected)
        for fake in fakes:
            fake.release()
        statuses = [coordinator.wait(timeout_s=60) for coordinator, _ in replicas]
        for _, compiled in replicas:
            torch.testing.assert_close(compiled(*inputs), expected)
    compiled_tiers = sorted(t for fake in fakes for _, t in fake.compiles)
    assert compiled_tiers == TIERS  # each (graph, tier) once across the fleet
    assert [s.tier for [s] in statuses] == ["max-autotune"] * 4
    assert d["worker_compiles"] == 2 and d["cache_hits"] == 6
    # the other machine fetched both tiers from Redis (once, or once per replica when both
    # replicas waited on the fleet's claim); the compiler's neighbour found them on its disk
    assert 2 <= d["remote_cache_hits"] <= 4
    assert len(_remote_keys(redis_server)) == 2
    for machine in ("machine0", "machine1"):  # read through: each machine holds both now
        assert len([e for e in ArtifactCache(tmp_path / machine).entries()]) == 2


def test_a_replica_started_later_loads_from_the_fleet_without_compiling(
        tmp_path: Path, redis_server: RedisServer, fleet_key: Path) -> None:
    model, inputs = _model()
    first = FakeCompiler()
    coordinator, compiled = _replica(tmp_path, "a", redis_server.url, first, model)
    compiled(*inputs)
    coordinator.wait(timeout_s=30)
    later = FakeCompiler()
    with hotswap.counters_delta() as d:
        coordinator, compiled = _replica(tmp_path, "b", redis_server.url, later, model)
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
        [status] = coordinator.wait(timeout_s=30)
    assert later.compiles == [] and status.tier == "max-autotune"
    assert d["remote_cache_hits"] == 2 and d["worker_compiles"] == 0


def test_a_store_down_at_start_leaves_the_local_cache_serving(
        tmp_path: Path, fleet_key: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, inputs = _model()
    fake = FakeCompiler()
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="hotswap"), hotswap.counters_delta() as d:
        coordinator, compiled = _replica(tmp_path, "a", url, fake, model)
        compiled(*inputs)
        [status] = coordinator.wait(timeout_s=30)
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
    assert status.tier == "max-autotune" and sorted(t for _, t in fake.compiles) == TIERS
    assert caplog.text.count("fleet store unreachable") == 1
    assert d["fleet_store_errors"] >= 1
    assert len(ArtifactCache(tmp_path / "a").entries()) == 2  # nothing lost here
    assert "fleet store unreachable" in status.cache


def test_a_store_that_goes_down_mid_run_loses_nothing(
        tmp_path: Path, redis_server: RedisServer, fleet_key: Path,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_access, "_REMOTE_RETRY_S", 0.5)
    fake = FakeCompiler()
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        model, inputs = _model(16)
        coordinator, compiled = _replica(tmp_path, "a", redis_server.url, fake, model)
        compiled(*inputs)
        coordinator.wait(timeout_s=30)
        assert len(_remote_keys(redis_server)) == 2
        redis_server.stop()  # down mid-run: the next model compiles and serves all the same
        model, inputs = _model(32)
        coordinator, compiled = _replica(tmp_path, "a", redis_server.url, fake, model)
        compiled(*inputs)
        [status] = coordinator.wait(timeout_s=30)
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
        assert status.tier == "max-autotune"
        assert caplog.text.count("fleet store unreachable") == 1
        redis_server.start()  # back (empty: no persistence): what it missed is sent again
        model, inputs = _model(64)
        coordinator, compiled = _replica(tmp_path, "a", redis_server.url, fake, model)
        compiled(*inputs)
        coordinator.wait(timeout_s=30)
    local = {e.key for e in ArtifactCache(tmp_path / "a").entries()}
    assert len(local) == 6
    # the server came back empty: it holds the last model's entries and, sent with them, the
    # ones stored while it was down; the first model's went with the old server's memory
    assert len(_remote_keys(redis_server)) == 4 and _remote_keys(redis_server) <= local


def test_a_fleet_read_that_raises_something_unforeseen_is_a_miss_and_the_tiers_compile(
        tmp_path: Path, redis_server: RedisServer, fleet_key: Path,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def garbled(self: FleetStore, key: str) -> bytes | None:
        raise RuntimeError("reply out of step with its request")

    monkeypatch.setattr(FleetStore, "get", garbled)
    model, inputs = _model()
    fake = FakeCompiler()
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        coordinator, compiled = _replica(tmp_path, "a", redis_server.url, fake, model)
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
        [status] = coordinator.wait(timeout_s=30)
    torch.testing.assert_close(compiled(*inputs), model(*inputs))
    assert status.tier == "max-autotune"
    assert sorted(t for _, t in fake.compiles) == TIERS
    # the store read as down for a while, said once: the next tier did not ask it
    assert caplog.text.count("fleet store unreachable (RuntimeError: reply out of step") == 1


def test_without_the_fleet_key_nothing_is_read_or_written_remotely(
        tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("HOTSWAP_CACHE_KEY_FILE", raising=False)
    model, inputs = _model()
    fake = FakeCompiler()
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        coordinator, compiled = _replica(tmp_path, "a", redis_server.url, fake, model)
        compiled(*inputs)
        [status] = coordinator.wait(timeout_s=30)
    assert status.tier == "max-autotune"
    assert _remote_keys(redis_server) == set()
    assert "HOTSWAP_CACHE_KEY_FILE is not set" in caplog.text
    assert "HOTSWAP_CACHE_KEY_FILE is not set" in status.cache


def test_the_fleet_decides_each_tier_once_and_every_replica_takes_the_decision(
        tmp_path: Path, redis_server: RedisServer, fleet_key: Path) -> None:
    # Each replica's benchmark would decide otherwise (max-autotune 2x faster for one, 1.5x
    # slower for the other): whichever measures first decides for the fleet.
    model, inputs = _model()
    expected = model(*inputs)
    fakes = [FakeCompiler(hold=True, medians={"eager": 2.0, "default": 1.0,
                                              "max-autotune": 0.5 if i % 2 else 1.5})
             for i in range(4)]
    replicas = []
    for i, fake in enumerate(fakes):
        options = Options.create(mode="progressive", tiers=TIERS,
                                 cache_dir=str(tmp_path / f"m{i % 2}"), cache_url=redis_server.url)
        coordinator = Coordinator(options, compiler=fake, measure=fake.measure)
        replicas.append((coordinator, torch.compile(model, backend=coordinator)))
    for _, compiled in replicas:
        compiled(*inputs)
    for fake in fakes:
        fake.release()
    statuses = [coordinator.wait(timeout_s=60) for coordinator, _ in replicas]
    for _, compiled in replicas:
        torch.testing.assert_close(compiled(*inputs), expected)
    # One measurement per decision across the fleet (a replica that loaded max-autotune first
    # decides "default against max-autotune", another decision, also once)
    decisions = [b.pair for fake in fakes for b in fake.benches]
    assert len(decisions) == len(set(decisions)), decisions
    assert decisions.count(("default", "max-autotune")) <= 1
    assert len({s.tier for [s] in statuses}) == 1, [s.summary() for [s] in statuses]
    assert all(s.final for [s] in statuses)
    assert sorted(t for fake in fakes for _, t in fake.compiles) == TIERS


@pytest.mark.parametrize("damage", ["corrupt", "foreign"])
def test_a_bad_fleet_entry_is_refused_removed_and_compiled_again(
        tmp_path: Path, redis_server: RedisServer, fleet_key: Path, damage: str) -> None:
    model, inputs = _model()
    first = FakeCompiler()
    coordinator, compiled = _replica(tmp_path, "a", redis_server.url, first, model)
    compiled(*inputs)
    coordinator.wait(timeout_s=30)
    raw = redis_server.client()
    for name in raw.scan_iter("hotswap:e:*"):
        key = name.decode()[len("hotswap:e:"):]
        if damage == "corrupt":
            blob = raw.get(name)
            raw.set(name, blob[:-1] + bytes([blob[-1] ^ 0xFF]))
        else:  # signed by someone without the fleet's key
            foreign = FleetStore(redis_server.url, os.urandom(32), {})
            foreign.put(key, b"not yours", tier="default")
    torch._dynamo.reset()
    later = FakeCompiler()
    with hotswap.counters_delta() as d:
        coordinator, compiled = _replica(tmp_path, "b", redis_server.url, later, model)
        compiled(*inputs)
        [status] = coordinator.wait(timeout_s=30)
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
    assert sorted(t for _, t in later.compiles) == TIERS  # compiled again, both tiers
    assert d["cache_rejects"] == 2 and d["remote_cache_hits"] == 0
    assert status.tier == "max-autotune"
    # the refused entries were replaced by the new compiles' (good again)
    good = FleetStore(redis_server.url, fleet_key.read_bytes(), None)
    assert all(good.get(e.key) is not None for e in good.entries())


# Take this machine's and the fleet's claim on KEY (ttl 2 s) through the cache layer, say so,
# then hang until killed.
_HOLDER = r"""
import sys, time, torch
from hotswap.engine.sources.cache_access import CacheAccess
access = CacheAccess(sys.argv[1], None, sys.argv[2])
access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])
assert access.claim("f" * 64)
print("claimed", flush=True)
time.sleep(3600)
"""


def test_a_replica_killed_holding_a_claim_leaves_the_key_to_another_replica(
        tmp_path: Path, redis_server: RedisServer, fleet_key: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_CLAIM_TTL_S", "2")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "a"),
                               redis_server.url], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        other = CacheAccess(str(tmp_path / "b"), 60.0, redis_server.url)  # another machine
        other.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])
        assert not other.claim("f" * 64)
        holder.kill()
        holder.wait()
        t = time.monotonic()
        assert other.wait_for_holder("f" * 64)
        assert time.monotonic() - t < 10  # the dead holder's claim expired (ttl 2 s)
        assert other.claim("f" * 64)
        other.release("f" * 64)
    finally:
        holder.kill()
        holder.wait()
