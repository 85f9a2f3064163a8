"""What a pool hands its callers: a ``JobFuture`` per job, a ``WorkerInfo`` per worker."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from hotswap.workers.protocol import StageEvent

__all__ = ["JobFuture", "WorkerInfo"]


class JobFuture(Future[Any]):
    """A ``concurrent.futures.Future`` for one job.

    ``cancel()`` works on a queued job and on a running one: a running job's worker is killed
    and replaced. ``stage_events`` collects the worker's StageEvents as they stream in.
    """

    def __init__(self, job: str, job_id: int) -> None:
        super().__init__()
        self.job = job
        self.job_id = job_id
        self.worker_pid: int | None = None
        self.stage_events: list[StageEvent] = []
        self._is_running = False

    def running(self) -> bool:
        return self._is_running and not self.done()

    def set_running(self) -> None:
        """The pool: a worker took the job. Not ``set_running_or_notify_cancel``: that would
        forbid ``cancel()`` of a running job, which here kills its worker."""
        self._is_running = True

    def set_queued(self) -> None:
        """The pool: the job went back to the queue (its worker was starved and replaced)."""
        self._is_running = False


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    slot: int
    pid: int
    ready: bool
    busy: bool
    started_s: float
    ready_s: float | None
    warming: bool = False            # in a warm-up step
    jobs_done: int = 0
    steps_done: tuple[str, ...] = ()  # the warm-up steps it has run (and that ran), in order
