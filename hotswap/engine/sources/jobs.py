"""A backend's jobs where its compiler runs them: compiles, benchmarks and loads.

    compile(journey, tier)        a CompileRequest, once more if its worker dies under it
    measure(request)              a gate's or profile's BenchRequest, as a worker job
    load(journey, tier, entry)    an artifact loaded here, once the process warm-up is done
    cancel()                      every job under way (``torch.compiler.reset()``)

Every job's future is held until it is done, so that a reset can cancel it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from hotswap.engine.journey import GraphJourney
from hotswap.engine.loading import source_key
from hotswap.engine.loading.cudagraphs import CudaGraphed
from hotswap.engine.loading.per_thread import PerThread, PlanRecorder
from hotswap.engine.options import Tier
from hotswap.engine.recording import Recorder
from hotswap.engine.shipping.request import count_error, devices_of
from hotswap.engine.shipping.wire import BenchReply, BenchRequest, CompileRequest
from hotswap.engine.sources.compilers import (
    CompileFuture,
    Compiler,
    Loads,
    RetryingCompiler,
    measure_on,
)
from hotswap.profiles.records import GRAPH_TIER

__all__ = ["WorkerJobs"]

log = logging.getLogger("hotswap")

# How long a load waits for the process warm-up of its devices (warmup.py) before it goes on.
WARMUP_WAIT_S = 60.0
F = TypeVar("F", bound=Future[Any])


class WorkerJobs:
    """``compiler()`` is what compiles now (the runtime's pool or cluster, or a test's fake);
    ``loads`` loads artifacts and needs no pool, so loads go on after a shutdown."""

    def __init__(self, compiler: Callable[[], Compiler], loads: Loads, recorder: Recorder,
                 limit_s: Callable[[Tier | None], float]) -> None:
        self._compiler, self._loads = compiler, loads
        self._recorder, self._limit_s = recorder, limit_s
        self._lock = threading.Lock()
        self._jobs: set[Future[Any]] = set()

    def compile(self, journey: GraphJourney, tier: Tier, measured: bool) -> CompileFuture:
        """Only shipped graphs reach a worker. ``measured``: the gate measures the result
        once it is loaded (CompileRequest.measured)."""
        assert journey.request is not None
        compiler = RetryingCompiler(self._tracked(), on_retry=_retrying)
        request = journey.request.compile_request(journey.graph_id, tier, measured=measured)
        return compiler.submit(request, self._limit_s(tier))

    def measure(self, request: BenchRequest) -> Future[BenchReply]:
        return measure_on(self._tracked(), request, self._limit_s(None))

    def warm(self, devices: Iterable[str], wait_s: float | None = 0.0) -> bool:
        return self._loads.warm(devices, wait_s)

    def load(self, journey: GraphJourney, tier: Tier, entry: Any, stage: str) -> Any:
        """Load an entry once the process warm-up is done; timed as the tier's ``stage``.
        A graph compiled here waits for no warm-up: the compile paid for everything."""
        if journey.request is not None:
            t = time.monotonic()
            if not self._loads.warm(devices_of(journey.request), wait_s=WARMUP_WAIT_S):
                log.info("hotswap: warm-up still running after %.0f s; loading anyway",
                         WARMUP_WAIT_S)
            if time.monotonic() - t > 1e-3:
                self._recorder.span(journey, GRAPH_TIER, "warmup_wait", t, time.monotonic())
        t = time.monotonic()
        with source_key.from_worker() if stage == "load" else contextlib.nullcontext():
            fn = self._loads.load(entry, tier.load_config)  # a worker's result: its hash too
        self._recorder.span(journey, tier.name, stage, t, time.monotonic())
        first_run = journey.first_run
        if first_run is not None and not isinstance(fn, CudaGraphed):
            t = time.monotonic()
            planned = PlanRecorder()  # the plans each calling thread builds for itself
            try:  # what its first user call would pay (first_run.py), paid here
                first_run.run(fn, planned)
            except Exception as e:
                log.info("hotswap: graph %s tier %r: its first run before serving failed "
                         "(%s: %s); it serves all the same", journey.graph_id, tier.name,
                         type(e).__name__, e)
            else:
                if planned.calls:
                    fn = PerThread(fn, planned.calls)
            self._recorder.span(journey, tier.name, "first_run", t, time.monotonic())
        return fn

    def cancel(self) -> None:
        """Cancel every job under way (a worker running one is replaced)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), set()
        for job in jobs:
            job.cancel()

    def _tracked(self) -> _Tracked:
        return _Tracked(self._compiler(), self._track)

    def _track(self, future: F) -> F:
        with self._lock:
            self._jobs.add(future)
        future.add_done_callback(self._untrack)
        return future

    def _untrack(self, future: Future[Any]) -> None:
        with self._lock:
            self._jobs.discard(future)


class _Tracked:
    """A compiler whose every job's future goes to ``track``."""

    def __init__(self, inner: Compiler, track: Callable[[Any], Any]) -> None:
        self._inner, self._track = inner, track

    def submit(self, request: CompileRequest, timeout_s: float | None) -> Any:
        return self._track(self._inner.submit(request, timeout_s))

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> Any:
        return self._track(self._inner.submit_job(job, payload, timeout_s))

    def load(self, entry: Any, config: Mapping[str, Any]) -> Any:
        return self._inner.load(entry, config)

    def warm(self, devices: Iterable[str], wait_s: float | None = 0.0) -> bool:
        return self._inner.warm(devices, wait_s)


def _retrying(error: BaseException, request: CompileRequest) -> None:
    count_error(error)
    log.info("graph %s: worker died compiling %r (%s); compiling it once more",
             request.graph_id, request.tier, error)
