"""While this process's compile workers run on the machine's cores, the graphs hotswap answers
eagerly leave them theirs: one intra-op thread fewer per running worker where the caller's
threads would fill every core (hotswap.system.cores), on the calling thread alone."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import hotswap
from hotswap.engine.graph import GraphRunner
from hotswap.engine.served import CallClock
from hotswap.system import cores
from hotswap.workers import WorkerPool

CORES = len(os.sched_getaffinity(0))
seen: list[tuple[str, int]] = []  # (thread name, its intra-op threads) as the graph ran


@torch.fx.wrap
def _note_threads(x: torch.Tensor) -> torch.Tensor:
    seen.append((threading.current_thread().name, torch.get_num_threads()))
    # A thread started during the call takes torch's count at its first parallel op
    started = threading.Thread(target=lambda: seen.append(("new", torch.get_num_threads())),
                               name="new")
    started.start()
    started.join()
    return x


def _runner() -> GraphRunner:
    return GraphRunner("g", torch.fx.symbolic_trace(lambda x: (_note_threads(x) * 2 + 1,)),
                       ["fast"])


@pytest.fixture
def every_core() -> Iterator[None]:
    """The caller's intra-op threads fill every core (torch's default), and nothing runs."""
    if CORES < 2:
        pytest.skip("one intra-op thread leaves no core to lend")
    before = torch.get_num_threads()
    torch.set_num_threads(CORES)
    seen.clear()
    yield
    torch.set_num_threads(before)
    assert cores.running() == 0  # each test forgets what it set


def test_eager_answers_lend_a_core_per_running_worker_on_their_thread_alone(
        every_core: None) -> None:
    owner, other = object(), object()
    runner = _runner()
    x = torch.arange(4.0)
    with hotswap.counters_delta() as d:
        assert torch.equal(runner(x)[0], x * 2 + 1)  # nothing running: the caller's count
        cores.set_running(owner, 1)
        assert torch.equal(runner(x)[0], x * 2 + 1)
        cores.add_running(other, CORES)  # more running than cores: one thread, not fewer
        runner(x)
        cores.add_running(other, -CORES)
        cores.set_running(owner, 0)
        runner(x)
    assert seen == [("MainThread", CORES), ("new", CORES),
                    ("MainThread", CORES - 1), ("new", CORES),
                    ("MainThread", 1), ("new", CORES),
                    ("MainThread", CORES), ("new", CORES)]
    assert torch.get_num_threads() == CORES
    assert (d["eager_calls"], d["eager_fewer_threads"]) == (4, 2)


def test_eager_calls_weighed_against_a_tier_and_a_keep_setting_use_the_caller_s_threads(
        every_core: None, monkeypatch: pytest.MonkeyPatch) -> None:
    owner = object()
    runner = _runner()
    runner.clock = CallClock()
    x = torch.arange(4.0)
    cores.set_running(owner, 1)
    try:
        runner.time_eager()  # from the next call on, eager's calls are timed
        runner(x)
        runner(x)
        monkeypatch.setenv("HOTSWAP_EAGER_THREADS", "keep")
        cores.set_running(owner, 0)
        cores.set_running(owner, 1)  # read when what runs changes
        _runner()(x)
    finally:
        cores.set_running(owner, 0)
    assert [n for name, n in seen if name == "MainThread"] == [CORES - 1, CORES, CORES]


def test_a_pool_counts_its_workers_while_they_start_and_run_jobs_and_not_once_idle() -> None:
    pool = WorkerPool(1, warm_modules=(), rss_limit_bytes=400 * 2**20)
    try:
        future = pool.submit("hotswap.testing.faults:sleep", 1.0)
        deadline = time.monotonic() + 60
        while not future.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cores.running() == 1
        future.result(timeout=60)
        deadline = time.monotonic() + 10
        while cores.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cores.running() == 0 and pool.workers_info()[0].ready  # idle, not gone
    finally:
        pool.shutdown()
    assert cores.running() == 0
