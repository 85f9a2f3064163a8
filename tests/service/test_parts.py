"""The future of a job the service splits into parts (service/parts.py): it resolves once
every part has, fails at the first part that fails (the rest cancelled), and cancels them all."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from hotswap.errors import WorkerCrashed
from hotswap.executors.base import WARM_COMPILE_JOB, WARM_DEVICE_JOB
from hotswap.service.parts import RUN_PART, PartsFuture, submit_parts
from hotswap.service.server import parts_for
from hotswap.workers import WorkerInfo


class Recording:
    """An executor that keeps what it is sent and hands back futures the test resolves."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []
        self.futures: list[Future[Any]] = []

    def submit(self, job: str, payload: Any, timeout_s: float | None) -> Future[Any]:
        self.sent.append((job, payload))
        self.futures.append(Future())
        return self.futures[-1]

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_each_part_is_a_job_and_the_future_waits_for_all() -> None:
    executor = Recording()
    out = submit_parts(executor, "compile", b"payload", 5.0, 3)
    assert executor.sent == [(RUN_PART, ("compile", b"payload", i, 3)) for i in range(3)]
    executor.futures[2].set_result({"entry": b"2"})
    executor.futures[0].set_result({"entry": b"0"})
    assert not out.done()
    executor.futures[1].set_result({"entry": b"1"})
    assert out.result() == [{"entry": b"0"}, {"entry": b"1"}, {"entry": b"2"}]


def test_a_part_that_fails_fails_the_job_and_cancels_the_queued_rest() -> None:
    executor = Recording()
    out = submit_parts(executor, "compile", b"payload", None, 3)
    executor.futures[1].set_running_or_notify_cancel()  # on a worker: left to end (a cancel
    error = WorkerCrashed(123, -9, "SIGKILL")            # would kill a warm worker)
    executor.futures[0].set_exception(error)
    assert out.exception() is error
    assert not executor.futures[1].cancelled() and executor.futures[2].cancelled()
    executor.futures[1].set_result({"entry": b"1"})  # its end changes nothing
    assert out.exception() is error


def test_cancelling_the_job_cancels_its_parts() -> None:
    executor = Recording()
    out = submit_parts(executor, "compile", b"payload", None, 2)
    assert out.cancel() and out.cancelled()
    assert all(f.cancelled() for f in executor.futures)


def test_the_merge_of_parts_that_do_not_make_a_graph_raises() -> None:
    out = PartsFuture([])
    out.set_result([{"entry": b"not an entry"}])
    with pytest.raises(ValueError, match="not a hotswap artifact entry"):
        out.merged()


def _worker(*, ready: bool = True, busy: bool = False, warming: bool = False, jobs: int = 0,
            steps: tuple[str, ...] = (WARM_DEVICE_JOB, WARM_COMPILE_JOB)) -> WorkerInfo:
    return WorkerInfo(0, 1, ready, busy, 0.0, 0.0, warming, jobs, steps)


def test_a_job_is_split_only_across_warm_free_workers() -> None:
    warm = _worker()
    assert parts_for(2, [warm, warm]) == 2
    assert parts_for(3, [warm, warm]) == 2  # no part waits for a worker
    assert parts_for(2, [warm, _worker(steps=(), jobs=1)]) == 2  # a job warmed it
    for cold in (_worker(ready=False, steps=()),  # still starting
                 _worker(steps=(WARM_DEVICE_JOB,), warming=True),  # in its warm-up
                 _worker(steps=(WARM_DEVICE_JOB,)),  # no compile yet: a first one's costs
                 _worker(warming=True),  # in a later step (the op families)
                 _worker(busy=True)):  # another process's job
        assert parts_for(2, [warm, cold]) == 1, cold
    assert parts_for(2, []) == 1
    assert parts_for(2, [warm, warm, warm], queued=1) == 2  # a job sent, on no worker yet
    assert parts_for(2, [warm, warm], queued=1) == 1
