"""The coordinator: a torch.compile backend that answers each graph at once and compiles elsewhere.

    user thread (dynamo)            pool manager thread            scheduler thread (one per
    --------------------            -------------------            process, threads.py)
                                                                   -------------------------
    Coordinator(gm, inputs)
      a GraphJourney, the ladder's
      start points (cache first)
      source.start(tier) per tier -->  worker compiles (standalone_compile under the tier's config)
      return GraphRunner (eager)     future done ------------->   load the artifact, store it
    runner(*args) -> eager                                          ladder.offer: swap in, or
    runner(*args) -> compiled tier  <------------- atomic swap ---  measure first (gate.py)

A mode is a composition, fixed when the coordinator is made (compose.py): the route a graph's
tiers take (where they come from, whether its first call waits), which tiers the ladder climbs
and whether a gate weighs them (policy/). The coordinator reads no mode. Loading takes seconds,
so it runs on the scheduler's thread, where every change of a graph's state runs, never on
the pool's manager thread nor in the user's call (unless the call waits anyway). Its jobs go
through ``WorkerJobs`` (sources/jobs.py); its graphs' registry, status and waits are
``Graphs`` (graphs.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from hotswap import compat
from hotswap.compat import Buffer
from hotswap.counting import bump
from hotswap.engine import threads
from hotswap.engine.compose import Route, compose
from hotswap.engine.graph import GraphRunner, TierFailed
from hotswap.engine.graphs import Graphs
from hotswap.engine.journey import GraphJourney, GraphStatus, TierState
from hotswap.engine.loading.first_run import FirstRun
from hotswap.engine.logs import setup_logging
from hotswap.engine.options import Options, Tier
from hotswap.engine.policy.ladder import Ladder, Measure
from hotswap.engine.recording import Recorder
from hotswap.engine.runtime import runtime
from hotswap.engine.shipping.keys import prepare_stamp
from hotswap.engine.shipping.request import Prepared, count_error, prepare, reason_of, unsaveable
from hotswap.engine.shipping.wire import BenchReply, BenchRequest, InputMeta
from hotswap.engine.sources.cache_access import CacheAccess
from hotswap.engine.sources.compilers import Compiler, InductorLoads
from hotswap.engine.sources.jobs import WorkerJobs
from hotswap.engine.sources.local import LocalCompiler
from hotswap.engine.sources.tiers import Arrival, TierError
from hotswap.errors import CompileFailed, PoolClosed
from hotswap.profiles.records import GRAPH_TIER

__all__ = ["Coordinator"]


log = logging.getLogger("hotswap")

_graph_ids = itertools.count(1)


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
        # hotswap's background work stays off the GIL while dynamo compiles (threads.py)
        compat.on_dynamo_compiles(threads.dynamo_compiling)
        # Keep each graph's shipped form and artifacts once its ladder is final (to measure
        # its decisions again: hotswap.testing.audit); they are let go otherwise.
        self._retain = retain_artifacts
        self.options = options
        self._compiler = compiler
        self.graphs = Graphs(on_settled=self._all_final)
        self.recorder = Recorder(options.profile_dir)
        self.cache = CacheAccess(options.cache_dir, options.limit_s(), options.cache_url)
        # Loads need no pool: they go on after a shutdown.
        self.jobs = WorkerJobs(lambda: self.compiler, compiler or InductorLoads(),
                               self.recorder, options.limit_s)
        self.composition = compose(options, cache=self.cache, recorder=self.recorder,
                                   load=self.jobs.load, job=self.jobs.compile,
                                   on_loader=self._on_loader)
        self.ladder = Ladder(self.composition.tiers, gate=self.composition.gate,
                             force=options.force_tier,
                             recorder=self.recorder, measure=measure or self.jobs.measure,
                             on_loader=self._on_loader, cache=self.cache,
                             notify=self.graphs.moved, probation=self.composition.probation)
        # torch._dynamo.reset() dropped every graph this backend returned (hotswap.compile
        # then gives later models a new backend).
        self.reset_by_dynamo = False
        # Artifacts that cannot travel back from a worker (local.py).
        self.local = LocalCompiler(self.recorder, self._fail)
        if self.composition.remote and compiler is None:
            if options.executor is None:  # warm the pool now, before the first graph arrives
                runtime.pool(options.workers, options.worker_devices)
            else:  # connect now; the local pool starts only if the cluster is refused
                runtime.cluster(options.executor)
            # The cache stamp's version lookups, off the user's first call.
            threads.io.submit(prepare_stamp)

    def _all_final(self) -> None:
        """Every graph of this backend is final: a local pool warmed for it that never ran a
        job (every tier came from the cache) may stop once idle, as one whose jobs are done."""
        if self.composition.remote and self._compiler is None and self.options.executor is None:
            runtime.settled(self.options.workers, self.options.worker_devices)

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
        compat.on_dynamo_compiles(threads.dynamo_compiling)  # again after a dynamo reset
        prepared = prepare(gm, example_inputs, keys=self._keys, ship=self.composition.remote,
                           start_s=t0, cut=any(t.regions for t in self.ladder.tiers))
        journey = self._journey(gm, prepared, FirstRun.capture(gm, example_inputs))
        if self.recorder.profiling:
            self.recorder.dynamo_trace(journey, t0)
            self.recorder.graph_seen(journey.graph_id, gm, example_inputs, journey.origin)
        if prepared.shipped_s is not None:
            self.recorder.span(journey, GRAPH_TIER, "serialize", *prepared.shipped_s)
        route = self.composition.route(prepared)
        if self.composition.probation and not route.waits and prepared.weighable:
            # eager's calls timed: what its tier is weighed against as it serves
            journey.on_probation(functools.partial(self.ladder.gave_way, journey))
        if route.waits or route.first_only or not self.ladder.cached_here(journey):
            self._start(journey, route, starts=self.ladder.start_points(journey),
                        example_inputs=example_inputs)
        else:
            # The cache holds a tier: its entry is read and its signature checked off the
            # user's call (a CPU entry carries inductor's precompiled header: reading and
            # checking 156 MB took 190-250 ms of a warm restart's first call, the zoo's MLP
            # on the 2-core box), then the start points are chosen as they would be here.
            threads.io.submit(self._start_off_caller, journey, route)
        self.graphs.moved()
        return journey.runner

    def _start(self, journey: GraphJourney, route: Route,
               starts: list[tuple[Tier, Buffer | None]],
               example_inputs: Sequence[Any] = ()) -> None:
        """Bring the graph's tiers in from ``starts`` (``Ladder.start_points``). Whatever
        raises here (in the call: Ctrl-C, a first tier's failure raised as asked) fails the
        tiers it had not started, before it goes on up, rather than leaving them pending."""
        if route.first_only:
            # A graph that cannot go to a worker: its first tier compiles right here, in the
            # call (local.py says why not on a thread beside the user's calls).
            for tier, _ in starts[1:]:
                journey.keep(tier.name, f"only {starts[0][0].name!r} compiles in this "
                                        f"process ({journey.here_because})")
            starts = starts[:1]
        if self.composition.rung_last:
            starts.sort(key=lambda start: start[0].regions)  # stable: the rung after the rest
        started: set[str] = set()
        try:
            for tier, cached in starts:
                arrival = route.source.start(journey, tier, cached=cached,
                                             example_inputs=example_inputs)
                started.add(tier.name)
                if route.waits:
                    self._serve_first(journey, tier, arrival)
                else:
                    arrival.add_done_callback(functools.partial(self._arrived_here, journey, tier))
        except BaseException as e:
            reason = f"could not start: {type(e).__name__}" + (f": {e}" if str(e) else "")
            for tier, _ in starts:
                if tier.name not in started and journey.state(tier.name) is TierState.PENDING:
                    journey.fail(tier.name, reason)
            raise
        finally:
            self._finish_if_final(journey)

    def _start_off_caller(self, journey: GraphJourney, route: Route) -> None:
        """io lane: ``_start`` for a graph whose tiers the cache holds. Whatever fails here
        fails the graph's tiers not yet under way (it stays eager, the reason in its status)
        instead of leaving them pending for good."""
        try:
            if journey.forgotten:  # a reset since the call: nobody serves it
                for tier in journey.tiers:
                    journey.fail(tier.name, "reset before it started", level=logging.DEBUG)
                return
            try:
                starts = self.ladder.start_points(journey)
            except Exception as e:
                reason = f"the artifact cache could not be read: {type(e).__name__}: {e}"
                for tier in journey.tiers:
                    self._fail(journey, tier.name, reason)
                return
            with contextlib.suppress(Exception):  # _start failed what it could not start
                self._start(journey, route, starts)
        finally:
            self._finish_if_final(journey)
            self.graphs.moved()

    def _keys(self, gm: torch.fx.GraphModule, inputs: tuple[InputMeta, ...], grad: bool,
              threads: int | None) -> dict[str, str]:
        return self.cache.keys(gm, inputs, grad, self.ladder.tiers, threads)

    def _journey(self, gm: torch.fx.GraphModule, prepared: Prepared,
                 first_run: FirstRun | None = None) -> GraphJourney:
        """The graph's runner (eager until a tier swaps in) and its journey. A shipped graph's
        first call, once served, starts this process's load path (warmup.py): its imports
        hold the GIL for a second or more, so not during the call dynamo is tracing; a load
        that comes first starts it (and waits for it) itself."""
        graph_id = f"g{next(_graph_ids)}"
        # A rung compiled region by region, for the graphs that repeat a region alone.
        cut = prepared.request is not None and bool(prepared.request.regions)
        tiers = [t for t in self.ladder.tiers if cut or not t.regions]
        warm = (functools.partial(self.jobs.warm, prepared.devices)
                if prepared.request is not None else None)
        runner = self.recorder.runner(graph_id, gm, [t.name for t in tiers],
                                      verify=self.options.verify, after_first_call=warm)
        journey = GraphJourney(runner, gm, tiers, self.recorder, prepared,
                               raise_failures=self.options.on_failure == "raise",
                               retain=self._retain, first_run=first_run)
        self.graphs.add(journey)
        return journey

    def _serve_first(self, journey: GraphJourney, tier: Tier, future: Future[Arrival]) -> None:
        """The call waits for the tier (``subprocess`` and ``inprocess`` modes, and graphs
        that cannot go to a worker). Ctrl-C in the wait stops the wait, not the compile
        (it used to leave the tier pending for good): dynamo installs nothing for a call
        that raised, so the next call traces a graph of its own and this one is let go; its
        tier, kept, is stored unloaded as it arrives, and its claim released, so the next
        call's graph loads it from the cache instead of compiling it again."""
        try:
            with threads.user_waiting():  # the load it waits for runs at full speed
                arrival = future.result()
        except Exception as e:
            if not self._compiled_here_instead(journey, tier, e, blocking=True):
                self._fail(journey, tier.name, _reason(e))
            return
        except BaseException:
            journey.keep(tier.name, "the call that waited for it was interrupted")
            self.graphs.remove(journey)
            raise
        journey.arrived(tier.name, arrival.path)
        journey.serve_now(tier.name, arrival.fn)

    def _arrived_here(self, journey: GraphJourney, tier: Tier, future: Future[Arrival]) -> None:
        """A tier's future is done: ``_arrived`` on the scheduler's thread. Tiers resolve
        there (their loads run there); one that was in before its callback was attached
        would otherwise run it in the thread attaching it: the user's call, or the io lane."""
        if threads.scheduler.here():
            self._arrived(journey, tier, future)
        else:
            self._on_loader(self._arrived, (journey, tier, future))

    def _arrived(self, journey: GraphJourney, tier: Tier, future: Future[Arrival]) -> None:
        """Scheduler: a tier is in: offer it to the ladder; or record why it is not."""
        if journey.unwanted(tier.name):  # reset, or kept while it compiled: nobody serves it
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

    def _on_loader(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run ``fn(*args)`` (``args[0]``: its graph's journey) on the scheduler's thread."""
        threads.scheduler.submit(self._then_check, fn, args)

    def _then_check(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Scheduler: run a load/swap/gate step; then see whether its graph is final."""
        try:
            fn(*args)
        finally:
            self._finish_if_final(args[0])
            self.graphs.moved()

    def _finish_if_final(self, journey: GraphJourney) -> None:
        """Once its ladder is final, nothing will ship or measure a graph again: profiling
        runs compare its tiers; then it lets go of its shipped form and artifacts (its eager
        fallback stays with the runner)."""
        if not journey.final:
            return
        if not self.recorder.profiling:
            journey.let_go()
        else:
            self.ladder.compare_soon(journey)

    def measure(self, request: BenchRequest) -> Future[BenchReply]:
        """Run a benchmark request where this coordinator's gate runs them."""
        return self.ladder.measure(request)

    def _fail(self, journey: GraphJourney, tier: str, reason: str) -> None:
        journey.fail(tier, reason)
        if (self.options.on_failure == "raise" and self.composition.shipped.waits
                and not journey.forgotten):
            raise TierFailed(journey.graph_id, tier, reason)

    # ------------------------------------------------------------------ status

    def journeys(self) -> list[GraphJourney]:
        """Every graph of this backend, in the order dynamo handed them over."""
        return self.graphs.journeys()

    @property
    def runners(self) -> list[GraphRunner]:
        """The callables this backend returned to dynamo, one per graph, in order."""
        return self.graphs.runners()

    def status(self) -> list[GraphStatus]:
        statuses = [j.status() for j in self.graphs.journeys()]
        pool = (self.options.workers, self.options.worker_devices)
        note = runtime.cpu_note(*pool) if not self.composition.shipped.waits else ""
        priority = runtime.priority_note(*pool)
        cache = self.cache.note
        return [dataclasses.replace(s, waiting=note if s.pending else "", cache=cache,
                                    worker_priority=priority)
                for s in statuses]

    def recompile_limit_hit(self, hit: compat.RecompileLimitHit) -> None:
        """Dynamo hit a recompile limit in a call with this backend: that frame runs plain
        eager from now on, outside hotswap, and ``notes()`` says so."""
        self.graphs.limit_hit(hit)

    def notes(self) -> list[str]:
        """What ``hotswap.status`` says of this backend beside its graphs: recompile limits
        dynamo hit, and an executor that is not used (its jobs go to the local pool)."""
        notes = self.graphs.notes()
        if self.options.executor is not None and self._compiler is None:
            connection = runtime.cluster(self.options.executor)
            why = getattr(connection, "note", "") or getattr(connection, "refused", "")
            if why:
                notes.append(f"executor {self.options.executor} not used: {why}; compiling "
                             f"in the local pool")
        return notes

    def reset(self) -> None:
        """``torch._dynamo.reset()`` (``torch.compiler.reset()``) calls it: dynamo let go of
        every graph of this backend, and so does hotswap. They leave ``status`` and waits on
        them return; their jobs are cancelled (a worker running one is replaced), loads and
        measurements under way end without a swap, and nothing of it is logged or counted
        as a failure. The pools' workers then exit once idle (``Runtime.release_idle``).
        Graphs that come later, from this backend or a new one, compile as usual."""
        self.reset_by_dynamo = True
        threads.dynamo_compiling(False)  # the reset drops the callback that would say so
        for journey in self.graphs.drop():
            journey.forget()
        self.jobs.cancel()
        if self._compiler is None:
            runtime.release_idle()

    def wait(self, timeout_s: float | None = None) -> list[GraphStatus]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.graphs.wait(timeout_s, self._settled)
        stores = self.composition.stores
        # Entries are stored once their tier serves (sources/tiers.py), by the scheduler's
        # thread: a wait on it would wait for itself.
        if stores is not None and not threads.scheduler.here():
            stores.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.status()

    def _settled(self) -> bool:
        """Nothing measures or compares: in profiling runs, every final graph's comparison
        was queued (at the end of the step that made it final), and has run."""
        return self.ladder.idle and (not self.recorder.profiling or all(
            j.comparison_claimed for j in self.graphs.journeys() if j.final))

    def entries_written(self) -> bool:
        """Whether no cache entry of this coordinator's is still to be written."""
        stores = self.composition.stores
        return stores is None or stores.wait(0)


def _recompile_limit_hit(hit: compat.RecompileLimitHit) -> None:
    """Dynamo hit a recompile limit in a call with a Coordinator (torch.compile wraps it):
    its status notes it. (api.py sees to the other hotswap backends.)"""
    backend = getattr(hit.backend, "compiler_fn", hit.backend)
    if isinstance(backend, Coordinator):
        backend.recompile_limit_hit(hit)


def _reason(error: BaseException) -> str:
    return str(error) if isinstance(error, TierError) else reason_of(error)
