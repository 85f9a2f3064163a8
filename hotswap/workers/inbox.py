"""What caller threads and the pool's manager thread share: the Inbox (jobs, cancellations,
subscribers, shutdown flags, the wake pipe), one Job per submit, and the pool's settings."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from hotswap.workers.future import JobFuture
from hotswap.workers.protocol import StageEvent

__all__ = ["MAX_OVERTAKEN", "Inbox", "Job", "PoolConfig", "WorkerEnv", "resolve"]

# How many measurements may go ahead of one queued job (WorkerPool's ``measures``): a gate
# that measures again and again on a busy machine (22-27 s a measurement beside a caller that
# kept both cores of the 2-core box busy) must not hold a compile back for good.
MAX_OVERTAKEN = 4

WorkerEnv = Mapping[str, str] | Callable[[int], Mapping[str, str]] | None


@dataclass(frozen=True, slots=True)
class PoolConfig:
    workers: int
    rss_limit_bytes: int | None
    worker_env: WorkerEnv
    warm_modules: list[str]
    rss_poll_s: float
    ready_timeout_s: float
    nice: int = 0
    idle: bool = False
    measures: frozenset[str] = frozenset()  # WorkerPool's ``measures``
    yield_to: str = "caller"  # WorkerPool's ``yield_to``
    warm: int = 1  # WorkerPool's ``warm``


@dataclass
class Inbox:
    """What caller threads hand the manager. Every field is guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    jobs: collections.deque[Job] = field(default_factory=collections.deque)
    cancelled: list[int] = field(default_factory=list)
    subscribers: list[Callable[[StageEvent], None]] = field(default_factory=list)
    closing: bool = False
    terminating: bool = False
    cancel_on_close: bool = False
    ready_waiters: int = 0  # callers blocked in wait_ready (prepare(wait=True))
    wake_r: int = -1
    wake_w: int = -1

    def __post_init__(self) -> None:
        self.ready_cond = threading.Condition(self.lock)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def enqueue(self, job: Job, measures: frozenset[str]) -> None:
        """Queue ``job`` (the lock held): at the end; a measurement (``measures``) after the
        measurements queued, ahead of the other jobs but those it may not pass any more
        (MAX_OVERTAKEN)."""
        if job.name not in measures:
            self.jobs.append(job)
            return
        at = 0
        for i, queued in enumerate(self.jobs):
            if queued.name in measures or queued.overtaken >= MAX_OVERTAKEN:
                at = i + 1
        for i in range(at, len(self.jobs)):
            self.jobs[i].overtaken += 1
        self.jobs.insert(at, job)

    def wanted(self) -> bool:
        """Whether anyone waits on the workers: a queued job or a caller in wait_ready. A
        worker starting while nobody waits may be starved without harm. Under ``lock``."""
        return bool(self.jobs) or self.ready_waiters > 0

    def wake(self) -> None:
        with self.lock:
            if self.wake_w < 0:
                return  # the manager has exited; nothing is listening
            with contextlib.suppress(BlockingIOError):  # full: a wake is pending anyway
                os.write(self.wake_w, b"\0")

    def close_wake_pipe(self) -> None:
        # Under the lock: a wake() racing with this must not write into a reused fd number.
        with self.lock:
            for fd in (self.wake_r, self.wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.wake_r = self.wake_w = -1

    def fail_all(self, error: BaseException) -> None:
        with self.lock:
            jobs = list(self.jobs)
            self.jobs.clear()
        for job in jobs:
            resolve(job.future, error=error)


@dataclass(slots=True)
class Job:
    job_id: int
    name: str
    data: bytes
    timeout_s: float | None
    future: JobFuture
    overtaken: int = 0  # measurements queued ahead of it since (Inbox.enqueue)
    hold_s: float = 0.0  # after its result, its worker waits this long for a measurement

    def for_held_worker(self, measures: frozenset[str]) -> bool:
        """Whether a worker held for a measurement (WorkerPool.submit's ``hold_s``) takes
        this job: a measurement, or a job measurements may not pass any more."""
        return self.name in measures or self.overtaken >= MAX_OVERTAKEN


def resolve(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve unless already done (cancelled by its caller, or raced with a late result)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
