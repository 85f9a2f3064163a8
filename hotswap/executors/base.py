"""The executor contract: run a named job with a payload somewhere; a future that resolves.

    backend --submit(job, payload, timeout_s)--> RetryingExecutor --> [registry.wrap middleware]
                                                 --> FallbackExecutor(remote, local) --> a worker
            <--the job's wire result, or a pool error (a future) ------------------------

A job is named, never passed: ``"package.module:function"``, importable where it runs (a
worker of the local pool, a Dask worker, a compile service), so an executor never imports the
compile or benchmark code it runs. The names the backend sends live here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any, Protocol

from hotswap.errors import WorkerCrashed
from hotswap.workers import JobFuture, StageEvent
from hotswap.workers.inbox import resolve

__all__ = ["BENCH_JOB", "COMPILE_JOB", "ENVIRONMENT_STAMP", "MEASURED_AGAIN_HOLD_S",
           "MEASURED_HOLD_S", "MEASURES", "MEASURE_PICKLED", "WARM_COMPILE_JOB",
           "WARM_DEVICE_JOB", "WARM_OPS_JOB", "Executor", "ExecutorUnavailable", "FallbackExecutor",
           "RetryFuture", "RetryingExecutor", "hold_for"]

COMPILE_JOB = "hotswap.jobs.compile:compile_graph"
BENCH_JOB = "hotswap.jobs.bench:bench_tiers"
# The compile service runs a client's BENCH_JOB under this name (its other jobs as
# service.server.RUN_PICKLED), so that its pool knows it for a measurement.
MEASURE_PICKLED = "hotswap.service.jobs:measure_pickled"
# The jobs a pool runs ahead of the others it has queued (WorkerPool's ``measures``).
MEASURES = (BENCH_JOB, MEASURE_PICKLED)
# How long a local worker that compiled a tier the gate measures next waits for that
# measurement (WorkerPool.submit's ``hold_s``) before it takes another queued job: the caller
# loads the tier and stores its entry first, 0.8 s on the idle 2-core box.
MEASURED_HOLD_S = 3.0
# ... and one that measured a CPU graph's pair, for the gate's next measurement of the pair,
# which an undecided one asks for at once (BenchRequest.again): the gate decides in a few ms.
MEASURED_AGAIN_HOLD_S = 0.5
# A worker's warm-up steps (run with None), and what a remote worker's build is stamped with.
WARM_DEVICE_JOB = "hotswap.jobs.compile:warm_device"
WARM_COMPILE_JOB = "hotswap.jobs.compile:warm_compile"
WARM_OPS_JOB = "hotswap.jobs.compile:warm_ops"
ENVIRONMENT_STAMP = "hotswap.engine.shipping.keys:environment_stamp"


def hold_for(job: str, payload: Any) -> float:
    """WorkerPool.submit's ``hold_s`` for a job: MEASURED_HOLD_S for a compile whose result
    the gate measures (``CompileRequest.measured`` in its wire form), MEASURED_AGAIN_HOLD_S
    for a measurement the gate may repeat at once (``BenchRequest.again``), else 0."""
    flag = {COMPILE_JOB: ("measured", MEASURED_HOLD_S),
            BENCH_JOB: ("again", MEASURED_AGAIN_HOLD_S)}.get(job)
    if flag is None or not isinstance(payload, dict) or payload.get(flag[0]) is not True:
        return 0.0
    return flag[1]


class Executor(Protocol):
    """Runs a named job (``"package.module:function"``) with a payload somewhere.

    ``submit`` returns a future that always resolves: with the job's wire result, or with a
    pool error (``WorkerCrashed``, ``JobTimeout``, ``CompileFailed``, ``PoolClosed``...), or,
    from an executor that cannot take the job now (a cluster refused), ``ExecutorUnavailable``:
    run it elsewhere. ``shutdown`` fails the jobs still pending with ``PoolClosed``.
    """

    def submit(self, job: str, payload: Any, timeout_s: float | None) -> Future[Any]: ...

    def shutdown(self, wait: bool = True) -> None: ...


class ExecutorUnavailable(Exception):
    """The executor did not run the job and will not (refused, unreachable): send it to the
    next one. Never the user's error: ``FallbackExecutor`` takes it."""


class RetryFuture(Future[Any]):
    """A future that stands for several attempts (``stage_events`` then are the last's)."""

    stage_events: list[StageEvent]


class RetryingExecutor:
    """Runs a job again, ``retries`` times, when the worker died under it (a crash, a kill, a
    stopped worker: ``WorkerCrashed``): that is often the machine's doing (the OOM killer, a
    signal), not the job's. Other failures stand. ``on_retry(error, job, payload)`` is told of
    each crash that is retried."""

    def __init__(self, inner: Executor, *, retries: int = 1,
                 on_retry: Callable[[BaseException, str, Any], None] | None = None) -> None:
        self._inner, self._retries, self._on_retry = inner, retries, on_retry

    def submit(self, job: str, payload: Any, timeout_s: float | None) -> RetryFuture:
        attempts = _Attempts(self._inner, job, payload, timeout_s, self._retries, self._on_retry)
        attempts.next()
        return attempts.outer

    def shutdown(self, wait: bool = True) -> None:
        self._inner.shutdown(wait)


class _Attempts:
    """One job's attempts. Held only by the attempt under way (its future's callback): no
    reference cycle keeps the payload (a shipped graph) alive after the last one."""

    def __init__(self, inner: Executor, job: str, payload: Any, timeout_s: float | None,
                 retries: int, on_retry: Callable[[BaseException, str, Any], None] | None):
        self.inner, self.job, self.payload, self.timeout_s = inner, job, payload, timeout_s
        self.left, self.on_retry = retries, on_retry
        self.outer = RetryFuture()
        self.outer.stage_events = []

    def next(self) -> None:
        self.inner.submit(self.job, self.payload, self.timeout_s).add_done_callback(self.settle)

    def settle(self, done: Future[Any]) -> None:
        """On the pool's thread, which resolves futures holding no lock: may submit again."""
        try:
            result = done.result()
        except CancelledError:
            self.outer.cancel()
        except WorkerCrashed as e:
            if self.left > 0 and not self.outer.cancelled():
                self.left -= 1
                if self.on_retry is not None:
                    self.on_retry(e, self.job, self.payload)
                self.next()
            else:
                self.finish(done, error=e)
        except BaseException as e:
            self.finish(done, error=e)
        else:
            self.finish(done, result=result)

    def finish(self, done: Future[Any], *, result: Any = None,
               error: BaseException | None = None) -> None:
        self.outer.stage_events = list(getattr(done, "stage_events", []))
        try:
            if error is not None:
                self.outer.set_exception(error)
            else:
                self.outer.set_result(result)
        except InvalidStateError:
            pass  # cancelled by its caller meanwhile


class FallbackExecutor:
    """``primary``'s jobs, each sent to ``fallback`` instead where ``primary`` cannot take it
    (``ExecutorUnavailable``): a refused cluster leaves the local pool compiling.
    ``on_fallback(job)`` is told of each job sent on. Shutting it down leaves both executors
    running: they are shared (``registry.shutdown`` stops them)."""

    def __init__(self, primary: Executor, fallback: Executor, *,
                 on_fallback: Callable[[str], None] | None = None) -> None:
        self._primary, self._fallback, self._on_fallback = primary, fallback, on_fallback

    def submit(self, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
        outer = JobFuture(job, -1)

        def chain(done: Future[Any]) -> None:
            outer.stage_events = list(getattr(done, "stage_events", []))
            error = done.exception()
            resolve(outer, result=None if error else done.result(), error=error)

        def arrived(done: Future[Any]) -> None:
            if isinstance(done.exception(), ExecutorUnavailable):
                if self._on_fallback is not None:
                    self._on_fallback(job)
                try:
                    self._fallback.submit(job, payload, timeout_s).add_done_callback(chain)
                except BaseException as e:  # every future resolves
                    resolve(outer, error=e)
                return
            chain(done)

        inner = self._primary.submit(job, payload, timeout_s)
        inner.add_done_callback(arrived)
        return outer

    def shutdown(self, wait: bool = True) -> None:
        pass
