"""Where a tier's compile runs, and how its artifact loads here: the compiler seam.

    TierLifecycle --CompileRequest--> RetryingCompiler --> ExecutorCompiler --> an executor
                  <--wire CompileResult (a future) -------------------------  (registry.resolve)
                  --load(entry, config)--> the tier's callable, in this process

A compiler makes artifacts and loads them (vLLM's ``CompilerInterface``: compile, then load
a handle): ``ExecutorCompiler`` sends a ``CompileRequest`` as a named job to an executor
(hotswap.executors: the runtime's pool, a cluster, whatever ``registry.resolve`` gives) and
loads inductor's artifacts; ``RetryingCompiler`` runs a compile again when its worker died
under it (every mode compiles through one; ``RetryingExecutor`` does the retrying).
``hotswap.testing.FakeCompiler`` compiles nothing and loads the graph itself, so that mode,
ladder and gate tests run without inductor. Anything else that changes how or where compiles
run is an executor, or middleware on one: ``hotswap.executors.registry.wrap`` installs a
wrapper (a function from an executor to an executor) for every compile submitted while it is
installed. hotswap.testing's faulty executor is one, so production code knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from hotswap.engine.loading.artifacts import load_entry
from hotswap.engine.loading.warmup import start_warmup, wait_warmup
from hotswap.engine.shipping.wire import BENCH_JOB, COMPILE_JOB, BenchReply, BenchRequest, CompileRequest
from hotswap.executors.base import Executor, RetryFuture, RetryingExecutor

__all__ = ["CompileFuture", "Compiler", "CompilerExecutor", "ExecutorCompiler", "InductorLoads",
           "Loads", "PoolCompiler", "RetryingCompiler", "measure_on"]

# A compile's future: the executor's, or one that stands for several attempts
# (``stage_events`` then are the last attempt's).
CompileFuture = RetryFuture


class Loads(Protocol):
    def load(self, entry: Any, config: Mapping[str, Any]) -> Any:
        """The callable of an artifact this compiler made (a packed entry), in this process."""
        ...

    def warm(self, devices: Iterable[str], wait_s: float | None = 0.0) -> bool:
        """Warm this process's load path for ``devices``; wait up to ``wait_s`` (None: until
        done) for it. False: still warming."""
        ...


class Compiler(Loads, Protocol):
    def submit(self, request: CompileRequest, timeout_s: float | None) -> Future[Any]:
        """Compile ``request`` somewhere; the future resolves with a wire CompileResult or one
        of the pool's errors (WorkerCrashed, JobTimeout, CompileFailed...)."""
        ...

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> Future[Any]:
        """Run another worker job where this compiler runs compiles."""
        ...


class InductorLoads:
    """Loads inductor's artifacts (packed entries: artifacts.py) in this process."""

    def load(self, entry: Any, config: Mapping[str, Any]) -> Any:
        return load_entry(entry, config)

    def warm(self, devices: Iterable[str], wait_s: float | None = 0.0) -> bool:
        """warmup.py: inductor's and the devices' one-time load costs, on a thread."""
        if wait_s == 0.0:
            start_warmup(devices)
            return False
        return wait_warmup(devices, timeout_s=wait_s)


class ExecutorCompiler(InductorLoads):
    """Compiles where ``executor`` runs jobs (the runtime's pool, a cluster...): a compile is
    the named job ``COMPILE_JOB`` with the request's wire form. Loads inductor's artifacts
    here, or as ``loads`` does."""

    def __init__(self, executor: Executor, *, loads: Loads | None = None) -> None:
        self.executor, self._loads = executor, loads

    def submit(self, request: CompileRequest, timeout_s: float | None) -> Future[Any]:
        return self.executor.submit(COMPILE_JOB, request.to_wire(), timeout_s)

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> Future[Any]:
        return self.executor.submit(job, payload, timeout_s)

    def load(self, entry: Any, config: Mapping[str, Any]) -> Any:
        return super().load(entry, config) if self._loads is None else self._loads.load(
            entry, config)

    def warm(self, devices: Iterable[str], wait_s: float | None = 0.0) -> bool:
        return super().warm(devices, wait_s) if self._loads is None else self._loads.warm(
            devices, wait_s)


# The pool's compiler: an ExecutorCompiler of the runtime's local executor.
PoolCompiler = ExecutorCompiler


class CompilerExecutor:
    """A ``Compiler`` as an ``Executor``: a compile job goes to its ``submit``, any other to
    its ``submit_job``. A payload that is a ``CompileRequest`` itself is sent as it is."""

    def __init__(self, compiler: Compiler) -> None:
        self._compiler = compiler

    def submit(self, job: str, payload: Any, timeout_s: float | None) -> Future[Any]:
        if isinstance(payload, CompileRequest):
            return self._compiler.submit(payload, timeout_s)
        if job == COMPILE_JOB:
            return self._compiler.submit(CompileRequest.from_wire(payload), timeout_s)
        return self._compiler.submit_job(job, payload, timeout_s)

    def shutdown(self, wait: bool = True) -> None:
        pass


class RetryingCompiler:
    """Compiles again, ``retries`` times, when the worker died under a compile (a crash, a
    kill, a stopped worker: ``WorkerCrashed``): that is often the machine's doing (the OOM
    killer, a signal), not the graph's. Other failures stand. ``on_retry(error, request)``
    is told of each crash that is retried."""

    def __init__(self, inner: Compiler, *, retries: int = 1,
                 on_retry: Callable[[BaseException, CompileRequest], None] | None = None) -> None:
        self._inner, self._on_retry = inner, on_retry
        self._attempts = RetryingExecutor(CompilerExecutor(inner), retries=retries,
                                          on_retry=self._retried)

    def _retried(self, error: BaseException, job: str, request: Any) -> None:
        if self._on_retry is not None:
            self._on_retry(error, request)

    def submit(self, request: CompileRequest, timeout_s: float | None) -> CompileFuture:
        # The request travels as it is: each attempt goes through the inner compiler's submit.
        return self._attempts.submit(COMPILE_JOB, request, timeout_s)

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> Future[Any]:
        return self._inner.submit_job(job, payload, timeout_s)

    def load(self, entry: Any, config: Mapping[str, Any]) -> Any:
        return self._inner.load(entry, config)

    def warm(self, devices: Iterable[str], wait_s: float | None = 0.0) -> bool:
        return self._inner.warm(devices, wait_s)


def measure_on(compiler: Compiler, request: BenchRequest,
               timeout_s: float | None) -> Future[BenchReply]:
    """Run a benchmark request as a worker job where ``compiler`` compiles."""
    job = compiler.submit_job(BENCH_JOB, request.to_wire(), timeout_s)
    reply: Future[BenchReply] = Future()

    def arrived(done: Future[Any]) -> None:
        try:
            reply.set_result(BenchReply.from_wire(done.result()))
        except BaseException as e:
            reply.set_exception(e)

    job.add_done_callback(arrived)
    return reply
