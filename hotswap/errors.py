"""Every exception hotswap raises or resolves a future with.

    HotswapError
    ├── PoolClosed                  submit() after shutdown(), or the pool shut down under a job
    ├── JobError                    a job that did not produce a result
    │   ├── CompileFailed           the job raised in the worker; remote traceback as __cause__
    │   ├── SerializationFailed     payload or result could not be pickled / unpickled
    │   ├── WorkerCrashed           the worker died (exit code or signal) while running the job
    │   │   └── WorkerStopped       it was stopped (SIGSTOP, Ctrl-Z) mid-job; killed like a crash
    │   ├── JobTimeout              the job ran past its timeout_s; its process tree was killed
    │   └── MemoryLimitExceeded     the worker's tree went over rss_limit_bytes; it was killed
    ├── WorkerStartFailed           workers die before they are ready; queued jobs get this
    └── WaitTimeout                 wait(..., raise_on_timeout=True) ran out with tiers pending

Bad arguments raise the builtin ``ValueError`` / ``LookupError`` at the call, never later.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ClusterWorkerLost",
    "CompileFailed",
    "HotswapError",
    "JobError",
    "JobTimeout",
    "MemoryLimitExceeded",
    "PoolClosed",
    "RemoteTraceback",
    "SerializationFailed",
    "WaitTimeout",
    "WorkerCrashed",
    "WorkerStartFailed",
    "WorkerStopped",
]


class HotswapError(Exception):
    """Root of hotswap's exceptions."""


class PoolClosed(HotswapError, RuntimeError):
    """The pool was shut down before (or while) the job could run."""


class JobError(HotswapError):
    """A job ended without a result. ``job`` is its ``"module:function"`` name."""

    def __init__(self, message: str, *, job: str = "") -> None:
        super().__init__(message)
        self.job = job


class RemoteTraceback(Exception):
    """Carries a traceback formatted in another process; shown as the ``__cause__``."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


class CompileFailed(JobError):
    """The job raised inside the worker.

    ``remote_type`` is the qualified name of the exception there, ``remote_message`` its text;
    the formatted remote traceback is attached as ``__cause__`` (a :class:`RemoteTraceback`).
    """

    def __init__(
        self, job: str, remote_type: str, remote_message: str, remote_traceback: str
    ) -> None:
        super().__init__(f"{job} raised {remote_type}: {remote_message}", job=job)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.__cause__ = RemoteTraceback(remote_traceback)


class SerializationFailed(JobError):
    """Pickling or unpickling failed.

    ``what`` is ``"payload"`` or ``"result"``; ``where`` is ``"parent"`` or ``"worker"``.
    """

    def __init__(self, job: str, what: str, where: str, detail: str) -> None:
        super().__init__(
            f"{job}: the {what} could not be (un)pickled in the {where}: {detail}", job=job
        )
        self.what = what
        self.where = where
        self.detail = detail


class WorkerCrashed(JobError):
    """The worker running the job died. ``signal_name`` is set when a signal killed it."""

    def __init__(
        self, pid: int, exitcode: int | None, signal_name: str | None, *, job: str = ""
    ) -> None:
        how = f"signal {signal_name}" if signal_name else f"exit code {exitcode}"
        super().__init__(f"worker {pid} died ({how}) while running {job or 'a job'}", job=job)
        self.pid = pid
        self.exitcode = exitcode
        self.signal_name = signal_name


class ClusterWorkerLost(WorkerCrashed):
    """A cluster job's worker, or the connection to the cluster, was lost (``how`` says
    which): a crash like any other, retried once."""

    def __init__(self, how: str, *, job: str = "") -> None:
        JobError.__init__(self, f"the cluster lost {job or 'a job'}: {how}", job=job)
        self.pid = 0
        self.exitcode = None
        self.signal_name = None


class WorkerStopped(WorkerCrashed):
    """The worker running the job was stopped (SIGSTOP, a suspended terminal job) for
    ``STARVED_AFTER_S``; its process tree was killed, as after a crash (one retry)."""

    def __init__(self, pid: int, stopped_pid: int, *, job: str = "") -> None:
        JobError.__init__(self, f"worker {pid} was stopped (process {stopped_pid}) while "
                                f"running {job or 'a job'}; it was killed and replaced", job=job)
        self.pid = pid
        self.exitcode = None
        self.signal_name = "SIGSTOP"
        self.stopped_pid = stopped_pid


class JobTimeout(JobError):
    """The job ran longer than ``timeout_s``; its worker's process tree was killed."""

    def __init__(self, timeout_s: float, pid: int, *, job: str = "") -> None:
        super().__init__(
            f"{job or 'job'} ran past its timeout of {timeout_s:g} s; worker {pid} was killed",
            job=job,
        )
        self.timeout_s = timeout_s
        self.pid = pid


class MemoryLimitExceeded(JobError):
    """The worker's process tree used more than ``rss_limit_bytes``; it was killed."""

    def __init__(self, pid: int, rss_bytes: int, rss_limit_bytes: int, *, job: str = "") -> None:
        super().__init__(
            f"worker {pid} reached {rss_bytes / 2**20:.0f} MiB RSS running {job or 'a job'}, "
            f"over its limit of {rss_limit_bytes / 2**20:.0f} MiB; it was killed",
            job=job,
        )
        self.pid = pid
        self.rss_bytes = rss_bytes
        self.rss_limit_bytes = rss_limit_bytes


class WorkerStartFailed(HotswapError):
    """Workers keep dying before they report ready; ``detail`` holds the last stderr lines."""

    def __init__(self, attempts: int, detail: str) -> None:
        super().__init__(
            f"{attempts} worker starts in a row failed before the worker was ready; "
            f"check that `python -m hotswap.workers` runs in this environment. {detail}"
        )
        self.attempts = attempts
        self.detail = detail


class WaitTimeout(HotswapError, TimeoutError):
    """``hotswap.wait(..., raise_on_timeout=True)`` ran out with tiers still pending, or their
    cache entries still being written; ``statuses`` are the graphs' statuses at that moment."""

    def __init__(self, timeout_s: float | None, statuses: list[Any]) -> None:
        pending = [s for s in statuses if not s.final]
        if not pending:
            super().__init__(f"cache entries still being written after {timeout_s:g} s")
        else:
            lines = "; ".join(s.summary() for s in pending[:5])
            more = f" (and {len(pending) - 5} more)" if len(pending) > 5 else ""
            super().__init__(f"{len(pending)} graph(s) still pending after {timeout_s:g} s: "
                             f"{lines}{more}")
        self.timeout_s = timeout_s
        self.statuses = statuses
