"""The coordinator: a torch.compile backend that answers each graph at once and compiles elsewhere.

    user thread (dynamo)            pool manager thread            loader thread (one per coordinator)
    --------------------            -------------------            -----------------------------------
    Coordinator(gm, inputs)
      ship graph, input metadata
      cache hit? load it  ----------------------------------->   (loads the entry instead)
      submit one job per tier  -->  worker compiles (standalone_compile under the tier's config)
      return GraphRunner (eager)     future done ------------->   CompiledArtifact.load(bytes)
    runner(*args) -> eager                                          runner.swap_in(tier, artifact)
    runner(*args) -> compiled tier  <------------- atomic swap ---  (or runner.fail(tier, reason))

In ``inprocess`` mode the graph is compiled right there by inductor (inprocess.py); in
``subprocess`` mode the first call waits for the tier's lifecycle (tiers.py), which the
background modes continue on the load thread. Loading takes seconds, so it
never runs on the pool's manager thread nor in the user's call (except in ``subprocess`` mode,
where waiting is the point).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from hotswap.errors import CompileFailed, PoolClosed
from hotswap.orchestrator.artifacts import load_entry
from hotswap.orchestrator.cache_access import CacheAccess
from hotswap.orchestrator.compilers import CompileFuture, RetryingCompiler
from hotswap.orchestrator.counters import bump
from hotswap.orchestrator.gate import Gate, Measure, unpack_verdict
from hotswap.orchestrator.graph import GraphRunner, GraphStatus, TierFailed
from hotswap.orchestrator.inprocess import InProcess
from hotswap.orchestrator.keys import prepare_stamp
from hotswap.orchestrator.loader import Loader
from hotswap.orchestrator.local import LocalCompiler
from hotswap.orchestrator.options import Options, Tier
from hotswap.orchestrator.recording import PROFILE_CONFIG, Recorder
from hotswap.orchestrator.request import (
    GraphRequest,
    count_error,
    cpu_threads,
    devices_of,
    portable_inputs,
    reason_of,
    unsaveable,
)
from hotswap.orchestrator.runtime import runtime
from hotswap.orchestrator.tiers import Arrival, LoadFailed, TierLifecycle
from hotswap.orchestrator.transport import ship_graph
from hotswap.orchestrator.warmup import start_warmup, wait_warmup
from hotswap.orchestrator.wire import (
    BENCH_JOB,
    BenchReply,
    BenchRequest,
    CompileRequest,
)
from hotswap.profiles.records import GRAPH_TIER

__all__ = ["Coordinator"]


log = logging.getLogger("hotswap")

# How long a load waits for the process warm-up of its devices (warmup.py) before it goes on.
_WARMUP_WAIT_S = 60.0
_graph_ids = itertools.count(1)


class Coordinator:
    """A dynamo backend (``torch.compile(m, backend=Coordinator(options))``) and its graphs.

    ``measure`` runs the gate's and the profile's benchmark requests (default: a worker job);
    tests pass a fake to decide the gate without timing anything.
    """

    def __init__(self, options: Options, *, measure: Measure | None = None) -> None:
        self.options = options
        self.runners: list[GraphRunner] = []
        self._requests: dict[str, GraphRequest] = {}
        self._cond = threading.Condition()
        self._loader = Loader()
        self.recorder = Recorder(options.profile_dir)
        self.cache = CacheAccess(options.cache_dir, options.limit_s())
        self.tiers = TierLifecycle(self.cache, self._job, self._load_tier, self._on_loader,
                                   self.recorder)
        self.gate = Gate(enabled=options.gate and options.mode == "progressive",
                         configs={t.name: dict(t.config) for t in self._ladder(options.tiers)},
                         threshold=options.gate_threshold, recorder=self.recorder,
                         measure=measure or self._bench_in_worker,
                         run_on_loader=self._on_loader, notify=self._notify,
                         store_verdict=self.cache.store_verdict)
        self.inprocess = InProcess(self.cache, self.recorder, self._load_tier, self._fail)
        # Artifacts that cannot travel back from a worker (local.py).
        self.local = LocalCompiler(self.recorder, self._fail)
        if options.mode != "inprocess":
            runtime.pool(options.workers)  # warm the pool now, before the first graph arrives
            # The cache stamp's version lookups, off the user's first call.
            threading.Thread(target=prepare_stamp, daemon=True, name="hotswap-stamp").start()

    # ------------------------------------------------------------------ backend entry

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> GraphRunner:
        t0 = time.monotonic()
        tiers = list(self.options.tiers)
        graph_id = f"g{next(_graph_ids)}"
        bump("graphs")
        if self.options.background:
            wanted = tiers if self.options.mode == "progressive" else tiers[-1:]
        else:
            wanted = tiers[-1:]  # blocking modes compile the best tier asked for, once
        wanted = self._ladder(wanted)
        runner = self.recorder.runner(graph_id, gm, [t.name for t in wanted],
                                      verify=self.options.verify,
                                      raise_failures=self.options.on_failure == "raise")
        runner.expect(t.name for t in wanted)
        with self._cond:
            self.runners.append(runner)
        if self.recorder.profiling:
            self.recorder.dynamo_trace(runner, t0)
        if self.options.mode == "inprocess":
            self.inprocess.compile(runner, gm, example_inputs, wanted[0])
        else:
            request = self._request(gm, example_inputs)
            if isinstance(request, str):
                # It cannot go to a worker: compile its first tier right here, in the call
                # (local.py says why not on a thread beside the user's calls).
                for tier in wanted[1:]:
                    runner.keep(tier.name, f"only {wanted[0].name!r} compiles in this process "
                                           f"({request})")
                self.inprocess.compile(runner, gm, example_inputs, wanted[0],
                                        path=f"inprocess: {request}")
            else:
                self._requests[graph_id] = request
                self.recorder.span(runner, GRAPH_TIER, "serialize", t0, time.monotonic())
                keys = self.cache.keys(gm, request.inputs, request.grad_enabled, wanted,
                                       request.num_threads)
                # This process's load path (warmup.py): its imports hold the GIL for a second
                # or more, so not during the call dynamo is tracing; a load that comes first
                # starts it (and waits for it) itself.
                devices = devices_of(request)
                runner.after_first_call = lambda: start_warmup(devices)
                if self.options.mode == "subprocess":
                    self._wait_for_tier(runner, request, wanted[0], keys.get(wanted[0].name))
                else:
                    self._start_ladder(runner, request, wanted, keys)
                self._forget_if_over(runner)
        self._notify()
        return runner

    def _ladder(self, tiers: Any) -> list[Tier]:
        """The tiers as this coordinator compiles them (profiling runs name their kernels)."""
        return [_profiled(t) for t in tiers] if self.recorder.profiling else list(tiers)

    def _start_ladder(self, runner: GraphRunner, request: GraphRequest, wanted: list[Tier],
                      keys: dict[str, str]) -> None:
        """Load the best tier the cache already has; start the tiers above it (lowest first,
        so the fast tier is ready first); tiers below it are not needed at all. A tier the
        gate kept out in an earlier run is neither loaded nor compiled again."""
        best, cached = -1, None
        verdicts: dict[str, str] = {}
        if self.cache.enabled:
            for rank in range(len(wanted) - 1, -1, -1):
                key = keys.get(wanted[rank].name)
                if key and self.gate.enabled:
                    verdict = self.cache.verdict(key)
                    if verdict is not None:
                        verdicts[wanted[rank].name] = unpack_verdict(verdict)
                        continue
                cached = self.cache.get(key)
                if cached is not None:
                    best = rank
                    break
        for rank, tier in enumerate(wanted):
            if tier.name in verdicts:
                self.recorder.kept(runner, tier.name, verdicts[tier.name])
            elif rank < best:
                runner.keep(tier.name, f"tier {wanted[best].name!r} came from the cache")
            elif rank == best and cached is not None:
                self._start_tier(runner, request, tier, keys.get(tier.name), cached=cached)
            else:
                self._start_tier(runner, request, tier, keys.get(tier.name))

    def _start_tier(self, runner: GraphRunner, request: GraphRequest, tier: Tier,
                    key: str | None, cached: bytes | None = None) -> None:
        """Background modes: bring the tier in (tiers.py), then offer it to the gate, on the
        load thread."""
        arrival = self.tiers.start(runner, request, tier, key, cached=cached)
        arrival.add_done_callback(lambda f: self._arrived(runner, request, tier, key, f))

    def _wait_for_tier(self, runner: GraphRunner, request: GraphRequest, tier: Tier,
                       key: str | None) -> None:
        """Subprocess mode: the tier's lifecycle, waited for in the call."""
        try:
            arrival = self.tiers.start(runner, request, tier, key).result()
        except Exception as e:
            if not self._compiled_here_instead(runner, request, tier, e, blocking=True):
                self._fail(runner, tier.name, _reason(e))
            return
        runner.arrived(tier.name, arrival.path)
        runner.serve_now(tier.name, arrival.fn)

    def _arrived(self, runner: GraphRunner, request: GraphRequest, tier: Tier,
                 key: str | None, future: Future[Arrival]) -> None:
        """Load thread: a tier is in: offer it to the gate; or record why it is not."""
        error = future.exception()
        if error is None:
            arrival = future.result()
            runner.arrived(tier.name, arrival.path)
            self.gate.remember(runner, tier.name, arrival.entry)
            self.gate.offer(runner, tier.name, arrival.fn, request, verdict_key=key)
        elif not self._compiled_here_instead(runner, request, tier, error, blocking=False):
            if isinstance(error, PoolClosed):  # the interpreter is exiting: not worth a warning
                runner.fail(tier.name, reason_of(error), level=logging.DEBUG)
            else:
                self._fail(runner, tier.name, _reason(error))

    def _compiled_here_instead(self, runner: GraphRunner, request: GraphRequest, tier: Tier,
                               error: BaseException, *, blocking: bool) -> bool:
        """A graph the worker compiled but inductor could not save: compile it here (local.py)."""
        count_error(error)
        if isinstance(error, CompileFailed) and unsaveable(error):
            self.local.unsaveable(runner, request, tier, error.remote_message, blocking=blocking)
            return True
        return False

    def _load_tier(self, runner: GraphRunner, tier: Tier, entry: Any, stage: str) -> Any:
        """Load an entry once the process warm-up is done; timed as the tier's ``stage``."""
        self._await_warmup(runner)
        t = time.monotonic()
        fn = load_entry(entry, tier.config)
        self.recorder.span(runner, tier.name, stage, t, time.monotonic())
        return fn

    def _on_loader(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run ``fn(*args)`` (``args[0]``: its graph's runner) on the load thread."""
        self._loader.submit(self._then_check, fn, args)

    def _then_check(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Loader thread: run a load/swap/gate step; then, if its graph has nothing pending,
        let the gate finish with it (profile comparison, or forgetting its artifacts)."""
        try:
            fn(*args)
        finally:
            runner = args[0]
            if not runner.pending:
                self.gate.finished(runner, self._requests.get(runner.graph_id))
                self._forget_if_over(runner)
            self._notify()

    def _forget_if_over(self, runner: GraphRunner) -> None:
        """Once nothing is pending or measured for a graph, nothing will ship it again: drop
        its shipped form (its eager fallback stays with the runner)."""
        if not runner.pending and not self.gate.busy(runner.graph_id):
            self._requests.pop(runner.graph_id, None)

    def _bench_in_worker(self, request: BenchRequest) -> Future[BenchReply]:
        job = runtime.compiler(self.options.workers).submit_job(
            BENCH_JOB, request.to_wire(), self.options.limit_s())
        reply: Future[BenchReply] = Future()

        def arrived(done: Future[Any]) -> None:
            try:
                reply.set_result(BenchReply.from_wire(done.result()))
            except BaseException as e:
                reply.set_exception(e)

        job.add_done_callback(arrived)
        return reply

    def _request(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> GraphRequest | str:
        """The graph as compile jobs ship it, or why it cannot go to a worker."""
        described = portable_inputs(gm, example_inputs)
        if isinstance(described, str):
            return described
        try:
            graph_bytes = ship_graph(gm)
        except Exception as e:
            return f"this graph cannot be pickled ({type(e).__name__}: {e})"
        # The caller's grad mode decides whether AOTAutograd builds a backward graph.
        return GraphRequest(graph_bytes, described, torch.is_grad_enabled(), cpu_threads(described))

    # ------------------------------------------------------------------ worker jobs

    def _job(self, runner: GraphRunner, request: GraphRequest, tier: Tier) -> CompileFuture:
        """Compile ``tier`` where the runtime compiles (a worker), once more if its worker
        dies under it."""
        job = CompileRequest(runner.graph_id, tier.name, dict(tier.config), request.graph_bytes,
                             request.inputs, request.grad_enabled, request.num_threads)
        compiler = RetryingCompiler(runtime.compiler(self.options.workers), on_retry=_retrying)
        return compiler.submit(job, self.options.limit_s(tier))

    def _await_warmup(self, runner: GraphRunner) -> None:
        """Let the process warm-up of this graph's devices finish first (it does the load's
        one-time work at a lower priority; loading now would redo it, competing with the
        user's calls). The wait shows as the tier's ``warmup_wait`` stage."""
        if self.options.mode == "inprocess":
            return  # no warm-up: the compile right here paid for everything
        request = self._requests.get(runner.graph_id)
        t = time.monotonic()
        if not wait_warmup(devices_of(request) if request else (), timeout_s=_WARMUP_WAIT_S):
            log.info("hotswap: warm-up still running after %.0f s; loading anyway",
                     _WARMUP_WAIT_S)
        if time.monotonic() - t > 1e-3:
            self.recorder.span(runner, GRAPH_TIER, "warmup_wait", t, time.monotonic())

    def _fail(self, runner: GraphRunner, tier: str, reason: str) -> None:
        runner.fail(tier, reason)
        if self.options.on_failure == "raise" and not self.options.background:
            raise TierFailed(runner.graph_id, tier, reason)

    # ------------------------------------------------------------------ status

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def status(self) -> list[GraphStatus]:
        with self._cond:
            runners = list(self.runners)
        statuses = [r.status() for r in runners]
        note = runtime.cpu_note(self.options.workers) if self.options.background else ""
        cache = self.cache.note
        return [dataclasses.replace(s, waiting=note if s.pending else "", cache=cache)
                for s in statuses]

    def wait(self, timeout_s: float | None = None) -> list[GraphStatus]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while any(r.pending for r in self.runners) or not self.gate.idle:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
        return self.status()


def _reason(error: BaseException) -> str:
    return str(error) if isinstance(error, LoadFailed) else reason_of(error)


def _retrying(error: BaseException, request: CompileRequest) -> None:
    count_error(error)
    log.info("graph %s: worker died compiling %r (%s); compiling it once more",
             request.graph_id, request.tier, error)


def _profiled(tier: Tier) -> Tier:
    """The tier as profiling runs compile it: kernels named for profilers (keys this torch has)."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    extra = {k: v for k, v in PROFILE_CONFIG.items() if k in known and k not in tier.config}
    return Tier(tier.name, {**tier.config, **extra})
