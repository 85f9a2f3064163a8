"""The gate's decisions measured again: what each one cost, by a reference measurement.

    backend = audited_backend(workers=2)        # progressive, artifacts kept once final
    compiled = torch.compile(model, backend=backend)
    ... serve it under load until hotswap.wait(backend) ...
    rows = reference(backend)                    # once the caller is quiet

The reference is the gate's own paired measurement (profiles/bench.measure_pair), in the same
kind of worker on the same inputs, but long (``rounds`` rounds, ``budget_ms`` per tier) and
on a quiet machine. Regret is (time of the tier the gate chose - time of the faster one) /
time of the faster one, from the reference's ratio: 0 when the gate chose the faster tier.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options
from hotswap.engine.shipping.wire import BenchRequest
from hotswap.profiles.records import GateDecision

__all__ = ["audited_backend", "decisions", "gate_request", "reference", "regret"]

EAGER = "eager"


def audited_backend(**options: Any) -> Coordinator:
    """A progressive backend whose graphs keep their artifacts once final (to audit them)."""
    return Coordinator(Options.create(**{"mode": "progressive", **options}),
                       retain_artifacts=True)


def decisions(backend: Coordinator) -> list[GateDecision]:
    """The gate's final decisions (adopt or keep; the last one for each graph, serving tier
    and candidate), in the order they were made."""
    last: dict[tuple[str, str, str], GateDecision] = {}
    for d in backend.recorder.timeline.records(GateDecision):
        if d.outcome in ("adopt", "keep"):
            last[(d.graph_id, d.serving, d.candidate)] = d
    return sorted(last.values(), key=lambda d: d.time_s)


def regret(adopted: bool, ratio: float) -> float:
    """What choosing cost, given the true candidate / serving ``ratio``: adopting a slower
    candidate costs ratio - 1, keeping out a faster one 1 / ratio - 1."""
    return max(0.0, ratio - 1.0) if adopted else max(0.0, 1.0 / ratio - 1.0)


def gate_request(backend: Coordinator, decision: GateDecision, *,
                 budget_ms: float | None = None, rounds: int = 0) -> BenchRequest:
    """The measurement behind ``decision``, again (the gate's budget unless given)."""
    gate = backend.ladder.gate
    if gate is None:
        raise ValueError("this backend has no gate (a progressive mode with gate=True has)")
    journey = next(j for j in backend.journeys() if j.graph_id == decision.graph_id)
    tiers = tuple(t for t in (decision.serving, decision.candidate) if t != EAGER)
    entries, request = journey.entries(tiers), journey.request
    if len(entries) < len(tiers) or request is None:
        raise LookupError("artifacts not kept (not an audited_backend?)")
    bench = gate.request(decision.graph_id, entries, request, purpose="reference",
                         with_graph=EAGER in (decision.serving, decision.candidate),
                         pair=(decision.serving, decision.candidate))
    return dataclasses.replace(bench, budget_ms=budget_ms or bench.budget_ms,
                               rounds=rounds or bench.rounds)


def reference(backend: Coordinator, *, budget_ms: float = 1500.0, rounds: int = 30,
              timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Each final decision of ``backend``'s gate next to a reference measurement of the same
    two tiers, and its regret; a row with ``error`` where the reference could not run."""
    origins = {j.graph_id: j.origin for j in backend.journeys()}
    rows = []
    for d in decisions(backend):
        row: dict[str, Any] = {
            "graph": d.graph_id, "origin": origins[d.graph_id], "serving": d.serving,
            "candidate": d.candidate, "outcome": d.outcome, "confidence": d.confidence,
            "attempt": d.attempt, "gain": d.gain, "gain_low": d.gain_low,
            "gain_high": d.gain_high, "contended": d.contended, "rounds": d.rounds}
        try:
            bench = gate_request(backend, d, budget_ms=budget_ms, rounds=rounds)
        except LookupError as e:
            rows.append({**row, "error": str(e)})
            continue
        try:
            reply = backend.measure(bench).result(timeout=timeout_s)
        except Exception as e:
            rows.append({**row, "error": f"{type(e).__name__}: {e}"})
            continue
        if not reply.pairs:
            rows.append({**row, "error": "; ".join(reply.errors.values()) or "no result"})
            continue
        ref = reply.pairs[0]
        rows.append({**row, "ref_gain": 1.0 - ref.ratio, "ref_gain_low": 1.0 - ref.ratio_high,
                     "ref_gain_high": 1.0 - ref.ratio_low, "ref_contended": ref.contended,
                     "ref_rounds": ref.rounds, "serving_ms": ref.serving_ms,
                     "candidate_ms": ref.candidate_ms, "regret": regret(d.adopt, ref.ratio)})
    return rows
