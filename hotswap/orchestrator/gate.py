"""The benchmark gate: a decision, serving tier vs candidate, on a measurement it is handed.

    Gate.request(...)  -> the BenchRequest that measures both tiers (same-metadata inputs)
    Gate.decide(...)   -> a Verdict: adopt (measured faster), adopt by ladder order (nothing
                          to measure against, or the measurement failed), or keep out

The gate owns no graph's state and runs nothing: the ladder (ladder.py) measures, applies the
verdict, and keeps one measurement at a time per graph. A tier kept out is remembered in the
artifact cache as a verdict entry (``pack_verdict``), so a warm process does not serve it
either.
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
from hotswap.profiles.bench import DEFAULT_BUDGET_MS, gate_decision
from hotswap.profiles.records import GateDecision

__all__ = ["Action", "Gate", "Verdict", "pack_verdict", "unpack_verdict"]

log = logging.getLogger("hotswap")


def pack_verdict(serving: str, reason: str) -> bytes:
    return msgpack.packb({"kept_for": serving, "reason": reason},  # type: ignore[no-any-return]
                         use_bin_type=True)


def unpack_verdict(data: bytes) -> str:
    verdict = msgpack.unpackb(data, raw=False)
    return f"gate (earlier run): {verdict['reason']}"


class Action(enum.Enum):
    ADOPT = "adopt"          # measured faster than the serving tier
    BY_ORDER = "by order"    # not measured: adopted if it ranks above the serving tier
    KEEP = "keep"            # kept out; ``reason`` says why


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
                purpose: str, with_graph: bool) -> BenchRequest:
        """Measure ``entries`` (tier -> artifact) on inputs like the graph's. ``with_graph``:
        eager too, and (``purpose="compare"``) each tier's kernels, for a profile."""
        return BenchRequest(graph_id, _sendable(entries), request.inputs, request.grad_enabled,
                            graph_bytes=request.graph_bytes if with_graph else b"",
                            budget_ms=self.budget_ms, purpose=purpose,
                            breakdown=purpose == "compare", num_threads=request.num_threads,
                            configs=self._configs)

    def decide(self, graph_id: str, serving: str, candidate: str,
               reply: BenchReply | BaseException) -> Verdict:
        if isinstance(reply, BaseException):
            log.warning("graph %s: benchmarking tier %r failed (%s: %s); adopting it by ladder "
                        "order", graph_id, candidate, type(reply).__name__, reply)
            return Verdict(Action.BY_ORDER)
        results = {b.tier: b.result for b in reply.benches}
        if candidate not in results:
            why = "; ".join(f"{t}: {e}" for t, e in reply.errors.items()) or "no result"
            return Verdict(Action.KEEP, f"gate: could not benchmark it ({why})")
        if serving not in results:
            return Verdict(Action.BY_ORDER)
        decision = gate_decision(graph_id, candidate=candidate,
                                 candidate_result=results[candidate], serving=serving,
                                 serving_result=results[serving], threshold=self.threshold,
                                 time_s=time.monotonic())
        if decision.adopt:
            log.info("graph %s: gate adopts %r: %s", graph_id, candidate, decision.reason)
            return Verdict(Action.ADOPT, decision.reason, decision)
        return Verdict(Action.KEEP, f"gate: {decision.reason}", decision)
