"""The benchmark gate: a ready tier replaces the serving one only if it measured faster.

    loader thread                       pool (a worker)                 loader thread
    -------------                       ---------------                 -------------
    tier T loaded, tier S serving  -->  bench_tiers({S, T}) on the  --> decide: T's median at
    (T stays pending; S serves)         same-metadata inputs             least `threshold` below
                                                                         S's? swap_in(T) : keep(T)

Benchmarks run in a worker, never in the user's process: there they would take the GIL and
the device from the calls being served. The first compiled tier replaces eager without a
benchmark (it is what the user asked for; eager is the fallback, not a contender); every later
tier must beat the tier serving at the time. One gate at a time per graph: a tier that becomes
ready while another is measured waits, then meets the winner. A tier kept out is remembered in
the artifact cache (a verdict entry), so a warm process does not serve it either.

In profiling runs the gate also compares every tier with eager, once the ladder is final, and
profiles each tier's kernels; those records go to the timeline, not to the decision.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgpack

from hotswap.orchestrator.counters import bump
from hotswap.orchestrator.graph import GraphRunner
from hotswap.orchestrator.recording import Recorder
from hotswap.orchestrator.wire import BenchReply, BenchRequest, CachedEntry
from hotswap.profiles.bench import DEFAULT_BUDGET_MS, gate_decision

__all__ = ["Gate", "Measure"]

log = logging.getLogger("hotswap")

# Runs a BenchRequest somewhere (a worker, by default) and resolves with its BenchReply.
Measure = Callable[[BenchRequest], "Future[BenchReply]"]
Submit = Callable[[Callable[..., Any], Any], None]


def pack_verdict(serving: str, reason: str) -> bytes:
    return msgpack.packb({"kept_for": serving, "reason": reason},  # type: ignore[no-any-return]
                         use_bin_type=True)


def unpack_verdict(data: bytes) -> str:
    verdict = msgpack.unpackb(data, raw=False)
    return f"gate (earlier run): {verdict['reason']}"


# A packed artifact (a worker's result arrives as a view), or where the cache holds it.
Entry = bytes | memoryview | CachedEntry


def _sendable(entries: dict[str, Entry]) -> dict[str, bytes | CachedEntry]:
    """What a benchmark job can carry (pickle refuses views). Copies only entries the cache
    does not hold, outside the gate's lock, and only for a job that is sent."""
    return {t: bytes(e) if isinstance(e, memoryview) else e for t, e in entries.items()}


class _Candidate:
    def __init__(self, tier: str, fn: Any, verdict_key: str | None) -> None:
        self.tier, self.fn, self.verdict_key = tier, fn, verdict_key


class Gate:
    """Measures tiers before they swap in (progressive mode) and, when profiling, at the end."""

    def __init__(self, *, enabled: bool, threshold: float, recorder: Recorder, measure: Measure,
                 run_on_loader: Submit, notify: Callable[[], None],
                 store_verdict: Callable[[str, bytes], None],
                 configs: dict[str, dict[str, Any]] | None = None) -> None:
        self.enabled = enabled
        self._configs = configs or {}  # tier -> inductor config: its artifacts load under it
        self.threshold = threshold
        self.budget_ms = DEFAULT_BUDGET_MS
        self._recorder = recorder
        self._measure = measure
        self._run_on_loader = run_on_loader
        self._notify = notify
        self._store_verdict = store_verdict
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Entry]] = {}  # graph -> tier -> entry
        self._busy: dict[str, list[_Candidate]] = {}          # graph -> candidates waiting
        self._comparisons = 0                                 # profile comparisons in flight

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._comparisons == 0

    def busy(self, graph_id: str) -> bool:
        """A candidate of this graph is being measured or waits to be."""
        with self._lock:
            return graph_id in self._busy

    def remember(self, runner: GraphRunner, tier: str, entry: Entry) -> None:
        """A loaded tier's packed artifact, or where the cache holds it (preferred: then the
        bytes are not sent again): what a later benchmark of this graph loads."""
        with self._lock:
            self._entries.setdefault(runner.graph_id, {})[tier] = entry

    def offer(self, runner: GraphRunner, tier: str, fn: Any, request: Any,
              verdict_key: str | None) -> None:
        """Loader thread: ``tier`` is loaded; swap it in now, or once it has measured faster."""
        if not self.enabled or runner.tier == "eager":
            runner.swap_in(tier, fn)
            return
        candidate = _Candidate(tier, fn, verdict_key)
        with self._lock:
            queue = self._busy.get(runner.graph_id)
            if queue is not None:
                queue.append(candidate)
                return
            self._busy[runner.graph_id] = []
        self._measure_candidate(runner, candidate, request)

    def _measure_candidate(self, runner: GraphRunner, candidate: _Candidate, request: Any) -> None:
        serving = runner.tier
        with self._lock:
            entries = self._entries.get(runner.graph_id, {})
            pair = {t: entries[t] for t in (serving, candidate.tier) if t in entries}
        if len(pair) < 2:  # nothing to measure against (the serving tier's artifact is gone)
            self._settle(runner, request, lambda: runner.swap_in(candidate.tier, candidate.fn))
            return
        bump("gate_benchmarks")
        bench = BenchRequest(runner.graph_id, _sendable(pair), request.inputs, request.grad_enabled,
                             graph_bytes=request.graph_bytes if self._recorder.profiling else b"",
                             budget_ms=self.budget_ms, purpose="gate",
                             num_threads=request.num_threads, configs=self._configs)
        self._submit(bench, self._decide, runner, candidate, serving, request)

    def _decide(self, runner: GraphRunner, candidate: _Candidate, serving: str, request: Any,
                future: Future[BenchReply], started: float) -> None:
        self._recorder.span(runner, candidate.tier, "gate_bench", started, time.monotonic(),
                            track="hotswap-gate")
        error = future.exception()
        if error is not None:
            log.warning("graph %s: benchmarking tier %r failed (%s: %s); adopting it by ladder "
                        "order", runner.graph_id, candidate.tier, type(error).__name__, error)
            self._settle(runner, request, lambda: runner.swap_in(candidate.tier, candidate.fn))
            return
        reply = future.result()
        for bench in reply.benches:
            self._recorder.timeline.add(bench)
        results = {b.tier: b.result for b in reply.benches}
        if candidate.tier not in results or serving not in results:
            why = "; ".join(f"{t}: {e}" for t, e in reply.errors.items()) or "no result"
            if candidate.tier not in results:
                self._settle(runner, request, lambda: self._recorder.kept(
                    runner, candidate.tier, f"gate: could not benchmark it ({why})"))
            else:
                self._settle(runner, request,
                             lambda: runner.swap_in(candidate.tier, candidate.fn))
            return
        decision = gate_decision(runner.graph_id, candidate=candidate.tier,
                                 candidate_result=results[candidate.tier], serving=serving,
                                 serving_result=results[serving], threshold=self.threshold,
                                 time_s=time.monotonic())
        self._recorder.timeline.add(decision)
        log.info("graph %s: gate %s %r: %s", runner.graph_id,
                 "adopts" if decision.adopt else "keeps out", candidate.tier, decision.reason)

        def apply() -> None:
            if not decision.adopt:
                bump("gate_kept")
                self._recorder.kept(runner, candidate.tier, f"gate: {decision.reason}")
                if candidate.verdict_key is not None:
                    self._store_verdict(candidate.verdict_key,
                                        pack_verdict(serving, decision.reason))
            elif runner.tier == serving:
                runner.swap_in(candidate.tier, candidate.fn, measured=True)
            else:  # the serving tier changed meanwhile (it failed): fall back on ladder order
                runner.swap_in(candidate.tier, candidate.fn)

        self._settle(runner, request, apply)

    def _settle(self, runner: GraphRunner, request: Any, apply: Callable[[], Any]) -> None:
        """Apply one decision, then measure the next waiting candidate of the same graph."""
        try:
            apply()
        finally:
            with self._lock:
                queue = self._busy.get(runner.graph_id, [])
                following = queue.pop(0) if queue else None
                if following is None:
                    self._busy.pop(runner.graph_id, None)
            if following is not None:
                self._measure_candidate(runner, following, request)
            self._notify()

    # ------------------------------------------------------------------ profiling comparison

    def finished(self, runner: GraphRunner, request: Any) -> None:
        """The graph's ladder is final. Profiling: compare every loaded tier with eager and
        profile their kernels. Otherwise: forget the artifacts (nothing will measure them)."""
        with self._lock:
            if runner.graph_id in self._busy:
                return
            entries = self._entries.pop(runner.graph_id, {})
            if not self._recorder.profiling or request is None or not entries:
                return
            self._comparisons += 1
        bench = BenchRequest(runner.graph_id, _sendable(entries), request.inputs, request.grad_enabled,
                             graph_bytes=request.graph_bytes, budget_ms=self.budget_ms,
                             purpose="compare", breakdown=True, num_threads=request.num_threads,
                             configs=self._configs)
        self._submit(bench, self._compared, runner)

    def _submit(self, bench: BenchRequest, then: Callable[..., None], *args: Any) -> None:
        """Measure ``bench``; on the loader thread, ``then(*args, future, started_s)``."""
        started = time.monotonic()
        try:
            future = self._measure(bench)
        except Exception as e:  # e.g. the pool is closed: the decision still has to happen
            future = Future()
            future.set_exception(e)
        future.add_done_callback(lambda f: self._run_on_loader(then, (*args, f, started)))

    def _compared(self, runner: GraphRunner, future: Future[BenchReply], started: float) -> None:
        try:
            self._recorder.span(runner, "-", "compare_tiers", started, time.monotonic(),
                                track="hotswap-gate")
            error = future.exception()
            if error is not None:
                log.warning("graph %s: comparing tiers failed: %s: %s", runner.graph_id,
                            type(error).__name__, error)
                return
            reply = future.result()
            for record in (*reply.benches, *reply.kernels):
                self._recorder.timeline.add(record)
            for what, why in reply.errors.items():
                log.info("graph %s: profile of %s incomplete: %s", runner.graph_id, what, why)
        finally:
            with self._lock:
                self._comparisons -= 1
            self._notify()
