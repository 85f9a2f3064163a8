"""The ladder policy: which tiers a graph climbs, where it starts, and how a tier is adopted.

    start_points(journey, cache) -> the tiers to bring in (the best one the cache holds, and
                                    those above it); tiers below it, and tiers an earlier
                                    run's gate kept out, are kept
    offer(journey, tier, fn)     -> no gate, or eager serving: swap it in by rank
         (load thread)              gated: measure serving vs tier (a worker) --> gate.decide,
                                    once per reply --> swap in, keep out (and store the
                                    verdict), or measure again on a timer; one measurement
                                    at a time per graph, the rest queue. With a fleet store,
                                    one replica measures each decision (fleet_vote.py)
    compare(journey)             -> profiling runs, once the graph is final: every tier vs
                                    eager, and each tier's kernels, onto the timeline

``progressive`` is a gated ladder of every tier; ``async`` and the blocking modes climb to the
top tier alone (``Ladder.of(options)``). Measurements run elsewhere (``measure``: a worker
job by default; tests hand in a fake), never in the user's process: there they would take
the GIL and the device from the calls being served.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from hotswap.counting import bump
from hotswap.engine import threads
from hotswap.engine.journey import Candidate, GraphJourney, TierState
from hotswap.engine.options import Tier
from hotswap.engine.policy.fleet_vote import FleetVote, Taken, Turn
from hotswap.engine.policy.gate import (
    EAGER,
    HELD_SUFFIX,
    Action,
    Decision,
    Gate,
    Measurement,
    StoredVerdict,
    decide,
    pack_verdict,
    verdict_label,
)
from hotswap.engine.recording import Recorder
from hotswap.engine.shipping.wire import BenchReply, BenchRequest
from hotswap.engine.sources.cache_access import CacheAccess
from hotswap.profiles.records import GateDecision

__all__ = ["Ladder", "Measure", "OnLoader"]

_log = logging.getLogger("hotswap")

# Runs a BenchRequest somewhere (a worker, by default) and resolves with its BenchReply.
Measure = Callable[[BenchRequest], "Future[BenchReply]"]
# Runs ``fn(*args)`` on the load thread; ``args[0]`` is the graph's journey.
OnLoader = Callable[[Callable[..., None], tuple[Any, ...]], None]



class Ladder:
    """The tiers a coordinator's graphs climb, and the gate between them (None: by rank).
    ``force``: a tier adopted as soon as it is ready, unmeasured, that nothing replaces."""

    def __init__(self, tiers: list[Tier], *, gate: Gate | None, recorder: Recorder,
                 measure: Measure, on_loader: OnLoader, cache: CacheAccess,
                 notify: Callable[[], None], force: str | None = None) -> None:
        self.tiers = tiers
        self.gate = gate
        self.force = force
        self._recorder, self._measure, self._on_loader = recorder, measure, on_loader
        self._cache, self._notify = cache, notify
        self._lock = threading.Lock()
        self._comparisons = 0  # profile comparisons in flight
        self._vote = FleetVote(cache)

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._comparisons == 0

    def start_points(self, journey: GraphJourney) -> list[tuple[Tier, bytes | None]]:
        """The tiers to bring in, lowest first (so the fast tier is ready first), each with the
        entry the cache already gave (or None). The best tier the cache holds is loaded; tiers
        below it are not needed at all; a tier the gate confidently kept out in an earlier run
        is neither loaded nor compiled again (one kept with low confidence is measured again)."""
        best, cached = -1, None
        verdicts: dict[str, str] = {}
        again: dict[str, bytes | None] = {}  # low-confidence verdicts: measured again
        if self._cache.enabled:
            for rank in range(len(self.tiers) - 1, -1, -1):
                name = self.tiers[rank].name
                key = journey.keys.get(name)
                if key and self.gate is not None and name != self.force:
                    data = self._cache.verdict(key)
                    stored = StoredVerdict.unpack(data) if data is not None else None
                    if stored is not None and stored.confident:
                        verdicts[name] = stored.reason
                        continue
                    if stored is not None:  # not a start point: it must beat what serves
                        bump("gate_remeasured")
                        again[name] = self._cache.get(key)
                        continue
                cached = self._cache.get(key)
                if cached is not None:
                    best = rank
                    break
        starts: list[tuple[Tier, bytes | None]] = []
        for rank, tier in enumerate(self.tiers):
            if tier.name in verdicts:
                journey.keep(tier.name, verdicts[tier.name], on_timeline=True)
            elif tier.name in again:
                starts.append((tier, again[tier.name]))
            elif rank < best:
                journey.keep(tier.name, f"tier {self.tiers[best].name!r} came from the cache")
            else:
                starts.append((tier, cached if rank == best else None))
        return starts

    # ------------------------------------------------------------------ adoption

    def offer(self, journey: GraphJourney, tier: str, fn: Any) -> None:
        """Load thread: ``tier`` is loaded; swap it in now, or once it has measured faster.
        Compiled code replacing eager is not held back behind a benchmark: it swaps in, and
        (gated ladders) is then measured against eager, which serves again if the tier is
        surely slower."""
        if tier == self.force:
            journey.swap_in(tier, fn, measured=True)
            return
        if self.force is not None and journey.runner.tier == self.force:
            journey.keep(tier, f"tier {self.force!r} is forced (force_tier)")
            return
        if self.gate is None:
            journey.swap_in(tier, fn)
            return
        candidate = Candidate(tier, fn, journey.keys.get(tier))
        if journey.queue_for_gate(candidate):
            self._measure_next(journey, candidate)

    def _measure_next(self, journey: GraphJourney, candidate: Candidate) -> None:
        assert self.gate is not None
        if journey.forgotten:  # reset: nothing is measured for it any more
            return
        serving = journey.runner.tier
        if serving == EAGER:
            if candidate.tier == EAGER:  # the tier to check failed meanwhile
                self._settle(journey, candidate, serving, None)
                return
            journey.swap_in(candidate.tier, candidate.fn)
            if journey.runner.tier != candidate.tier or self._held_before(candidate.verdict_key):
                self._settle(journey, candidate, serving, None)
                return
            serving = candidate.tier
            candidate = Candidate(EAGER, None, candidate.verdict_key)
        if self._cache.shared and self._fleet_settles(journey, candidate, serving):
            return
        request = journey.request
        tiers = (serving,) if candidate.tier == EAGER else (serving, candidate.tier)
        entries = journey.entries(tiers)
        if len(entries) < len(tiers) or request is None:  # nothing to measure against
            self._settle(journey, candidate, serving, Decision(Action.BY_ORDER))
            return
        if candidate.tier == EAGER:
            bump("eager_checks")
        else:
            if journey.state(candidate.tier) is not TierState.MEASURING:
                journey.to(candidate.tier, TierState.MEASURING)
            bump("gate_benchmarks")
        bench = self.gate.request(journey.graph_id, entries, request, purpose="gate",
                                  with_graph=candidate.tier == EAGER or self._recorder.profiling,
                                  pair=(serving, candidate.tier), attempt=candidate.attempt)
        self._submit(bench, self._measured, journey, candidate, serving)

    def _measured(self, journey: GraphJourney, candidate: Candidate, serving: str,
                  future: Future[BenchReply], started: float) -> None:
        """Load thread: one gate decision per measurement reply, then apply it (or measure
        the pair again later)."""
        assert self.gate is not None
        if journey.forgotten:
            return
        track_tier = serving if candidate.tier == EAGER else candidate.tier
        self._recorder.span(journey, track_tier, "gate_bench", started, time.monotonic(),
                            track="hotswap-gate")
        error = future.exception()
        reply: BenchReply | BaseException = error if error is not None else future.result()
        if isinstance(reply, BenchReply):
            for record in (*reply.benches, *reply.pairs):
                self._recorder.timeline.add(record)
        else:
            then = (f"{serving!r} keeps serving" if candidate.tier == EAGER
                    else "adopting it by ladder order")
            _log.warning("graph %s: benchmarking %r against %r failed (%s: %s); %s",
                         journey.graph_id, candidate.tier, serving, type(reply).__name__, reply,
                         then)
        decision = decide(Measurement(journey.graph_id, serving, candidate.tier, reply),
                          attempt=candidate.attempt, contended=candidate.contended,
                          threshold=self.gate.threshold, now_s=time.monotonic())
        if decision.record is not None:
            self._recorder.timeline.add(decision.record)
        retry = decision.retry
        if retry is not None:
            bump("gate_undecided")
            _log.debug("graph %s: %s; measuring again in %.0f s", journey.graph_id,
                       decision.reason, retry.after_s)
            again = dataclasses.replace(candidate, attempt=retry.attempt,
                                        contended=retry.contended)
            threads.start_timer(retry.after_s, self._on_loader, (self._measure_next, (journey, again)),
                                name="hotswap-gate-retry")
            return
        if decision.action is Action.ADOPT:
            _log.info("graph %s: gate adopts %r: %s", journey.graph_id, candidate.tier,
                      decision.reason)
        self._settle(journey, candidate, serving, decision)

    def _fleet_settles(self, journey: GraphJourney, candidate: Candidate, serving: str) -> bool:
        """True when another replica's verdict settled ``candidate``, or when one is measuring
        it now (then looked for again shortly, on a timer: the load thread never waits).
        False: this replica measures it."""
        turn = self._vote.turn(journey, candidate, serving)
        if turn is Turn.MEASURE:
            return False
        if turn is Turn.WAIT:
            threads.start_timer(FleetVote.POLL_S, self._on_loader,
                                (self._measure_next, (journey, candidate)), name="hotswap-fleet-poll")
            return True
        self._take(journey, candidate, serving, turn)
        return True

    def _take(self, journey: GraphJourney, candidate: Candidate, serving: str,
              taken: Taken) -> None:
        """Apply another replica's verdict on this decision."""
        if candidate.tier == EAGER:
            if taken.won and journey.back_to_eager(serving, taken.reason):
                bump("gate_kept")  # slower than eager, as another replica measured
        elif not taken.won:
            journey.keep(candidate.tier, taken.reason, on_timeline=True)
        elif journey.runner.tier == serving:
            journey.swap_in(candidate.tier, candidate.fn, measured=True)
        else:
            journey.swap_in(candidate.tier, candidate.fn)
        self._settle(journey, candidate, serving, None)

    def _settle(self, journey: GraphJourney, candidate: Candidate, serving: str,
                decision: Decision | None) -> None:
        """Apply one decision (None: nothing to apply), then measure the graph's next waiting
        candidate."""
        try:
            if decision is not None:
                self._apply(journey, candidate, serving, decision)
        finally:
            self._vote.done(journey, candidate, serving)
            following = journey.next_for_gate()
            if following is not None:
                self._measure_next(journey, following)
            self._notify()

    def _apply(self, journey: GraphJourney, candidate: Candidate, serving: str,
               decision: Decision) -> None:
        record = decision.record
        if candidate.tier == EAGER:  # the serving tier against eager
            if decision.action is Action.ADOPT and record is not None:
                if journey.back_to_eager(serving, f"slower than eager: {record.reason}"):
                    bump("gate_kept")
                    self._store_verdict(journey, candidate.verdict_key, record)
            elif (record is not None and record.confidence == "confident"
                  and candidate.verdict_key is not None):  # a warm process need not check it
                self._store_verdict(journey, candidate.verdict_key + HELD_SUFFIX, record)
            return
        if decision.action is Action.KEEP:
            if record is not None:
                bump("gate_kept")
                self._store_verdict(journey, candidate.verdict_key, record)
                self._store_verdict(journey, self._vote.verdict_key(journey, candidate, serving,
                                                                    won=False), record)
            journey.keep(candidate.tier, decision.reason, on_timeline=True)
        elif decision.action is Action.ADOPT and journey.runner.tier == serving:
            journey.swap_in(candidate.tier, candidate.fn, measured=True)
            if record is not None:
                self._store_verdict(journey, self._vote.verdict_key(journey, candidate, serving,
                                                                    won=True), record)
        else:  # not measured, or the serving tier changed meanwhile (it failed): by rank
            journey.swap_in(candidate.tier, candidate.fn)

    def _held_before(self, key: str | None) -> bool:
        """An earlier run measured this tier confidently not slower than eager."""
        return key is not None and self._cache.verdict(key + HELD_SUFFIX) is not None

    def _store_verdict(self, journey: GraphJourney, key: str | None,
                       decision: GateDecision) -> None:
        if key is None:
            return
        device = next((m.device for m in journey.inputs or () if m.is_tensor), "cpu")
        self._cache.store_verdict(key, pack_verdict(decision, device, time.time()),
                                  verdict_label(decision))

    # ------------------------------------------------------------------ profiling comparison

    def compare(self, journey: GraphJourney) -> None:
        """Profiling runs, once the graph is final: compare every loaded tier with eager and
        profile their kernels, onto the timeline (not into any decision)."""
        entries, request = journey.entries(), journey.request
        if not self._recorder.profiling or request is None or not entries:
            return
        gate = self.gate or Gate(0.0, {t.name: t.load_config for t in self.tiers})
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

    def measure(self, bench: BenchRequest) -> Future[BenchReply]:
        return self._measure(bench)

    def _submit(self, bench: BenchRequest, then: Callable[..., None], *args: Any) -> None:
        """Measure ``bench``; on the load thread, ``then(*args, future, started_s)``."""
        started = time.monotonic()
        try:
            future = self._measure(bench)
        except Exception as e:  # e.g. the pool is closed: the decision still has to happen
            future = Future()
            future.set_exception(e)
        future.add_done_callback(lambda f: self._on_loader(then, (*args, f, started)))
