"""Where a tier's compile runs: the compiler seam.

    Coordinator --CompileRequest--> runtime.compiler(workers) --> [wrappers] --> PoolCompiler
                <--wire CompileResult (a future) -----------------------------  worker job

``PoolCompiler`` sends a ``CompileRequest`` to a worker of the runtime's pool. Anything that
changes how or where compiles run wraps it: ``Runtime.wrap_compiler`` installs a wrapper (a
function from the compiler to a compiler) for every compile submitted while it is installed,
so hotswap.testing's faulty compiler needs nothing of it in production code, and a cluster
executor plugs in at the same place.
"""

from __future__ import annotations

from typing import Any, Protocol

from hotswap.orchestrator.wire import COMPILE_JOB, CompileRequest
from hotswap.workers import JobFuture, WorkerPool

__all__ = ["Compiler", "PoolCompiler"]


class Compiler(Protocol):
    def submit(self, request: CompileRequest, timeout_s: float | None) -> JobFuture:
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
