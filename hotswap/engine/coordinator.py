"""The coordinator: a torch.compile backend that answers each graph at once and compiles elsewhere.

    user thread (dynamo)            pool manager thread            loader thread (one per coordinator,
    --------------------            -------------------            while it has work: loader.py)
                                                                   -----------------------------------
    Coordinator(gm, inputs)
      a GraphJourney, the ladder's
      start points (cache first)
      source.start(tier) per tier -->  worker compiles (standalone_compile under the tier's config)
      return GraphRunner (eager)     future done ------------->   load the artifact, store it
    runner(*args) -> eager                                          ladder.offer: swap in, or
    runner(*args) -> compiled tier  <------------- atomic swap ---  measure first (gate.py)

A mode is a composition, fixed when the coordinator is made (``Options.plan``): where a tier
comes from (``TierLifecycle``: the cache or a worker; ``InProcess``: inductor here), which
tiers the ladder climbs and whether a gate stands between them (ladder.py), and whether the
first call waits for its tier. Nothing past that reads the mode. Loading takes seconds, so it
never runs on the pool's manager thread nor in the user's call (unless the call waits anyway).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from hotswap import compat
from hotswap.counting import bump
from hotswap.engine import threads
from hotswap.engine.graph import GraphRunner, TierFailed
from hotswap.engine.journey import GraphJourney, GraphStatus
from hotswap.engine.loading.loader import Loader
from hotswap.engine.logs import setup_logging
from hotswap.engine.options import Options, Tier
from hotswap.engine.policy.gate import Gate
from hotswap.engine.policy.ladder import Ladder, Measure
from hotswap.engine.recording import Recorder, profiled
from hotswap.engine.runtime import runtime
from hotswap.engine.shipping.keys import prepare_stamp
from hotswap.engine.shipping.request import (
    GraphRequest,
    count_error,
    cpu_threads,
    devices_of,
    portable_inputs,
    reason_of,
    unsaveable,
)
from hotswap.engine.shipping.transport import origin_of, ship_graph
from hotswap.engine.shipping.wire import BenchReply, BenchRequest, CompileRequest
from hotswap.engine.sources.cache_access import CacheAccess
from hotswap.engine.sources.compilers import (
    CompileFuture,
    Compiler,
    InductorLoads,
    Loads,
    RetryingCompiler,
    measure_on,
)
from hotswap.engine.sources.inprocess import InProcess
from hotswap.engine.sources.local import LocalCompiler
from hotswap.engine.sources.tiers import Arrival, TierError, TierLifecycle, TierSource
from hotswap.errors import CompileFailed, PoolClosed
from hotswap.profiles.records import GRAPH_TIER

__all__ = ["Coordinator"]


log = logging.getLogger("hotswap")

# How long a load waits for the process warm-up of its devices (warmup.py) before it goes on.
_WARMUP_WAIT_S = 60.0
_graph_ids = itertools.count(1)
F = TypeVar("F", bound=Future[Any])


class Coordinator:
    """A dynamo backend (``torch.compile(m, backend=Coordinator(options))``) and its graphs.

    ``compiler`` compiles and loads tiers (default: the runtime's worker pool); ``measure``
    runs the gate's and the profile's benchmark requests (default: a worker job). Tests pass
    fakes (hotswap.testing) to run modes, ladders and gates without inductor.
    """

    def __init__(self, options: Options, *, compiler: Compiler | None = None,
                 measure: Measure | None = None, retain_artifacts: bool = False) -> None:
        setup_logging()
        compat.watch_recompile_limits(_recompile_limit_hit)
        # Keep each graph's shipped form and artifacts once its ladder is final (to measure
        # its decisions again: hotswap.testing.audit); they are let go otherwise.
        self._retain = retain_artifacts
        self.options = options
        plan = options.plan
        self._compiler = compiler
        self._loads: Loads = compiler or InductorLoads()  # needs no pool: loads after shutdown
        self._journeys: list[GraphJourney] = []
        self._cond = threading.Condition()
        self._loader = Loader()
        self.recorder = Recorder(options.profile_dir)
        self.cache = CacheAccess(options.cache_dir, options.limit_s(), options.cache_url)
        tiers = list(options.tiers if plan.climbs else options.tiers[-1:])
        if self.recorder.profiling:  # kernels named for profilers
            tiers = [profiled(t) for t in tiers]
        gate = Gate(options.gate_threshold, {t.name: t.load_config for t in tiers})
        self.ladder = Ladder(tiers, gate=gate if plan.gated else None, force=options.force_tier,
                             recorder=self.recorder,
                             measure=measure or self._bench_in_worker,
                             on_loader=self._on_loader, cache=self.cache, notify=self._notify)
        self.inprocess = InProcess(self.cache, self.recorder, self._load_tier)
        self.source: TierSource = self.inprocess if plan.here else TierLifecycle(
            self.cache, self._job, self._load_tier, self._on_loader, self.recorder)
        self._waits = plan.waits
        # Dynamo's recompile limits hit in calls of this backend's models: (limit, function)
        # -> how often, the last hit.
        self._limit_hits: dict[tuple[str, str], tuple[int, compat.RecompileLimitHit]] = {}
        # torch._dynamo.reset() dropped every graph this backend returned (hotswap.compile
        # then gives later models a new backend).
        self.reset_by_dynamo = False
        # Jobs of this backend's graphs in a pool or cluster: a reset cancels them.
        self._jobs: set[Future[Any]] = set()
        # Artifacts that cannot travel back from a worker (local.py).
        self.local = LocalCompiler(self.recorder, self._fail)
        if not plan.here and compiler is None:
            if options.executor is None:  # warm the pool now, before the first graph arrives
                runtime.pool(options.workers, options.worker_devices)
            else:  # connect now; the local pool starts only if the cluster is refused
                runtime.cluster(options.executor)
            # The cache stamp's version lookups, off the user's first call.
            threads.start(prepare_stamp, name="hotswap-stamp")

    @property
    def compiler(self) -> Compiler:
        """What compiles and loads this coordinator's tiers now."""
        return self._compiler or runtime.compiler(self.options.workers,
                                                  self.options.worker_devices,
                                                  self.options.executor)

    # ------------------------------------------------------------------ backend entry

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> GraphRunner:
        t0 = time.monotonic()
        bump("graphs")
        compat.reset_with_dynamo(self)
        journey = self._journey(gm)
        if self.recorder.profiling:
            self.recorder.dynamo_trace(journey, t0)
            self.recorder.graph_seen(journey.graph_id, gm, example_inputs, journey.origin)
        journey.example_inputs = example_inputs  # for a compile here, in this call only
        try:
            source, waits = self._prepare(journey, gm, example_inputs, t0)
            starts = self.ladder.start_points(journey)
            if source is self.inprocess and not self._waits:
                # A graph that cannot go to a worker: its first tier compiles right here, in
                # the call (local.py says why not on a thread beside the user's calls).
                for tier, _ in starts[1:]:
                    journey.keep(tier.name, f"only {starts[0][0].name!r} compiles in this "
                                            f"process ({journey.here_because})")
                starts = starts[:1]
            for tier, cached in starts:
                arrival = source.start(journey, tier, cached=cached)
                if waits:
                    self._serve_first(journey, tier, arrival)
                else:
                    arrival.add_done_callback(functools.partial(self._arrived, journey, tier))
        finally:
            journey.example_inputs = []
        self._finish_if_final(journey)
        self._notify()
        return journey.runner

    def _journey(self, gm: torch.fx.GraphModule) -> GraphJourney:
        graph_id = f"g{next(_graph_ids)}"
        tiers = self.ladder.tiers
        runner = self.recorder.runner(graph_id, gm, [t.name for t in tiers],
                                      verify=self.options.verify)
        journey = GraphJourney(runner, gm, tiers, self.recorder,
                               raise_failures=self.options.on_failure == "raise",
                               retain=self._retain)
        journey.origin = origin_of(gm)
        with self._cond:
            self._journeys.append(journey)
        return journey

    def _prepare(self, journey: GraphJourney, gm: torch.fx.GraphModule,
                 example_inputs: list[Any], t0: float) -> tuple[TierSource, bool]:
        """The graph's cache keys and, for a worker, its shipped form; where its tiers come
        from, and whether its first call waits for one."""
        described = portable_inputs(gm, example_inputs)
        if not isinstance(described, str):  # else: no key, compiled here, not stored
            journey.inputs = described
            journey.keys = self.cache.keys(gm, described, torch.is_grad_enabled(),
                                           self.ladder.tiers, cpu_threads(described))
        if self.source is self.inprocess:
            return self.inprocess, True
        if isinstance(described, str):
            journey.here_because = described
        if journey.inputs is not None:
            try:
                graph_bytes = ship_graph(gm)
            except Exception as e:
                journey.here_because = f"this graph cannot be pickled ({type(e).__name__}: {e})"
            else:
                # The caller's grad mode decides whether AOTAutograd builds a backward graph.
                journey.request = GraphRequest(graph_bytes, journey.inputs,
                                               torch.is_grad_enabled(), cpu_threads(journey.inputs),
                                               compat.current_compile_id())
                self.recorder.span(journey, GRAPH_TIER, "serialize", t0, time.monotonic())
        if journey.request is None:
            return self.inprocess, True
        # This process's load path (warmup.py): its imports hold the GIL for a second or
        # more, so not during the call dynamo is tracing; a load that comes first starts it
        # (and waits for it) itself.
        devices = devices_of(journey.request)
        journey.runner.after_first_call = functools.partial(self._loads.warm, devices)
        return self.source, self._waits

    def _serve_first(self, journey: GraphJourney, tier: Tier, future: Future[Arrival]) -> None:
        """The call waits for the tier (``subprocess`` and ``inprocess`` modes, and graphs
        that cannot go to a worker)."""
        try:
            arrival = future.result()
        except Exception as e:
            if not self._compiled_here_instead(journey, tier, e, blocking=True):
                self._fail(journey, tier.name, _reason(e))
            return
        journey.arrived(tier.name, arrival.path)
        journey.serve_now(tier.name, arrival.fn)

    def _arrived(self, journey: GraphJourney, tier: Tier, future: Future[Arrival]) -> None:
        """Load thread: a tier is in: offer it to the ladder; or record why it is not."""
        if journey.forgotten:  # reset: whatever came, nobody serves it
            return
        error = future.exception()
        if error is None:
            arrival = future.result()
            journey.arrived(tier.name, arrival.path)
            journey.remember(tier.name, arrival.entry)
            self.ladder.offer(journey, tier.name, arrival.fn)
        elif not self._compiled_here_instead(journey, tier, error, blocking=False):
            if isinstance(error, PoolClosed):  # the interpreter is exiting: not worth a warning
                journey.fail(tier.name, reason_of(error), level=logging.DEBUG)
            else:
                self._fail(journey, tier.name, _reason(error))

    def _compiled_here_instead(self, journey: GraphJourney, tier: Tier, error: BaseException,
                               *, blocking: bool) -> bool:
        """A graph the worker compiled but inductor could not save: compile it here (local.py)."""
        count_error(error)
        if (isinstance(error, CompileFailed) and unsaveable(error)
                and journey.request is not None):
            self.local.unsaveable(journey, journey.request, tier, error.remote_message,
                                  blocking=blocking)
            return True
        return False

    def _load_tier(self, journey: GraphJourney, tier: Tier, entry: Any, stage: str) -> Any:
        """Load an entry once the process warm-up is done; timed as the tier's ``stage``.
        A graph compiled here waits for no warm-up: the compile paid for everything."""
        if journey.request is not None:
            t = time.monotonic()
            if not self._loads.warm(devices_of(journey.request), wait_s=_WARMUP_WAIT_S):
                log.info("hotswap: warm-up still running after %.0f s; loading anyway",
                         _WARMUP_WAIT_S)
            if time.monotonic() - t > 1e-3:
                self.recorder.span(journey, GRAPH_TIER, "warmup_wait", t, time.monotonic())
        t = time.monotonic()
        fn = self._loads.load(entry, tier.load_config)
        self.recorder.span(journey, tier.name, stage, t, time.monotonic())
        return fn

    def _on_loader(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run ``fn(*args)`` (``args[0]``: its graph's journey) on the load thread."""
        self._loader.submit(self._then_check, fn, args)

    def _then_check(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Loader thread: run a load/swap/gate step; then see whether its graph is final."""
        try:
            fn(*args)
        finally:
            self._finish_if_final(args[0])
            self._notify()

    def _finish_if_final(self, journey: GraphJourney) -> None:
        """Once its ladder is final, nothing will ship or measure a graph again: profiling
        runs compare its tiers; then it lets go of its shipped form and artifacts (its eager
        fallback stays with the runner)."""
        if journey.final:
            self.ladder.compare(journey)
            journey.let_go()

    def _bench_in_worker(self, request: BenchRequest) -> Future[BenchReply]:
        return measure_on(_Tracked(self.compiler, self._track), request, self.options.limit_s())

    def measure(self, request: BenchRequest) -> Future[BenchReply]:
        """Run a benchmark request where this coordinator's gate runs them."""
        return self.ladder.measure(request)

    def _job(self, journey: GraphJourney, tier: Tier) -> CompileFuture:
        """Compile ``tier`` where the compiler runs (a worker), once more if its worker dies
        under it. Only shipped graphs reach the lifecycle."""
        assert journey.request is not None
        compiler = RetryingCompiler(_Tracked(self.compiler, self._track), on_retry=_retrying)
        return compiler.submit(journey.request.compile_request(journey.graph_id, tier),
                               self.options.limit_s(tier))

    def _track(self, future: F) -> F:
        """Hold a job's future until it is done, for ``reset`` to cancel."""
        with self._cond:
            self._jobs.add(future)
        future.add_done_callback(self._untrack)
        return future

    def _untrack(self, future: Future[Any]) -> None:
        with self._cond:
            self._jobs.discard(future)

    def _fail(self, journey: GraphJourney, tier: str, reason: str) -> None:
        journey.fail(tier, reason)
        if self.options.on_failure == "raise" and self._waits and not journey.forgotten:
            raise TierFailed(journey.graph_id, tier, reason)

    # ------------------------------------------------------------------ status

    def journeys(self) -> list[GraphJourney]:
        """Every graph of this backend, in the order dynamo handed them over."""
        with self._cond:
            return list(self._journeys)

    @property
    def runners(self) -> list[GraphRunner]:
        """The callables this backend returned to dynamo, one per graph, in order."""
        with self._cond:
            return [j.runner for j in self._journeys]

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def status(self) -> list[GraphStatus]:
        with self._cond:
            journeys = list(self._journeys)
        statuses = [j.status() for j in journeys]
        note = (runtime.cpu_note(self.options.workers, self.options.worker_devices)
                if not self._waits else "")
        cache = self.cache.note
        return [dataclasses.replace(s, waiting=note if s.pending else "", cache=cache)
                for s in statuses]

    def recompile_limit_hit(self, hit: compat.RecompileLimitHit) -> None:
        """Dynamo hit a recompile limit in a call with this backend: that frame runs plain
        eager from now on, outside hotswap, and ``notes()`` says so."""
        bump("recompile_limits")
        with self._cond:
            key = (hit.limit_name, hit.function)
            self._limit_hits[key] = (self._limit_hits.get(key, (0, hit))[0] + 1, hit)

    def notes(self) -> list[str]:
        """What ``hotswap.status`` says of this backend beside its graphs."""
        with self._cond:
            hits = list(self._limit_hits.values())
        return [hit.note(times) for times, hit in hits]

    def reset(self) -> None:
        """``torch._dynamo.reset()`` (``torch.compiler.reset()``) calls it: dynamo let go of
        every graph of this backend, and so does hotswap. They leave ``status`` and waits on
        them return; their jobs are cancelled (a worker running one is replaced), loads and
        measurements under way end without a swap, and nothing of it is logged or counted
        as a failure. The pools' workers then exit once idle (``Runtime.release_idle``).
        Graphs that come later, from this backend or a new one, compile as usual."""
        with self._cond:
            self.reset_by_dynamo = True
            dropped, self._journeys = self._journeys, []
            jobs, self._jobs = list(self._jobs), set()
            self._limit_hits.clear()
            self._cond.notify_all()
        for journey in dropped:
            journey.forget()
        for job in jobs:
            job.cancel()
        if self._compiler is None:
            runtime.release_idle()

    def wait(self, timeout_s: float | None = None) -> list[GraphStatus]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not all(j.final for j in self._journeys) or not self.ladder.idle:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
        return self.status()


def _recompile_limit_hit(hit: compat.RecompileLimitHit) -> None:
    """Dynamo hit a recompile limit in a call with a Coordinator (torch.compile wraps it):
    its status notes it. (api.py sees to the other hotswap backends.)"""
    backend = getattr(hit.backend, "compiler_fn", hit.backend)
    if isinstance(backend, Coordinator):
        backend.recompile_limit_hit(hit)


class _Tracked:
    """A compiler whose every job's future goes to ``track`` (the coordinator's, for reset)."""

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


def _reason(error: BaseException) -> str:
    return str(error) if isinstance(error, TierError) else reason_of(error)


def _retrying(error: BaseException, request: CompileRequest) -> None:
    count_error(error)
    log.info("graph %s: worker died compiling %r (%s); compiling it once more",
             request.graph_id, request.tier, error)

