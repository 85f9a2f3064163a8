"""A service that dies or stops under a job: the job still gets its result (the local pool
runs it), the caller never hangs, and a dead service is replaced by the next job."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import hotswap
from hotswap.executors import registry
from tests.service.conftest import wait_for
from tests.service.test_lifecycle import ECHO, SLEEP, current_status


def running_service() -> dict[str, object]:
    status = current_status()
    assert status is not None
    return status


def test_killed_mid_job_the_job_runs_locally_and_a_new_service_follows(
        service_dir: Path) -> None:
    hotswap.runtime()  # installs the counters executors count in
    executor = registry.resolve("service://", workers=1)
    assert executor.submit(ECHO, "warm", 60).result(120) == "warm"
    first = running_service()
    with hotswap.counters_delta() as d:
        future = executor.submit(SLEEP, 2.0, 60)
        wait_for(lambda: running_service()["jobs_running"] == 1)
        os.killpg(int(first["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        assert future.result(120) == 2.0
    assert d["cluster_fallbacks"] == 1
    assert executor.submit(ECHO, "again", 60).result(120) == "again"
    second = running_service()
    assert second["pid"] != first["pid"] and second["jobs_served"] == 1


def test_stopped_mid_job_the_job_times_out_and_runs_locally(service_dir: Path) -> None:
    hotswap.runtime()
    executor = registry.resolve("service://", workers=1)
    assert executor.submit(ECHO, "warm", 60).result(120) == "warm"
    pid = int(running_service()["pid"])  # type: ignore[call-overload]
    link = registry.connect("service://").cluster  # type: ignore[attr-defined]
    with hotswap.counters_delta() as d:
        future = executor.submit(SLEEP, 1.0, 2.0)  # a short limit
        wait_for(lambda: running_service()["jobs_running"] == 1)
        os.kill(pid, signal.SIGSTOP)
        t = time.monotonic()
        assert future.result(120) == 1.0
        assert time.monotonic() - t < 60
        assert "stopped" in link.note or "did not answer" in link.note
        # While it stays stopped, jobs go straight to the local pool.
        t = time.monotonic()
        assert executor.submit(ECHO, "meanwhile", 60).result(60) == "meanwhile"
        assert time.monotonic() - t < 5
    assert d["cluster_fallbacks"] == 2
