"""The compiler seam, without inductor or workers: a fake compiler stands in for the pool."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from hotswap.engine.shipping.wire import CompileRequest
from hotswap.engine.sources.compilers import RetryingCompiler
from hotswap.errors import CompileFailed, WorkerCrashed, WorkerStopped

REQUEST = CompileRequest("g1", "default", {}, b"graph", (), False)


class Scripted:
    """Answers each submit with the next outcome: an exception to fail with, else a result."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.submitted = 0

    def submit(self, request: CompileRequest, timeout_s: float | None) -> Future[Any]:
        self.submitted += 1
        future: Future[Any] = Future()
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        return future

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> Future[Any]:
        raise AssertionError("not used")


def test_a_crash_is_compiled_once_more() -> None:
    retried: list[tuple[BaseException, CompileRequest]] = []
    crash = WorkerCrashed(1, -9, "SIGKILL", job="compile")
    inner = Scripted(crash, {"tier": "default"})
    future = RetryingCompiler(inner, on_retry=lambda e, r: retried.append((e, r))).submit(
        REQUEST, 10.0)
    assert future.result(timeout=1) == {"tier": "default"}
    assert inner.submitted == 2 and retried == [(crash, REQUEST)]


def test_a_second_crash_fails_the_compile() -> None:
    inner = Scripted(WorkerStopped(1, 2), WorkerCrashed(3, None, "SIGSEGV"))
    future = RetryingCompiler(inner).submit(REQUEST, 10.0)
    with pytest.raises(WorkerCrashed, match="SIGSEGV"):
        future.result(timeout=1)
    assert inner.submitted == 2


def test_other_failures_are_not_retried() -> None:
    inner = Scripted(CompileFailed("compile", "RuntimeError", "bad graph", "tb"))
    future = RetryingCompiler(inner, retries=3).submit(REQUEST, 10.0)
    with pytest.raises(CompileFailed):
        future.result(timeout=1)
    assert inner.submitted == 1
