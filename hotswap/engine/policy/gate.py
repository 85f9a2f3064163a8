"""The benchmark gate: a decision, serving tier vs candidate, on a measurement it is handed.

    Gate.request(...)  -> the BenchRequest that times both tiers against each other in
                          interleaved rounds (profiles/bench.measure_pair), same-metadata inputs
    decide(measurement, attempt=, contended=, threshold=, now_s=)
                       -> a Decision: adopt (surely faster by the threshold), keep out (surely
                          not), retry later (the interval straddles the threshold, or contention
                          left too few clean rounds: measured again, when, and which of the two
                          serves meanwhile), or adopt by ladder order (the measurement failed)

Eager is a tier like the others: a compiled tier replaces it only once it measured faster.
A decision needs no contention-free machine: rounds in which another task preempted the
benchmark are seen and left out, and the decision rests on a 95 % interval of the rounds'
ratios, not on one median each; where too few rounds were clean, a gap that every round shows
by a wide margin still decides (bench.DECISIVE). An interval across the threshold is measured
again up to MAX_ATTEMPTS times, then the serving tier stays, marked "close" confidence where
the interval has the candidate at most bench.CLOSE_MARGIN thresholds faster (what keeping it
out may cost), else "low". A measurement contention spoiled decides nothing alone: it is
measured again for as long as it takes, after pauses that double up to RETRY_CAP_S (the
ladder measures a CPU graph's again at once where it kept clean rounds: ladder.py), and the
tier with the faster median serves meanwhile (a candidate on trial while it is ahead at all:
``_meanwhile``); the graph is not final until then. Its clean rounds count: with the earlier
contended measurements' they give an interval (``pooled``), which decides as a clean
measurement's does.

``decide`` is a function of what it is handed: it logs nothing, reads no clock and owns no
graph's state. The ladder (ladder.py) measures, logs, applies the decision, starts its retry
timer, and keeps one measurement at a time per graph. A tier kept out is remembered in the
artifact cache as a verdict entry (``pack_verdict``: the decision and what it was measured
under), so a warm process does not serve it either; a low-confidence one it measures again
(a close one it does not: what that could gain is bounded, and measuring it cost every start).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from dataclasses import dataclass
from typing import Any

import msgpack

from hotswap.compat import Buffer
from hotswap.engine.journey import Entry
from hotswap.engine.shipping.request import GraphRequest
from hotswap.engine.shipping.wire import BenchReply, BenchRequest, CachedEntry
from hotswap.profiles.bench import (
    CLOSE_MARGIN,
    DEFAULT_BUDGET_MS,
    MIN_CLEAN,
    direction,
    gate_decision,
    median_interval,
    paired_from_medians,
)
from hotswap.profiles.records import GateDecision, Paired

__all__ = ["EAGER", "FIRST", "HELD_SUFFIX", "MAX_ATTEMPTS", "RETRY_CAP_S", "Action", "Decision", "Gate",
           "Measurement", "Retry", "StoredVerdict", "decide", "measured_with", "pack_verdict",
           "pooled", "verdict_label"]

EAGER = "eager"
# Suffix of a tier's key under which a confident "faster than eager" is stored: a warm
# process serves the tier without weighing it against eager again.
HELD_SUFFIX = "/vs-eager"
# An interval across the threshold is measured again, longer (Gate.request doubles the
# budget), after a pause; after MAX_ATTEMPTS the serving tier stays. A machine too busy to
# measure on (a compile of another tier, a caller using every core) is measured on again, as
# long as it takes: after RETRY_AFTER_S while each measurement keeps some clean rounds (they
# add up: ``pooled``), and waited out where one kept none, each such pause twice the last,
# none longer than RETRY_CAP_S. (The ladder skips the pause of a CPU graph's measurement that
# kept clean rounds: its benchmark takes only CPU the caller leaves.)
MAX_ATTEMPTS = 3
RETRY_AFTER_S = 1.0
RETRY_CAP_S = 30.0

def pack_verdict(decision: GateDecision, device: str, date_unix_s: float, *,
                 measured: tuple[int, float] = (0, 0.0)) -> bytes:
    """A verdict as the cache stores it: what it decided and what it was measured under.
    ``measured``: the contended measurements of the pair behind it and the sum of their log
    ratios (``Retry.contended``, ``Retry.evidence``, this one's included), with which a
    later process goes on where a low verdict is measured again."""
    fields = ("reason", "outcome", "confidence", "gain", "gain_low", "gain_high",
              "candidate_ms", "serving_ms", "rounds", "contended", "threshold")
    data = {"kept_for": decision.serving, "candidate": decision.candidate,
            "device": device, "date_unix_s": date_unix_s,
            "measured": measured[0], "evidence": measured[1],
            **{f: getattr(decision, f) for f in fields}}
    return msgpack.packb(data, use_bin_type=True)  # type: ignore[no-any-return]


def measured_with(contended: int, evidence: float, record: GateDecision) -> tuple[int, float]:
    """A pair's contended measurements and their log ratios summed, once ``record`` (the last
    measurement's decision) is counted in where it was contended (pack_verdict's
    ``measured``)."""
    if record.gain is None or record.rounds - record.contended >= MIN_CLEAN:
        return contended, evidence
    return contended + 1, evidence + math.log(max(1.0 - record.gain, 1e-9))


@dataclass(frozen=True)
class StoredVerdict:
    reason: str
    confident: bool  # settled: a confident or close verdict, not measured again
    kept_for: str = ""  # the tier it lost to (EAGER included); "" where not recorded
    # Its contended measurements and their log ratios summed (pack_verdict): a low verdict
    # measured again goes on from them, so that its evidence grows from process to process
    # and a pair too close to call costs a later process one measurement, not five.
    measured: int = 0
    evidence: float = 0.0

    @classmethod
    def unpack(cls, data: Buffer) -> StoredVerdict:
        verdict = msgpack.unpackb(data, raw=False)
        confidence = verdict.get("confidence", "confident")  # older entries: as they decided
        measured, evidence = verdict.get("measured", 0), verdict.get("evidence", 0.0)
        if not (isinstance(measured, int) and measured >= 0 and isinstance(evidence, float)
                and math.isfinite(evidence)):
            measured, evidence = 0, 0.0  # malformed: measured afresh
        return cls(f"gate (earlier run, {confidence or 'undecided'}): {verdict['reason']}",
                   confidence in ("confident", "close"), str(verdict.get("kept_for") or ""),
                   measured, evidence)

    def holds_in(self, tiers: set[str]) -> bool:
        """Whether the verdict applies to a ladder of ``tiers``: the tier it lost to is one
        of them, or eager. Keys name a tier's graph and config, not its ladder, and a tier
        kept for one that this ladder lacks would otherwise keep the graph on eager."""
        return not self.kept_for or self.kept_for == EAGER or self.kept_for in tiers


def verdict_label(decision: GateDecision) -> str:
    """How ``hotswap cache ls`` shows a stored verdict."""
    gain = "" if decision.gain is None else f" {100 * decision.gain:+.1f}%"
    if decision.serving == EAGER:
        what = "beats eager" if decision.adopt else "kept for eager"
        return f"{decision.candidate} {what}:{gain}, {decision.confidence or 'undecided'}"
    return (f"{decision.candidate} kept for {decision.serving}:{gain}, "
            f"{decision.confidence or 'undecided'}")


class Action(enum.Enum):
    ADOPT = "adopt"          # measured faster than the serving tier
    BY_ORDER = "by order"    # not measured: adopted if it ranks above the serving tier
    KEEP = "keep"            # kept out; ``reason`` says why
    RETRY = "retry later"    # undecided: the serving tier stays, and the pair is measured again


@dataclass(frozen=True)
class Measurement:
    """One gate measurement of ``candidate`` against ``serving`` (a tier, or eager) for
    ``graph_id``: the worker's reply, or the error that stopped it."""

    graph_id: str
    serving: str
    candidate: str
    reply: BenchReply | BaseException


@dataclass(frozen=True)
class Retry:
    """Measure the pair again after ``after_s``, as attempt ``attempt`` (its budget grows
    with it: Gate.request), with ``contended`` too-busy measurements behind it and
    ``evidence``, the sum of their log ratios (candidate / serving)."""

    after_s: float
    attempt: int
    contended: int
    evidence: float = 0.0
    streak: int = 0  # contended measurements in a row with one tier ahead (bench.gate_decision)
    clean: int = 0   # the contended measurements' clean rounds, together
    blind: int = 0   # contended measurements without a clean round (a ratio from fastest blocks)
    clean_ratios: tuple[float, ...] = ()  # those clean rounds' ratios (Paired.clean_ratios)
    rounds: int = 0  # the contended measurements' rounds, together
    # Of ``contended``, those an earlier process made (StoredVerdict.measured): they count
    # as evidence, not toward this process's pauses.
    inherited: int = 0

    def decide_keywords(self) -> dict[str, Any]:
        """``decide``'s keywords for the measurement this retry asks for (its fields, by
        the same names, ``after_s`` aside): what the pair's measurements so far left."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "after_s"}


# A pair not measured yet: its first measurement, nothing behind it.
FIRST = Retry(0.0, 1, 0)


@dataclass(frozen=True)
class Decision:
    """What one measurement decided. ``reason``: why, as status shows a kept tier;
    ``record``: the measured comparison (the timeline's and the stored verdict's), None where
    nothing was measured; ``retry``: set exactly when ``action`` is RETRY, and then
    ``meanwhile`` names which of the two serves until the pair is decided: the candidate
    where the contended measurements so far have it faster by the threshold (their medians'
    geometric mean, so one lucky measurement on a very busy machine does not serve it); ""
    (whichever serves now stays) where they have it ahead by less; else the serving tier
    (``_meanwhile``)."""

    action: Action
    reason: str = ""
    record: GateDecision | None = None
    retry: Retry | None = None
    meanwhile: str = ""


def decide(measurement: Measurement, *, attempt: int, contended: int, threshold: float,
           now_s: float, evidence: float = 0.0, streak: int = 0, clean: int = 0,
           blind: int = 0, clean_ratios: tuple[float, ...] = (), rounds: int = 0,
           inherited: int = 0) -> Decision:
    """Decide on one measurement: ``attempt`` and ``contended`` count the measurements of this
    pair so far (this one included in ``attempt``), ``threshold`` the gain to adopt at (0.02:
    2 %), ``now_s`` the monotonic time the record carries, ``evidence`` the earlier contended
    measurements' log ratios, summed (``Retry.evidence``), ``streak`` the contended ones in a
    row before this one that put the same tier ahead (``Retry.streak``, signed: + the
    candidate), ``clean`` and ``blind`` the earlier contended measurements' clean rounds and
    how many had none (``Retry.clean``, ``Retry.blind``), ``clean_ratios`` and ``rounds``
    those clean rounds' ratios and all their rounds (``Retry.clean_ratios``, ``Retry.rounds``),
    ``inherited`` how many of ``contended`` an earlier process made (``Retry.inherited``).
    Pure: no logging, no clock.

    A busy machine leaves each measurement a few clean rounds, too few for an interval of its
    own; together with the earlier contended measurements' they give one (``pooled``): a
    round is clean when no thread of the measuring process waited for a CPU, whichever
    measurement it belongs to. Where this measurement's own rules (every round agreeing, a
    streak, the contended mean) leave the pair undecided or low, a pooled interval clear of
    the threshold decides, and from the MAX_ATTEMPTS-th measurement on, one that has the
    candidate at most CLOSE_MARGIN thresholds faster keeps the serving tier as "close";
    anything else goes on as before."""
    m, reply = measurement, measurement.reply
    if isinstance(reply, BaseException):
        return Decision(Action.BY_ORDER)
    pair = next((p for p in reply.pairs
                 if (p.serving, p.candidate) == (m.serving, m.candidate)), None)
    if pair is None:  # a benchmarker that gives medians alone (or none)
        results = {b.tier: b.result for b in reply.benches}
        if m.candidate not in results:
            why = "; ".join(f"{t}: {e}" for t, e in reply.errors.items()) or "no result"
            return Decision(Action.KEEP, f"gate: could not benchmark it ({why})")
        if m.serving not in results:
            return Decision(Action.BY_ORDER)
        pair = paired_from_medians(m.graph_id, m.serving, results[m.serving].median_ms,
                                   m.candidate, results[m.candidate].median_ms)
    contended_mean = None
    # Measurements an earlier process made close a pair only beside one of this process's
    # that keeps it out as well (at most the close margin faster, slower by any amount): a
    # candidate now measured far faster is measured again, not kept on history.
    going_on = not inherited or math.log(max(pair.ratio, 1e-9)) >= -CLOSE_MARGIN * threshold
    if pair.clean < MIN_CLEAN and going_on:  # this measurement and the contended ones before
        # Each measurement's ratio is its clean rounds' median: pooled over measurements that
        # all had some, enough of them are evidence contention did not bend toward 1.0 (an
        # earlier process's count as without: their clean rounds did not travel).
        all_clean = (blind + inherited == 0 and pair.clean > 0
                     and clean + pair.clean >= MIN_CLEAN)
        contended_mean = (contended + 1,
                          math.exp((evidence + math.log(max(pair.ratio, 1e-9))) / (contended + 1)),
                          all_clean)
    record = gate_decision(pair, threshold=threshold, time_s=now_s, attempt=attempt,
                           last_attempt=pair.clean >= MIN_CLEAN and attempt >= MAX_ATTEMPTS,
                           streak=streak, contended_mean=contended_mean)
    undecided = record.outcome == "undecided" or record.confidence == "low"
    if undecided and pair.clean < MIN_CLEAN and pair.clean_ratios and clean_ratios:
        # What this measurement alone decides (every round, a streak) comes first.
        together = pooled(pair, clean_ratios, rounds, contended + 1)
        if together.clean >= MIN_CLEAN:
            verdict = gate_decision(together, threshold=threshold, time_s=now_s,
                                    attempt=max(attempt, together.measurements),
                                    last_attempt=together.measurements >= MAX_ATTEMPTS)
            if verdict.outcome == "adopt":
                return Decision(Action.ADOPT, verdict.reason, verdict)
            if verdict.outcome == "keep" and verdict.confidence != "low":
                return Decision(Action.KEEP, f"gate: {verdict.reason}", verdict)
    if record.outcome == "undecided":
        retry = _retry(pair, attempt, Retry(0.0, attempt, contended, evidence, streak, clean,
                                            blind, clean_ratios, rounds, inherited), threshold)
        return Decision(Action.RETRY, f"gate: {record.reason}", record, retry,
                        _meanwhile(pair, retry, threshold))
    if record.adopt:
        return Decision(Action.ADOPT, record.reason, record)
    return Decision(Action.KEEP, f"gate: {record.reason}", record)


def _meanwhile(pair: Paired, retry: Retry, threshold: float) -> str:
    """Which of an undecided pair serves until it is decided (Decision.meanwhile): the
    candidate where the contended measurements so far have it faster by the threshold; ""
    (whichever serves now stays) where they have it faster by less, or a clean measurement
    has it faster at all (a clean one never puts a candidate on trial); else the serving
    tier. A candidate on trial stays while it is ahead at all: in the cold demo two tiers
    1-4 % apart swapped four times while the gate decided, each swap of no gain."""
    if not pair.ratio > 0:
        return pair.serving
    lead = (retry.evidence / retry.contended if pair.clean < MIN_CLEAN
            else math.log(pair.ratio))  # log(candidate / serving): below 0, the candidate
    if pair.clean < MIN_CLEAN and lead <= math.log(1.0 - threshold):
        return pair.candidate
    return "" if lead < 0 else pair.serving


def _retry(pair: Paired, attempt: int, so_far: Retry, threshold: float) -> Retry:
    """The next measurement of an undecided pair (``so_far``: the state before this one).
    Too few clean rounds (the machine was busy): the same budget, however many it takes;
    after RETRY_AFTER_S where this one kept some clean rounds (they pool with the next one's:
    a caller that keeps the machine busy leaves each measurement a few, and waiting does not
    change that), else after a pause that doubles with each measurement that kept none, up to
    RETRY_CAP_S. An interval across the threshold: longer, after a pause that grows with the
    attempt. (``after_s`` is the gate's; the ladder measures a CPU graph's pair again at once
    where this one kept clean rounds.)"""
    if pair.clean < MIN_CLEAN:
        way = direction(pair, threshold)
        streak = so_far.streak + way if way and so_far.streak * way >= 0 else way
        pause = RETRY_AFTER_S if pair.clean else min(RETRY_AFTER_S * 2 ** so_far.blind,
                                                      RETRY_CAP_S)
        return Retry(pause, attempt,
                     so_far.contended + 1, so_far.evidence + math.log(max(pair.ratio, 1e-9)),
                     streak, so_far.clean + pair.clean, so_far.blind + (pair.clean == 0),
                     so_far.clean_ratios + pair.clean_ratios, so_far.rounds + pair.rounds,
                     so_far.inherited)
    return dataclasses.replace(so_far, after_s=RETRY_AFTER_S * attempt, attempt=attempt + 1)


def pooled(pair: Paired, earlier: tuple[float, ...], earlier_rounds: int,
           measurements: int) -> Paired:
    """``pair`` with the clean rounds of the contended measurements before it: the median
    and 95 % interval of every clean round's ratio, and every round counted."""
    together = (*earlier, *pair.clean_ratios)
    low, high = median_interval(list(together))
    rounds = earlier_rounds + pair.rounds
    return dataclasses.replace(pair, ratio=statistics.median(together), ratio_low=low,
                               ratio_high=high, rounds=rounds, contended=rounds - len(together),
                               clean_ratios=together, measurements=measurements)


def _sendable(entries: dict[str, Entry]) -> dict[str, bytes | CachedEntry]:
    """What a benchmark job can carry (pickle refuses views): copies only entries the cache
    does not hold."""
    return {t: bytes(e) if isinstance(e, memoryview | bytearray) else e
            for t, e in entries.items()}


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
                attempt: int = 1, again: bool = False) -> BenchRequest:
        """Measure ``entries`` (tier -> artifact) on inputs like the graph's. ``with_graph``:
        eager too, and (``purpose="compare"``) each tier's kernels, for a profile. ``pair``:
        (serving, candidate) timed against each other; a later ``attempt`` measures longer;
        ``again``: an undecided pair is measured again at once (BenchRequest.again)."""
        return BenchRequest(graph_id, _sendable(entries), request.inputs, request.grad_enabled,
                            graph_bytes=request.graph_bytes if with_graph else b"",
                            budget_ms=self.budget_ms * 2 ** (attempt - 1), purpose=purpose,
                            breakdown=purpose == "compare", num_threads=request.num_threads,
                            configs=self._configs, pair=pair or (), again=again)
