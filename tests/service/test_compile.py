"""Real compiles through the service (CPU, inductor): the graph reaches its tier with outputs
equal to eager, the counters show where it compiled, and a service killed mid-compile leaves
the tier to the local pool."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import hotswap
from hotswap import cli
from hotswap.executors import registry
from tests.engine.conftest import fresh_dynamo  # noqa: F401  (autouse here too)
from tests.engine.models import Blocks, unseen_scale
from tests.service.conftest import wait_for
from tests.service.test_lifecycle import current_status


class Scaled(torch.nn.Module):
    """A small MLP times a constant no inductor cache has seen: its compile really runs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 8))
        self.scale = unseen_scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


def compile_and_wait(model: torch.nn.Module, x: torch.Tensor, during: Any = None,
                     **options: Any) -> hotswap.GraphStatus:
    expected = model(x)
    compiled = hotswap.compile(model, mode="async", **options)
    torch.testing.assert_close(compiled(x), expected)
    if during is not None:
        during()
    [status] = hotswap.wait(compiled, timeout_s=300)
    torch.testing.assert_close(compiled(x), expected)
    return status


def test_service_on_compiles_in_the_service(service_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_SERVICE", "on")
    assert registry.check(None) == "service://" and registry.check("local") is None
    with hotswap.counters_delta() as d:
        status = compile_and_wait(Scaled(), torch.randn(16, 32))
    assert status.tier == "default" and status.final and not status.failures, status
    assert d["remote_compiles"] == 1 and d["worker_compiles"] == 1
    assert d["cluster_fallbacks"] == 0
    served = current_status()
    assert served is not None and served["jobs_served"] >= 1
    assert hotswap.runtime().worker_pids() == []  # no local worker was started


def test_killed_mid_compile_the_tier_still_arrives(service_dir: Path) -> None:
    def kill_when_compiling() -> None:
        wait_for(lambda: (current_status() or {}).get("jobs_running") == 1, 120)
        pid = current_status()["pid"]  # type: ignore[index]
        os.killpg(pid, signal.SIGKILL)

    with hotswap.counters_delta() as d:
        status = compile_and_wait(Scaled(), torch.randn(16, 32), during=kill_when_compiling,
                                  executor="service://")
    assert status.tier == "default" and status.final and not status.failures, status
    assert d["cluster_fallbacks"] == 1 and d["remote_compiles"] == 0
    assert d["worker_compiles"] == 1


def test_a_service_refused_is_named_in_status_and_the_tier_arrives_from_the_local_pool(
        service_dir: Path) -> None:
    service_dir.mkdir(mode=0o700)
    service_dir.chmod(0o777)  # anyone could have put a socket here: not used
    model, x = Scaled(), torch.randn(16, 32)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="async", executor="service://")
        torch.testing.assert_close(compiled(x), model(x))
        statuses = hotswap.wait(compiled, timeout_s=300)
    [status] = statuses
    assert status.tier == "default" and status.final and not status.failures, status
    assert d["remote_compiles"] == 0 and d["worker_compiles"] == 1
    [note] = statuses.notes
    assert note.startswith("executor service:// not used: ") and "local pool" in note, note
    assert str(service_dir) in note, note


def _warm_workers() -> int:
    return sum(w["warm"] for w in (current_status() or {}).get("workers", []))


def test_a_graph_compiles_in_parts_on_two_warm_workers(
        service_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_WORKERS", "2")  # auto: two parts where the service warms two
    assert cli.main(["service", "start"]) == 0
    wait_for(lambda: _warm_workers() == 2, 240)
    model, x = Blocks(depth=8).requires_grad_(False), torch.randn(4, 16)
    with hotswap.counters_delta() as d:
        status = compile_and_wait(model, x, executor="service://")
    assert status.tier == "default" and status.final and not status.failures, status
    assert d["remote_compiles"] == 1 and d["cluster_fallbacks"] == 0
    assert (d["regional_loads"], d["regional_pieces"], d["regional_compiled"]) == (1, 2, 2)
    served = current_status()
    assert served is not None and served["jobs_served"] == 1


def test_parts_off_compiles_the_whole_graph_in_the_service(
        service_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_WORKERS", "2")
    monkeypatch.setenv("HOTSWAP_PARTS", "1")
    model, x = Blocks(depth=8).requires_grad_(False), torch.randn(4, 16)
    with hotswap.counters_delta() as d:
        status = compile_and_wait(model, x, executor="service://", regions="off")
    assert status.tier == "default" and status.final and not status.failures, status
    assert d["remote_compiles"] == 1 and d["regional_loads"] == 0


class ScaledBlocks(torch.nn.Module):
    """A stack of blocks times a constant no inductor cache has seen: both parts really compile."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.scale = Blocks(depth=8).requires_grad_(False), unseen_scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) * self.scale


def test_a_worker_killed_mid_part_the_tier_still_arrives(
        service_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_WORKERS", "2")
    assert cli.main(["service", "start"]) == 0
    wait_for(lambda: _warm_workers() == 2, 240)
    killed: list[int] = []

    def kill_one_part() -> None:
        # Both parts' workers busy, or one (the other part may end first): kill a busy one.
        busy: list[int] = []

        def found() -> bool:
            workers = (current_status() or {}).get("workers", [])
            busy[:] = [w["pid"] for w in workers if w["busy"]]
            return bool(busy)
        wait_for(found, 120, step_s=0.01)
        os.kill(busy[0], signal.SIGKILL)
        killed.append(busy[0])

    with hotswap.counters_delta() as d:
        status = compile_and_wait(ScaledBlocks(), torch.randn(4, 16), during=kill_one_part,
                                  executor="service://")
    assert killed and status.tier == "default" and status.final, status
    assert not status.failures, status  # the crash was retried, in the service
    assert d["cluster_fallbacks"] == 0 and d["remote_compiles"] == 1
    served = current_status()
    assert served is not None and served["jobs_failed"] == 1 and served["jobs_served"] == 1
