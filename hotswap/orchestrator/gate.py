"""The benchmark gate: a decision, serving tier vs candidate, on a measurement it is handed.

    Gate.request(...)  -> the BenchRequest that times both tiers against each other in
                          interleaved rounds (profiles/bench.measure_pair), same-metadata inputs
    Gate.decide(...)   -> a Verdict: adopt (surely faster by the threshold), keep out (surely
                          not), undecided (the interval straddles the threshold, or contention
                          left too few clean rounds: measured again later, longer), or adopt
                          by ladder order (nothing to measure against, or the measurement failed)

A decision needs no contention-free machine: rounds in which another task preempted the
benchmark are seen and left out, and the decision rests on a 95 % interval of the rounds'
ratios, not on one median each. On the last attempt an undecided gate keeps the serving tier,
marked "low" confidence.

The gate owns no graph's state and runs nothing: the ladder (ladder.py) measures, applies the
verdict, and keeps one measurement at a time per graph. A tier kept out is remembered in the
artifact cache as a verdict entry (``pack_verdict``: the decision and what it was measured
under), so a warm process does not serve it either; a low-confidence one it measures again.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from hotswap.orchestrator.journey import Entry
from hotswap.orchestrator.request import GraphRequest
from hotswap.orchestrator.wire import BenchReply, BenchRequest, CachedEntry
from hotswap.profiles.bench import DEFAULT_BUDGET_MS, gate_decision, paired_from_medians
from hotswap.profiles.records import GateDecision

__all__ = ["Action", "Gate", "StoredVerdict", "Verdict", "pack_verdict", "verdict_label"]

log = logging.getLogger("hotswap")


def pack_verdict(decision: GateDecision, device: str) -> bytes:
    """A verdict as the cache stores it: what it decided and what it was measured under."""
    fields = ("reason", "outcome", "confidence", "gain", "gain_low", "gain_high",
              "candidate_ms", "serving_ms", "rounds", "contended", "threshold")
    data = {"kept_for": decision.serving, "candidate": decision.candidate,
            "device": device, "date_unix_s": time.time(),
            **{f: getattr(decision, f) for f in fields}}
    return msgpack.packb(data, use_bin_type=True)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class StoredVerdict:
    reason: str
    confident: bool

    @classmethod
    def unpack(cls, data: bytes) -> StoredVerdict:
        verdict = msgpack.unpackb(data, raw=False)
        confidence = verdict.get("confidence", "confident")  # older entries: as they decided
        return cls(f"gate (earlier run, {confidence or 'undecided'}): {verdict['reason']}",
                   confidence == "confident")


def verdict_label(decision: GateDecision) -> str:
    """How ``hotswap cache ls`` shows a stored verdict."""
    gain = "" if decision.gain is None else f" {100 * decision.gain:+.1f}%"
    if decision.candidate == "eager":
        what = ("kept: slower than eager" if decision.adopt
                else "not slower than eager")
        return f"{decision.serving} {what} (eager{gain}), {decision.confidence or 'undecided'}"
    return (f"{decision.candidate} kept for {decision.serving}:{gain}, "
            f"{decision.confidence or 'undecided'}")


class Action(enum.Enum):
    ADOPT = "adopt"          # measured faster than the serving tier
    BY_ORDER = "by order"    # not measured: adopted if it ranks above the serving tier
    KEEP = "keep"            # kept out; ``reason`` says why
    UNDECIDED = "undecided"  # the measurement did not tell: the serving tier stays, for now


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str = ""
    decision: GateDecision | None = None  # the measured comparison, for the timeline


def _sendable(entries: dict[str, Entry]) -> dict[str, bytes | CachedEntry]:
    """What a benchmark job can carry (pickle refuses views): copies only entries the cache
    does not hold."""
    return {t: bytes(e) if isinstance(e, memoryview) else e for t, e in entries.items()}


class Gate:
    """A later tier replaces the serving one only if it measured ``threshold`` faster (0.02:
    2 %). ``configs``: each tier's inductor config, under which its artifact loads."""

    def __init__(self, threshold: float, configs: dict[str, dict[str, Any]],
                 budget_ms: float = DEFAULT_BUDGET_MS) -> None:
        self.threshold = threshold
        self.budget_ms = budget_ms
        self._configs = configs

    def request(self, graph_id: str, entries: dict[str, Entry], request: GraphRequest, *,
                purpose: str, with_graph: bool, pair: tuple[str, str] | None = None,
                attempt: int = 1) -> BenchRequest:
        """Measure ``entries`` (tier -> artifact) on inputs like the graph's. ``with_graph``:
        eager too, and (``purpose="compare"``) each tier's kernels, for a profile. ``pair``:
        (serving, candidate) timed against each other; a later ``attempt`` measures longer."""
        return BenchRequest(graph_id, _sendable(entries), request.inputs, request.grad_enabled,
                            graph_bytes=request.graph_bytes if with_graph else b"",
                            budget_ms=self.budget_ms * 2 ** (attempt - 1), purpose=purpose,
                            breakdown=purpose == "compare", num_threads=request.num_threads,
                            configs=self._configs, pair=pair or ())

    def decide(self, graph_id: str, serving: str, candidate: str,
               reply: BenchReply | BaseException, *, attempt: int = 1,
               last_attempt: bool = True) -> Verdict:
        if isinstance(reply, BaseException):
            then = (f"{serving!r} keeps serving" if candidate == "eager"
                    else "adopting it by ladder order")
            log.warning("graph %s: benchmarking %r against %r failed (%s: %s); %s", graph_id,
                        candidate, serving, type(reply).__name__, reply, then)
            return Verdict(Action.BY_ORDER)
        pair = next((p for p in reply.pairs
                     if (p.serving, p.candidate) == (serving, candidate)), None)
        if pair is None:  # a benchmarker that gives medians alone (or none)
            results = {b.tier: b.result for b in reply.benches}
            if candidate not in results:
                why = "; ".join(f"{t}: {e}" for t, e in reply.errors.items()) or "no result"
                return Verdict(Action.KEEP, f"gate: could not benchmark it ({why})")
            if serving not in results:
                return Verdict(Action.BY_ORDER)
            pair = paired_from_medians(graph_id, serving, results[serving].median_ms,
                                       candidate, results[candidate].median_ms)
        decision = gate_decision(pair, threshold=self.threshold, time_s=time.monotonic(),
                                 attempt=attempt, last_attempt=last_attempt)
        if decision.outcome == "undecided":
            return Verdict(Action.UNDECIDED, f"gate: {decision.reason}", decision)
        if decision.adopt:
            log.info("graph %s: gate adopts %r: %s", graph_id, candidate, decision.reason)
            return Verdict(Action.ADOPT, decision.reason, decision)
        return Verdict(Action.KEEP, f"gate: {decision.reason}", decision)
