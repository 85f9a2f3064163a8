"""Where a tier's compile runs, and how its artifact loads here: the compiler seam.

    TierLifecycle --CompileRequest--> RetryingCompiler --> [installed wrappers] --> PoolCompiler
                  <--wire CompileResult (a future) --------------------------------  worker job
                  --load(entry, config)--> the tier's callable, in this process

A compiler makes artifacts and loads them (vLLM's ``CompilerInterface``: compile, then load
a handle): ``PoolCompiler`` sends a ``CompileRequest`` to a worker of the runtime's pool and
loads inductor's artifacts; ``RetryingCompiler`` runs a compile again when its worker died
under it (every mode compiles through one). ``hotswap.testing.FakeCompiler`` compiles nothing
and loads the graph itself, so that mode, ladder and gate tests run without inductor.
Anything else that changes how or where compiles run wraps the pool compiler:
``Runtime.wrap_compiler`` installs a wrapper (a function from a compiler to a compiler) for
every compile submitted while it is installed. hotswap.testing's faulty compiler is one, so
production code knows nothing of it; a cluster executor plugs in at the same place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any, Protocol

from hotswap.errors import WorkerCrashed
from hotswap.orchestrator.artifacts import load_entry
from hotswap.orchestrator.warmup import start_warmup, wait_warmup
from hotswap.orchestrator.wire import BENCH_JOB, COMPILE_JOB, BenchReply, BenchRequest, CompileRequest
from hotswap.workers import JobFuture, StageEvent

__all__ = ["CompileFuture", "Compiler", "InductorLoads", "Loads", "PoolCompiler",
           "RetryingCompiler", "measure_on"]


class CompileFuture(Future[Any]):
    """A compile's future: the pool's ``JobFuture``, or one that stands for several attempts
    (``stage_events`` then are the last attempt's)."""

    stage_events: list[StageEvent]


class Loads(Protocol):
    def load(self, entry: Any, config: Mapping[str, Any]) -> Any:
        """The callable of an artifact this compiler made (a packed entry), in this process."""
        ...

    def warm(self, devices: Iterable[str], wait_s: float | None = 0.0) -> bool:
        """Warm this process's load path for ``devices``; wait up to ``wait_s`` (None: until
        done) for it. False: still warming."""
        ...


class Compiler(Loads, Protocol):
    def submit(self, request: CompileRequest, timeout_s: float | None) -> JobFuture | CompileFuture:
        """Compile ``request`` somewhere; the future resolves with a wire CompileResult or one
        of the pool's errors (WorkerCrashed, JobTimeout, CompileFailed...)."""
        ...

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
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


class PoolCompiler(InductorLoads):
    """Compiles in a worker: ``submit(job, payload, timeout_s)`` puts a job in a pool (the
    runtime's, which also knows when its pool is idle)."""

    def __init__(self, submit: Callable[[str, Any, float | None], JobFuture]) -> None:
        self._submit = submit

    def submit(self, request: CompileRequest, timeout_s: float | None) -> JobFuture:
        return self.submit_job(COMPILE_JOB, request.to_wire(), timeout_s)

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
        return self._submit(job, payload, timeout_s)


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

    def load(self, entry: Any, config: Mapping[str, Any]) -> Any:
        return self._inner.load(entry, config)

    def warm(self, devices: Iterable[str], wait_s: float | None = 0.0) -> bool:
        return self._inner.warm(devices, wait_s)


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
