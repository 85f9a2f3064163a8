"""The cluster executor on a real Dask cluster on localhost (``LocalCluster``, worker
processes): compiles run there, a killed worker's compile is run again, and an unreachable or
mismatched cluster leaves the local pool compiling, with one warning."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hotswap
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options
from hotswap.executors import dask as cluster_module
from hotswap.fleet.cluster import Cluster, ClusterCompiler, LocalCluster
from hotswap.testing.fake import FakeCompiler
from tests.fleet.conftest import free_port

distributed = pytest.importorskip("distributed", reason="the fleet extra is not installed")


@pytest.fixture
def dask_cluster() -> Iterator[Any]:
    # A scheduler and two worker processes of their own (dask scheduler / dask worker); the
    # scheduler reruns a task whose worker died once, then gives up (KilledWorker).
    with LocalCluster(2, allowed_failures=1) as local:
        yield local


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 8)), torch.randn(32, 64)


@pytest.mark.slow
def test_compiles_run_on_the_cluster_and_survive_a_killed_worker(dask_cluster: Any) -> None:
    model, x = _model()
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="async", executor=dask_cluster.scheduler_address)
        torch.testing.assert_close(compiled(x), model(x))  # eager, at once
        # Kill the Dask worker the compile went to, while it has it (queued behind the
        # worker's warm-up, or running): the scheduler runs it again on the other worker.
        with distributed.Client(dask_cluster.scheduler_address) as client:
            deadline = time.monotonic() + 60
            while True:
                holders = [w for w, tasks in client.processing().items()
                           if any(str(t).startswith("run_job") for t in tasks)]
                if holders or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert holders, "the compile never reached a Dask worker"
            pid = client.run(os.getpid, workers=holders)[holders[0]]
            os.kill(pid, signal.SIGKILL)
        [status] = hotswap.wait(compiled, timeout_s=240)
        torch.testing.assert_close(compiled(x), model(x))
    assert status.tier == "default" and status.path == "worker", status
    assert d["remote_compiles"] == 1 and d["worker_compiles"] == 1
    assert d["cluster_fallbacks"] == 0  # nothing went to the local pool


def _compile_beside(cluster: Cluster) -> tuple[FakeCompiler, Any, dict[str, int]]:
    """Compile the model with ``cluster`` in front of a local (fake) compiler; its status."""
    model, x = _model()
    local = FakeCompiler()
    with hotswap.counters_delta() as d:
        coordinator = Coordinator(Options.create(mode="async"),
                                  compiler=ClusterCompiler(cluster, local))
        compiled = torch.compile(model, backend=coordinator)
        compiled(x)
        [status] = coordinator.wait(timeout_s=60)
        torch.testing.assert_close(compiled(x), model(x))
    return local, status, d


def test_an_unreachable_scheduler_leaves_the_local_pool_compiling(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cluster_module, "CONNECT_TIMEOUT_S", 1.0)
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        local, status, d = _compile_beside(Cluster(f"tcp://127.0.0.1:{free_port()}"))
    assert status.tier == "default" and [t for _, t in local.compiles] == ["default"]
    assert d["cluster_fallbacks"] == 1 and d["remote_compiles"] == 0
    assert caplog.text.count("not used") == 1
    assert "compiling in the local worker pool" in caplog.text


def test_a_cluster_of_another_build_is_refused(
        dask_cluster: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    real = cluster_module._local_stamp()
    monkeypatch.setattr(cluster_module, "_local_stamp", lambda: {**real, "torch": "9.9.9"})
    other = Cluster(dask_cluster.scheduler_address, warm=False)
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        local, status, d = _compile_beside(other)
    assert status.tier == "default" and len(local.compiles) == 1
    assert d["cluster_fallbacks"] == 1 and d["remote_compiles"] == 0
    assert "runs another build" in other.refused and "9.9.9" in other.refused
    assert caplog.text.count("not used") == 1


def test_a_worker_that_changed_build_after_connecting_sends_jobs_home(
        dask_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    joined = Cluster(dask_cluster.scheduler_address, warm=False)
    assert joined.client(timeout_s=60) is not None and joined.refused == ""
    real = cluster_module._local_stamp()
    monkeypatch.setattr(cluster_module, "_local_stamp", lambda: {**real, "python": [2, 7]})
    local, status, d = _compile_beside(joined)
    assert status.tier == "default" and len(local.compiles) == 1
    assert d["cluster_fallbacks"] == 1 and "build differs" in joined.refused


def test_cluster_jobs_fail_as_local_worker_jobs_do(dask_cluster: Any) -> None:
    """A job that raises is a CompileFailed; one past its time limit a JobTimeout; a worker
    that dies under every attempt (Dask gives up: KilledWorker) a crash, which is retried."""
    from hotswap.errors import CompileFailed, JobTimeout, WorkerCrashed

    compiler = ClusterCompiler(Cluster(dask_cluster.scheduler_address, warm=False),
                               FakeCompiler())
    assert compiler.submit_job("hotswap.testing.faults:echo", {"x": 1}, 60).result(60) == {
        "x": 1}
    with pytest.raises(CompileFailed, match="RuntimeError: boom"):
        compiler.submit_job("hotswap.testing.faults:raise_error", "boom", 60).result(60)
    with pytest.raises(JobTimeout):
        compiler.submit_job("hotswap.testing.faults:sleep", 30.0, 1.0).result(60)
    with pytest.raises(WorkerCrashed, match="KilledWorker"):
        compiler.submit_job("hotswap.testing.faults:sigkill", None, 120).result(120)
