"""The ladder policy: which tiers a graph climbs, where it starts, and how a tier is adopted.

    start_points(journey, cache) -> the tiers to bring in (the best one the cache holds, and
                                    those above it); tiers below it, and tiers an earlier
                                    run's gate kept out, are kept
    offer(journey, tier, fn)     -> no gate: swap it in by rank
         (load thread)              gated: measure serving (eager too) vs tier (a worker) -->
                                    gate.decide, once per reply --> swap in, keep out (and
                                    store the verdict), or measure again (on a timer; a
                                    CPU graph mostly at once: _pause), the faster-looking
                                    of the two serving meanwhile; one measurement at a
                                    time per graph, the rest queue. With a fleet store,
                                    one replica measures each decision (fleet_vote.py)
    compare_soon(journey)        -> profiling runs, once the graph is final: every tier vs
                                    eager, and each tier's kernels, onto the timeline (a
                                    step of its own, after the tier's store)

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

from hotswap.compat import Buffer
from hotswap.counting import bump
from hotswap.engine import served, threads
from hotswap.engine.journey import Candidate, GraphJourney, TierState
from hotswap.engine.options import Tier
from hotswap.engine.policy.fleet_vote import FleetVote, Taken, Turn
from hotswap.engine.policy.gate import (
    EAGER,
    FIRST,
    HELD_SUFFIX,
    Action,
    Decision,
    Gate,
    Measurement,
    Retry,
    StoredVerdict,
    decide,
    measured_with,
    pack_verdict,
    verdict_label,
)
from hotswap.engine.recording import Recorder
from hotswap.engine.served import Window
from hotswap.engine.shipping.wire import BenchReply, BenchRequest
from hotswap.engine.sources.cache_access import CacheAccess
from hotswap.errors import PoolClosed
from hotswap.executors.base import MEASURED_AGAIN_HOLD_S
from hotswap.profiles.records import GateDecision

__all__ = ["Ladder", "Measure", "OnLoader"]

_log = logging.getLogger("hotswap")

# Runs a BenchRequest somewhere (a worker, by default) and resolves with its BenchReply.
Measure = Callable[[BenchRequest], "Future[BenchReply]"]
# Runs ``fn(*args)`` on the load thread; ``args[0]`` is the graph's journey.
OnLoader = Callable[[Callable[..., None], tuple[Any, ...]], None]



def _so_far(candidate: Candidate) -> Retry:
    """What the candidate's measurements so far left (its first: nothing)."""
    return candidate.so_far or FIRST


def _name(tier: str) -> str:
    return tier if tier == EAGER else repr(tier)


def _device(journey: GraphJourney) -> str:
    """The device the graph's tensors are on ("cpu" where it has none)."""
    return next((m.device for m in journey.inputs or () if m.is_tensor), "cpu")


def _pause(journey: GraphJourney, retry: Retry, *, blind: bool) -> float:
    """How long an undecided pair waits before it is measured again. A CPU graph's benchmark
    gets only CPU the caller leaves (the workers' priority): one that kept clean rounds is
    measured again at once (after the gate's pause the pool's one worker had taken a queued
    compile, and the measurement waited 9.6 s behind it in the demo beside a test run), and
    so is the first without a clean round, within the worker's hold (MEASURED_AGAIN_HOLD_S);
    later ones wait out the gate's doubling pauses: a benchmark starved that long is raised
    to the caller's priority (starvation.py), and back to back they would take the caller's
    cores. A GPU's benchmark shares the device with the caller's kernels: the gate's pauses."""
    if _device(journey) != "cpu":
        return retry.after_s
    if not blind:
        return 0.0
    return min(MEASURED_AGAIN_HOLD_S / 2, retry.after_s) if retry.blind == 1 else retry.after_s


def _held(key: str | None) -> str | None:
    return None if key is None else key + HELD_SUFFIX


class Ladder:
    """The tiers a coordinator's graphs climb, and the gate between them (None: by rank).
    ``force``: a tier adopted as soon as it is ready, unmeasured, that nothing replaces."""

    def __init__(self, tiers: list[Tier], *, gate: Gate | None, recorder: Recorder,
                 measure: Measure, on_loader: OnLoader, cache: CacheAccess,
                 notify: Callable[[], None], force: str | None = None,
                 probation: bool = False) -> None:
        self.tiers = tiers
        self.gate = gate
        self.force = force
        self.probation = probation  # ungated: tiers weighed against eager's calls as they serve
        self._recorder, self._measure, self._on_loader = recorder, measure, on_loader
        self._cache, self._notify = cache, notify
        self._lock = threading.Lock()
        self._comparisons = 0  # profile comparisons in flight
        self._vote = FleetVote(cache)
        # Low verdicts of earlier runs measured again, by verdict key: the measurement goes
        # on from their evidence where it weighs the same pair (StoredVerdict.measured).
        self._earlier: dict[str, StoredVerdict] = {}

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._comparisons == 0

    def cached_here(self, journey: GraphJourney) -> bool:
        """Whether the cache has an entry file for one of the graph's tiers (a stat each:
        nothing read or checked)."""
        return self._cache.enabled and any(
            self._cache.present(journey.keys.get(t.name)) for t in journey.tiers)

    def start_points(self, journey: GraphJourney) -> list[tuple[Tier, Buffer | None]]:
        """The tiers to bring in, lowest first (so the fast tier is ready first), each with the
        entry the cache already gave (or None). The best tier the cache holds is loaded; tiers
        below it are not needed at all; a tier the gate confidently kept out in an earlier run
        is neither loaded nor compiled again (one kept with low confidence is measured again),
        nor one an earlier run's probation sent back to eager."""
        tiers = journey.tiers  # the ladder's, less a rung this graph skips (coordinator.py)
        best, cached = -1, None
        verdicts: dict[str, str] = {}
        again: dict[str, Buffer | None] = {}  # low-confidence verdicts: measured again
        names = {t.name for t in self.tiers}
        if self._cache.enabled:
            for rank in range(len(tiers) - 1, -1, -1):
                name = tiers[rank].name
                key = journey.keys.get(name)
                if key and (self.gate is not None or self.probation) and name != self.force:
                    data = self._cache.verdict(key)
                    stored = StoredVerdict.unpack(data) if data is not None else None
                    if stored is not None and not stored.holds_in(names):
                        stored = None  # kept for a tier this ladder lacks: weighed anew
                    if stored is not None and stored.confident:
                        verdicts[name] = stored.reason
                        continue
                    if stored is not None:  # not a start point: it must beat what serves
                        bump("gate_remeasured")
                        with self._lock:
                            self._earlier[key] = stored
                        again[name] = self._cache.get(key)
                        continue
                cached = self._cache.get(key)
                if cached is not None:
                    best = rank
                    break
        starts: list[tuple[Tier, Buffer | None]] = []
        for rank, tier in enumerate(tiers):
            if tier.name in verdicts:
                journey.keep(tier.name, verdicts[tier.name], on_timeline=True)
            elif tier.name in again:
                starts.append((tier, again[tier.name]))
            elif rank < best:
                journey.keep(tier.name, f"tier {tiers[best].name!r} came from the cache")
            else:
                starts.append((tier, cached if rank == best else None))
        return starts

    # ------------------------------------------------------------------ adoption

    def offer(self, journey: GraphJourney, tier: str, fn: Any) -> None:
        """Load thread: ``tier`` is loaded; swap it in now, or once it has measured faster
        than what serves (eager included: no tier serves before it is weighed)."""
        if tier == self.force:
            journey.swap_in(tier, fn, measured=True)
            return
        if self.force is not None and journey.serving == self.force:
            journey.keep(tier, f"tier {self.force!r} is forced (force_tier)")
            return
        if self.gate is None:
            journey.swap_in(tier, fn)
            if journey.serving == tier:
                journey.keep_below(tier)
            return
        candidate = Candidate(tier, fn, journey.keys.get(tier))
        if journey.queue_for_gate(candidate):
            self._measure_next(journey, candidate)

    def _measure_next(self, journey: GraphJourney, candidate: Candidate) -> None:
        assert self.gate is not None
        if journey.forgotten:  # reset: nothing is measured for it any more
            return
        if journey.state(candidate.tier) not in (TierState.LOADED, TierState.MEASURING,
                                                 TierState.SERVING):
            self._settle(journey, candidate, candidate.against, None)  # it failed meanwhile
            return
        serving = journey.serving
        if candidate.against and serving in (candidate.against, candidate.tier):
            serving = candidate.against  # the same pair, whichever of the two serves now
        elif candidate.against:  # what it was weighed against failed: weighed anew
            candidate = Candidate(candidate.tier, candidate.fn, candidate.verdict_key)
        if serving == EAGER and self._held_before(candidate.verdict_key):
            journey.swap_in(candidate.tier, candidate.fn)  # beat eager in an earlier run
            self._settle(journey, candidate, serving, None)
            return
        candidate = dataclasses.replace(candidate, against=serving)
        candidate = self._going_on(candidate, serving)
        if self._cache.shared and self._fleet_settles(journey, candidate, serving):
            return
        request = journey.request
        tiers = tuple(t for t in (serving, candidate.tier) if t != EAGER)
        entries = journey.entries(tiers)
        if len(entries) < len(tiers) or request is None:  # nothing to measure against
            self._settle(journey, candidate, serving, Decision(Action.BY_ORDER))
            return
        bump("eager_checks" if serving == EAGER else "gate_benchmarks")
        if journey.state(candidate.tier) is TierState.LOADED:
            journey.to(candidate.tier, TierState.MEASURING)
        so_far = _so_far(candidate)
        again = f" (attempt {so_far.attempt + so_far.contended})" if (
            so_far.attempt + so_far.contended > 1) else ""
        doing = f"measuring {_name(candidate.tier)} against {_name(serving)}{again}"
        if candidate.undecided:  # measured again: status still says why it is undecided
            doing = (f"deciding {_name(candidate.tier)} against {_name(serving)}: "
                     f"{candidate.undecided}; measuring again{again}, "
                     f"{_name(journey.serving)} serving meanwhile")
        journey.gate_doing(doing, candidate.tier)
        bench = self.gate.request(journey.graph_id, entries, request, purpose="gate",
                                  with_graph=serving == EAGER or self._recorder.profiling,
                                  pair=(serving, candidate.tier), attempt=so_far.attempt,
                                  again=_device(journey) == "cpu")
        self._submit(bench, self._measured, journey, candidate, serving)

    def _going_on(self, candidate: Candidate, serving: str) -> Candidate:
        """A tier whose low verdict an earlier run stored, weighed against the same tier as
        then, goes on from that run's contended measurements instead of starting over."""
        if candidate.so_far is not None or candidate.verdict_key is None:
            return candidate
        with self._lock:
            stored = self._earlier.pop(candidate.verdict_key, None)
        if stored is None or stored.kept_for != serving or not stored.measured:
            return candidate
        return dataclasses.replace(candidate, so_far=dataclasses.replace(
            FIRST, contended=stored.measured, evidence=stored.evidence,
            inherited=stored.measured))

    def _measured(self, journey: GraphJourney, candidate: Candidate, serving: str,
                  future: Future[BenchReply], started: float) -> None:
        """Load thread: one gate decision per measurement reply, then apply it (or measure
        the pair again later, the faster-looking of the two serving meanwhile)."""
        assert self.gate is not None
        if journey.forgotten:
            return
        self._recorder.span(journey, candidate.tier, "gate_bench", started, time.monotonic(),
                            track="hotswap-gate")
        error = future.exception()
        reply: BenchReply | BaseException = error if error is not None else future.result()
        if isinstance(reply, BenchReply):
            for record in (*reply.benches, *reply.pairs):
                self._recorder.timeline.add(record)
        else:
            _log.warning("graph %s: benchmarking %r against %r failed (%s: %s); adopting it "
                         "by ladder order", journey.graph_id, candidate.tier, serving,
                         type(reply).__name__, reply)
        decision = decide(Measurement(journey.graph_id, serving, candidate.tier, reply),
                          threshold=self.gate.threshold, now_s=time.monotonic(),
                          **_so_far(candidate).decide_keywords())
        decided = decision.record
        if decided is not None:
            self._recorder.timeline.add(decided)
            # what each tier costs per call, to compare with its calls as it serves
            journey.measured(decided.serving, decided.serving_ms, decided.contended > 0)
            journey.measured(decided.candidate, decided.candidate_ms, decided.contended > 0)
        retry = decision.retry
        if retry is None:
            if decision.action is Action.ADOPT:
                _log.info("graph %s: gate adopts %r: %s", journey.graph_id, candidate.tier,
                          decision.reason)
            self._settle(journey, candidate, serving, decision)
            return
        bump("gate_undecided")
        self._serve_meanwhile(journey, candidate, serving, decision.meanwhile)
        why = decision.reason.removeprefix("gate: ")
        after_s = _pause(journey, retry, blind=retry.blind > _so_far(candidate).blind)
        when = f"in {after_s:g} s" if after_s else "at once"
        journey.gate_doing(f"deciding {_name(candidate.tier)} against {_name(serving)}: {why}; "
                           f"measuring again {when}, "
                           f"{_name(journey.serving)} serving meanwhile", candidate.tier)
        _log.info("graph %s: gate undecided on %r against %r: %s; measuring again %s",
                  journey.graph_id, candidate.tier, serving, why, when)
        again = dataclasses.replace(candidate, so_far=retry, undecided=why)
        threads.scheduler.later(after_s, self._on_loader, self._measure_next, (journey, again))

    def _serve_meanwhile(self, journey: GraphJourney, candidate: Candidate, serving: str,
                         tier: str) -> None:
        """The gate could not decide: ``tier``, of the pair, serves until it does."""
        if tier == candidate.tier and journey.serving == serving:
            journey.swap_in(candidate.tier, candidate.fn, measured=True)
        elif tier == serving and journey.serving == candidate.tier:
            journey.give_way(candidate.tier)

    def _fleet_settles(self, journey: GraphJourney, candidate: Candidate, serving: str) -> bool:
        """True when another replica's verdict settled ``candidate``, or when one is measuring
        it now (then looked for again shortly, on a timer: the load thread never waits).
        False: this replica measures it."""
        turn = self._vote.turn(journey, candidate, serving)
        if turn is Turn.MEASURE:
            return False
        if turn is Turn.WAIT:
            threads.scheduler.later(FleetVote.POLL_S, self._on_loader,
                                    self._measure_next, (journey, candidate))
            return True
        self._take(journey, candidate, serving, turn)
        return True

    def _take(self, journey: GraphJourney, candidate: Candidate, serving: str,
              taken: Taken) -> None:
        """Apply another replica's verdict on this decision."""
        if not taken.won:
            bump("gate_kept")  # as if measured here: another replica did
            self._keep(journey, candidate, taken.reason)
        elif journey.serving == serving:
            journey.swap_in(candidate.tier, candidate.fn, measured=True)
        elif journey.serving != candidate.tier:
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
        if decision.action is Action.KEEP:
            if record is not None:
                bump("gate_kept")
                so_far = _so_far(candidate)
                self._store_verdict(journey, candidate.verdict_key, record, measured_with(
                    so_far.contended, so_far.evidence, record))
                self._store_verdict(journey, self._vote.verdict_key(journey, candidate, serving,
                                                                    won=False), record)
            reason = decision.reason
            if serving == EAGER and record is not None:
                reason = reason.replace("gate: ", "slower than eager: " if record.gain is not None
                                        and record.gain < 0 else "not faster than eager: ", 1)
            self._keep(journey, candidate, reason)
            return
        if journey.serving == candidate.tier:  # it served meanwhile: it stays
            pass
        elif decision.action is Action.ADOPT and journey.serving == serving:
            journey.swap_in(candidate.tier, candidate.fn, measured=True)
        else:  # not measured, or the serving tier changed meanwhile (it failed): by rank
            journey.swap_in(candidate.tier, candidate.fn)
        if decision.action is Action.ADOPT and record is not None:
            if serving == EAGER and record.confidence == "confident":
                self._store_verdict(journey, _held(candidate.verdict_key), record)
            self._store_verdict(journey, self._vote.verdict_key(journey, candidate, serving,
                                                                won=True), record)

    def _keep(self, journey: GraphJourney, candidate: Candidate, reason: str) -> None:
        """``candidate`` is kept out; if it served while the gate decided, it gives way."""
        if not journey.give_way(candidate.tier, reason):
            journey.keep(candidate.tier, reason, on_timeline=True)

    def _held_before(self, key: str | None) -> bool:
        """An earlier run measured this tier confidently faster than eager."""
        return key is not None and self._cache.verdict(key + HELD_SUFFIX) is not None

    def _store_verdict(self, journey: GraphJourney, key: str | None,
                       decision: GateDecision, measured: tuple[int, float] = (0, 0.0)) -> None:
        if key is None:
            return
        self._cache.store_verdict(key, pack_verdict(decision, _device(journey), time.time(),
                                                    measured=measured),
                                  verdict_label(decision))

    def gave_way(self, journey: GraphJourney, tier: str, eager: Window, window: Window,
                 reason: str) -> None:
        """On probation, ``tier``'s calls ran slower than eager's and it gave way: the
        decision is stored as the gate's are, so that a later process keeps it out too (its
        tier would come from the cache before eager served enough calls to weigh it)."""
        decision = GateDecision(
            journey.graph_id, tier, EAGER, False, f"probation: {reason}", window.median_ms,
            eager.median_ms, served.GAP, time.monotonic(), "keep", "confident",
            gain=1.0 - window.median_ms / eager.median_ms,
            rounds=len(window.times_ms) + len(eager.times_ms))
        self._store_verdict(journey, journey.keys.get(tier), decision)

    # ------------------------------------------------------------------ profiling comparison

    def compare_soon(self, journey: GraphJourney) -> None:
        """``compare`` in a step of its own on the scheduler's thread, counted in flight
        (``idle``) from now; then the journey lets go. The step is queued behind the store of
        the tier whose arrival made the graph final (queued before that step ran), so the
        comparison carries where the cache holds the artifact, not a copy of its bytes: a
        fresh process's first CPU entry carries inductor's precompiled header (about 150 MB),
        whose copy and pickle beside the swap held the GIL for 164 ms of a user's call (the
        zoo's MLP, the 2-core box)."""
        with self._lock:  # in flight before it is claimed: a wait sees one or the other
            self._comparisons += 1
        if not journey.claim_comparison():  # queued once per graph
            with self._lock:
                self._comparisons -= 1
            return
        self._on_loader(self._compare_then_let_go, (journey,))

    def _compare_then_let_go(self, journey: GraphJourney) -> None:
        try:
            if not journey.forgotten:  # a reset since: nothing to compare for anyone
                self.compare(journey)
        finally:
            journey.let_go()
            with self._lock:
                self._comparisons -= 1
            self._notify()

    def compare(self, journey: GraphJourney) -> None:
        """Profiling runs, once the graph is final: compare every loaded tier with eager and
        profile their kernels, onto the timeline (not into any decision)."""
        entries, request = journey.entries(), journey.request
        if not self._recorder.profiling or request is None or not entries:
            return
        gate = self.gate or Gate(0.0, {t.name: t.load_config for t in self.tiers})
        try:
            bench = gate.request(journey.graph_id, entries, request, purpose="compare",
                                 with_graph=True)
        except Exception as e:  # a profile without the comparison, not a stuck wait()
            _log.warning("graph %s: comparing tiers failed: %s: %s", journey.graph_id,
                         type(e).__name__, e)
            return
        with self._lock:
            self._comparisons += 1
        self._submit(bench, self._compared, journey)

    def _compared(self, journey: GraphJourney, future: Future[BenchReply],
                  started: float) -> None:
        try:
            self._recorder.span(journey, "-", "compare_tiers", started, time.monotonic(),
                                track="hotswap-gate")
            error = future.exception()
            if isinstance(error, PoolClosed):  # shut down mid-comparison: nothing went wrong
                _log.info("graph %s: tiers not compared: the worker pool closed first (%s)",
                          journey.graph_id, error)
                return
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
