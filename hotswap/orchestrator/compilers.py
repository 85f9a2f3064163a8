"""Where a tier's compile runs: the compiler seam.

    Coordinator --CompileRequest--> RetryingCompiler --> [installed wrappers] --> PoolCompiler
                <--wire CompileResult (a future) ---------------------------------  worker job

``PoolCompiler`` sends a ``CompileRequest`` to a worker of the runtime's pool;
``RetryingCompiler`` runs a compile again when its worker died under it (every mode compiles
through one). Anything else that changes how or where compiles run wraps the pool compiler:
``Runtime.wrap_compiler`` installs a wrapper (a function from a compiler to a compiler) for
every compile submitted while it is installed. hotswap.testing's faulty compiler is one, so
production code knows nothing of it; a cluster executor plugs in at the same place.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any, Protocol

from hotswap.errors import WorkerCrashed
from hotswap.orchestrator.wire import COMPILE_JOB, CompileRequest
from hotswap.workers import JobFuture, StageEvent, WorkerPool

__all__ = ["CompileFuture", "Compiler", "PoolCompiler", "RetryingCompiler"]


class CompileFuture(Future[Any]):
    """A compile's future: the pool's ``JobFuture``, or one that stands for several attempts
    (``stage_events`` then are the last attempt's)."""

    stage_events: list[StageEvent]


class Compiler(Protocol):
    def submit(self, request: CompileRequest, timeout_s: float | None) -> JobFuture | CompileFuture:
        """Compile ``request`` somewhere; the future resolves with a wire CompileResult or one
        of the pool's errors (WorkerCrashed, JobTimeout, CompileFailed...)."""
        ...

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
        """Run another worker job where this compiler runs compiles."""
        ...


class PoolCompiler:
    """Compiles in a worker of ``pool``."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def submit(self, request: CompileRequest, timeout_s: float | None) -> JobFuture:
        return self.submit_job(COMPILE_JOB, request.to_wire(), timeout_s)

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
        return self.pool.submit(job, payload, timeout_s=timeout_s)


class RetryingCompiler:
    """Compiles again, ``retries`` times, when the worker died under a compile (a crash, a
    kill, a stopped worker: ``WorkerCrashed``): that is often the machine's doing (the OOM
    killer, a signal), not the graph's. Other failures stand. ``on_retry(error, request)``
    is told of each crash that is retried."""

    def __init__(self, inner: Compiler, *, retries: int = 1,
                 on_retry: Callable[[BaseException, CompileRequest], None] | None = None) -> None:
        self._inner, self._retries, self._on_retry = inner, retries, on_retry

    def submit(self, request: CompileRequest, timeout_s: float | None) -> CompileFuture:
        attempts = _Attempts(self._inner, request, timeout_s, self._retries, self._on_retry)
        attempts.next()
        return attempts.outer

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
        return self._inner.submit_job(job, payload, timeout_s)


class _Attempts:
    """One compile's attempts. Held only by the attempt under way (its future's callback):
    no reference cycle keeps the request (the shipped graph) alive after the last one."""

    def __init__(self, inner: Compiler, request: CompileRequest, timeout_s: float | None,
                 retries: int, on_retry: Callable[[BaseException, CompileRequest], None] | None):
        self.inner, self.request, self.timeout_s = inner, request, timeout_s
        self.left, self.on_retry = retries, on_retry
        self.outer = CompileFuture()
        self.outer.stage_events = []

    def next(self) -> None:
        self.inner.submit(self.request, self.timeout_s).add_done_callback(self.settle)

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
                    self.on_retry(e, self.request)
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
