"""A worker held for a measurement (``WorkerPool.submit``'s ``hold_s``): the measurement of
what its last job made runs before a job queued meanwhile, the hold ends by itself, and the
local pool holds only where the gate measures next."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from hotswap.workers import WorkerPool
from hotswap.workers.future import JobFuture
from hotswap.workers.inbox import Inbox, Job, PoolConfig
from hotswap.workers.manager import Manager

J = "tests.workers.jobs:"


@contextlib.contextmanager
def _compiled_then_queued(log: Path, hold_s: float) -> Iterator[tuple[WorkerPool, JobFuture]]:
    """A job whose worker is held for its measurement (``hold_s``), its result in, and a job
    queued while it ran."""
    with WorkerPool(1, warm_modules=(), measures=[J + "measured"]) as pool:
        assert pool.wait_ready(60)
        compiled = pool.submit(J + "note", (str(log), "compiled"), hold_s=hold_s)
        queued = pool.submit(J + "note", (str(log), "queued"))
        compiled.result(timeout=90)
        yield pool, queued


def test_a_held_worker_takes_the_measurement_of_its_result_before_a_job_queued_meanwhile(
        tmp_path: Path) -> None:
    """``submit(..., hold_s=)``: after the job's result its worker waits for a measurement,
    which then runs before the job queued while the first one ran; without the hold the worker
    takes that job at once."""
    log = tmp_path / "order"
    with _compiled_then_queued(log, hold_s=60.0) as (pool, queued):
        time.sleep(0.5)  # the caller loads what the job made, then measures it
        pool.submit(J + "measured", (str(log), "measured")).result(timeout=90)
        queued.result(timeout=90)
    assert log.read_text().split() == ["compiled", "measured", "queued"]


def test_a_hold_no_measurement_follows_ends_by_itself(tmp_path: Path) -> None:
    log = tmp_path / "order"
    with _compiled_then_queued(log, hold_s=1.0) as (pool, queued):
        done = time.monotonic()
        queued.result(timeout=30)
        assert time.monotonic() - done >= 0.8  # it waited out the hold, then ran
        for bad in (-1.0, float("inf"), float("nan"), 3600.0):
            with pytest.raises(ValueError, match="hold_s"):
                pool.submit(J + "note", (str(log), "x"), hold_s=bad)
    assert log.read_text().split() == ["compiled", "queued"]


def test_the_local_pool_holds_a_worker_only_where_the_gate_measures_next() -> None:
    from hotswap.executors.base import (
        BENCH_JOB,
        COMPILE_JOB,
        MEASURED_AGAIN_HOLD_S,
        MEASURED_HOLD_S,
        hold_for,
    )

    assert hold_for(COMPILE_JOB, {"measured": True}) == MEASURED_HOLD_S > 0
    assert hold_for(COMPILE_JOB, {"measured": False}) == hold_for(COMPILE_JOB, {}) == 0.0
    # ... or after a measurement the gate may repeat at once (a CPU graph's)
    assert hold_for(BENCH_JOB, {"again": True}) == MEASURED_AGAIN_HOLD_S > 0
    assert hold_for(BENCH_JOB, {"measured": True}) == hold_for(BENCH_JOB, {}) == 0.0


def _manager(workers: int, *held_s: float) -> Manager:
    """A manager of ``workers`` stand-in workers, ready and idle, the i-th held for
    ``held_s[i]`` more seconds (0: not held); jobs "m" are measurements."""
    config = PoolConfig(workers, None, None, [], 1.0, 60.0, measures=frozenset({"m"}))
    manager = Manager(Inbox(), config, lambda: None)
    now = time.monotonic()
    for slot in range(workers):
        hold = held_s[slot] if slot < len(held_s) else 0.0
        manager.workers[slot + 1] = SimpleNamespace(  # type: ignore[assignment]
            pid=slot + 1, slot=slot, ready=True, job=None, kill_reason=None, started_s=now,
            ready_s=now, job_started_s=now, jobs_done=1, deadline_s=None,
            held_until=now + hold if hold else 0.0, warming=False, send=lambda *parts: None)
    return manager


def _queue(manager: Manager, *names: str) -> list[JobFuture]:
    futures = [JobFuture(name, i) for i, name in enumerate(names)]
    for i, (name, future) in enumerate(zip(names, futures, strict=True)):
        manager.inbox.enqueue(Job(i, name, b"", None, future), manager.config.measures)
    return futures


def test_a_measurement_goes_to_the_held_worker_and_leaves_the_other_free() -> None:
    manager = _manager(2, 0.0, 60.0)  # slot 0 free, slot 1 held
    try:
        _queue(manager, "m")
        manager._dispatch()
        _queue(manager, "c")
        manager._dispatch()
        running = {w.slot: w.job.name for w in manager.workers.values() if w.job is not None}
        assert running == {1: "m", 0: "c"} and not manager.inbox.jobs
    finally:
        manager.inbox.close_wake_pipe()


def test_a_held_worker_leaves_a_compile_queued_and_the_manager_wakes_when_the_hold_ends() -> None:
    manager = _manager(1, 30.0)
    try:
        _queue(manager, "c")
        manager._dispatch()
        assert [job.name for job in manager.inbox.jobs] == ["c"]
        timeout = manager._next_timeout()
        assert timeout is not None and 29.0 < timeout <= 30.0
    finally:
        manager.inbox.close_wake_pipe()


def test_a_job_cancelled_while_queued_does_not_leave_the_next_one_waiting() -> None:
    manager = _manager(1)
    try:
        cancelled, _ = _queue(manager, "c1", "c2")
        assert cancelled.cancel()
        manager._dispatch()
        [worker] = manager.workers.values()
        assert worker.job is not None and worker.job.name == "c2" and not manager.inbox.jobs
    finally:
        manager.inbox.close_wake_pipe()
