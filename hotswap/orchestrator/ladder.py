"""The ladder policy: which tiers a graph climbs, where it starts, and how a tier is adopted.

    start_points(journey, cache) -> the tiers to bring in (the best one the cache holds, and
                                    those above it); tiers below it, and tiers an earlier
                                    run's gate kept out, are kept
    offer(journey, tier, fn)     -> no gate, or eager serving: swap it in by rank
         (load thread)              gated: measure serving vs tier (a worker) --> Gate.decide
                                    --> swap in, or keep out (and store the verdict);
                                    one measurement at a time per graph, the rest queue
    compare(journey)             -> profiling runs, once the graph is final: every tier vs
                                    eager, and each tier's kernels, onto the timeline

``progressive`` is a gated ladder of every tier; ``async`` and the blocking modes climb to the
top tier alone (``Ladder.of(options)``). Measurements run elsewhere (``measure``: a worker
job by default; tests hand in a fake), never in the user's process: there they would take
the GIL and the device from the calls being served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from hotswap.orchestrator.cache_access import CacheAccess
from hotswap.orchestrator.counters import bump
from hotswap.orchestrator.gate import Action, Gate, Verdict, pack_verdict, unpack_verdict
from hotswap.orchestrator.journey import Candidate, GraphJourney, TierState
from hotswap.orchestrator.options import Tier
from hotswap.orchestrator.recording import Recorder
from hotswap.orchestrator.wire import BenchReply, BenchRequest

__all__ = ["Ladder", "Measure", "OnLoader"]

_log = logging.getLogger("hotswap")

# Runs a BenchRequest somewhere (a worker, by default) and resolves with its BenchReply.
Measure = Callable[[BenchRequest], "Future[BenchReply]"]
# Runs ``fn(*args)`` on the load thread; ``args[0]`` is the graph's journey.
OnLoader = Callable[[Callable[..., None], tuple[Any, ...]], None]


class Ladder:
    """The tiers a coordinator's graphs climb, and the gate between them (None: by rank)."""

    def __init__(self, tiers: list[Tier], *, gate: Gate | None, recorder: Recorder,
                 measure: Measure, on_loader: OnLoader, cache: CacheAccess,
                 notify: Callable[[], None]) -> None:
        self.tiers = tiers
        self.gate = gate
        self._recorder, self._measure, self._on_loader = recorder, measure, on_loader
        self._cache, self._notify = cache, notify
        self._lock = threading.Lock()
        self._comparisons = 0  # profile comparisons in flight

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._comparisons == 0

    def start_points(self, journey: GraphJourney) -> list[tuple[Tier, bytes | None]]:
        """The tiers to bring in, lowest first (so the fast tier is ready first), each with the
        entry the cache already gave (or None). The best tier the cache holds is loaded; tiers
        below it are not needed at all; a tier the gate kept out in an earlier run is neither
        loaded nor compiled again."""
        best, cached = -1, None
        verdicts: dict[str, str] = {}
        if self._cache.enabled:
            for rank in range(len(self.tiers) - 1, -1, -1):
                key = journey.keys.get(self.tiers[rank].name)
                if key and self.gate is not None:
                    verdict = self._cache.verdict(key)
                    if verdict is not None:
                        verdicts[self.tiers[rank].name] = unpack_verdict(verdict)
                        continue
                cached = self._cache.get(key)
                if cached is not None:
                    best = rank
                    break
        starts: list[tuple[Tier, bytes | None]] = []
        for rank, tier in enumerate(self.tiers):
            if tier.name in verdicts:
                journey.keep(tier.name, verdicts[tier.name], on_timeline=True)
            elif rank < best:
                journey.keep(tier.name, f"tier {self.tiers[best].name!r} came from the cache")
            else:
                starts.append((tier, cached if rank == best else None))
        return starts

    # ------------------------------------------------------------------ adoption

    def offer(self, journey: GraphJourney, tier: str, fn: Any) -> None:
        """Load thread: ``tier`` is loaded; swap it in now, or once it has measured faster.
        The first compiled tier replaces eager without a benchmark (it is what the user asked
        for; eager is the fallback, not a contender)."""
        if self.gate is None or journey.runner.tier == "eager":
            journey.swap_in(tier, fn)
            return
        candidate = Candidate(tier, fn, journey.keys.get(tier))
        if journey.queue_for_gate(candidate):
            self._measure_next(journey, candidate)

    def _measure_next(self, journey: GraphJourney, candidate: Candidate) -> None:
        assert self.gate is not None
        serving = journey.runner.tier
        pair = journey.entries((serving, candidate.tier))
        request = journey.request
        if len(pair) < 2 or request is None:  # nothing to measure against
            self._settle(journey, candidate, serving, Verdict(Action.BY_ORDER))
            return
        journey.to(candidate.tier, TierState.MEASURING)
        bump("gate_benchmarks")
        bench = self.gate.request(journey.graph_id, pair, request, purpose="gate",
                                  with_graph=self._recorder.profiling)
        self._submit(bench, self._measured, journey, candidate, serving)

    def _measured(self, journey: GraphJourney, candidate: Candidate, serving: str,
                  future: Future[BenchReply], started: float) -> None:
        assert self.gate is not None
        self._recorder.span(journey, candidate.tier, "gate_bench", started, time.monotonic(),
                            track="hotswap-gate")
        error = future.exception()
        reply: BenchReply | BaseException = error if error is not None else future.result()
        if isinstance(reply, BenchReply):
            for bench in reply.benches:
                self._recorder.timeline.add(bench)
        verdict = self.gate.decide(journey.graph_id, serving, candidate.tier, reply)
        if verdict.decision is not None:
            self._recorder.timeline.add(verdict.decision)
        self._settle(journey, candidate, serving, verdict)

    def _settle(self, journey: GraphJourney, candidate: Candidate, serving: str,
                verdict: Verdict) -> None:
        """Apply one verdict, then measure the graph's next waiting candidate."""
        try:
            self._apply(journey, candidate, serving, verdict)
        finally:
            following = journey.next_for_gate()
            if following is not None:
                self._measure_next(journey, following)
            self._notify()

    def _apply(self, journey: GraphJourney, candidate: Candidate, serving: str,
               verdict: Verdict) -> None:
        if verdict.action is Action.KEEP:
            if verdict.decision is not None:
                bump("gate_kept")
                if candidate.verdict_key is not None:
                    self._cache.store_verdict(candidate.verdict_key,
                                              pack_verdict(serving, verdict.decision.reason))
            journey.keep(candidate.tier, verdict.reason, on_timeline=True)
        elif verdict.action is Action.ADOPT and journey.runner.tier == serving:
            journey.swap_in(candidate.tier, candidate.fn, measured=True)
        else:  # not measured, or the serving tier changed meanwhile (it failed): by rank
            journey.swap_in(candidate.tier, candidate.fn)

    # ------------------------------------------------------------------ profiling comparison

    def compare(self, journey: GraphJourney) -> None:
        """Profiling runs, once the graph is final: compare every loaded tier with eager and
        profile their kernels, onto the timeline (not into any decision)."""
        entries, request = journey.entries(), journey.request
        if not self._recorder.profiling or request is None or not entries:
            return
        gate = self.gate or Gate(0.0, {t.name: dict(t.config) for t in self.tiers})
        with self._lock:
            self._comparisons += 1
        bench = gate.request(journey.graph_id, entries, request, purpose="compare",
                             with_graph=True)
        self._submit(bench, self._compared, journey)

    def _compared(self, journey: GraphJourney, future: Future[BenchReply],
                  started: float) -> None:
        try:
            self._recorder.span(journey, "-", "compare_tiers", started, time.monotonic(),
                                track="hotswap-gate")
            error = future.exception()
            if error is not None:
                _log.warning("graph %s: comparing tiers failed: %s: %s", journey.graph_id,
                             type(error).__name__, error)
                return
            reply = future.result()
            for record in (*reply.benches, *reply.kernels):
                self._recorder.timeline.add(record)
            for what, why in reply.errors.items():
                _log.info("graph %s: profile of %s incomplete: %s", journey.graph_id, what, why)
        finally:
            with self._lock:
                self._comparisons -= 1
            self._notify()

    def _submit(self, bench: BenchRequest, then: Callable[..., None], *args: Any) -> None:
        """Measure ``bench``; on the load thread, ``then(*args, future, started_s)``."""
        started = time.monotonic()
        try:
            future = self._measure(bench)
        except Exception as e:  # e.g. the pool is closed: the decision still has to happen
            future = Future()
            future.set_exception(e)
        future.add_done_callback(lambda f: self._on_loader(then, (*args, f, started)))


