"""The gate's decision alone: one measurement reply in, one Decision out, exactly.

No coordinator, no worker, no clock: ``decide`` is handed the reply, the pair's attempt and
contended counts, the threshold and the time its record carries."""

from __future__ import annotations

import logging

import pytest

from hotswap.engine.policy.gate import (
    MAX_ATTEMPTS,
    MAX_CONTENDED,
    Action,
    Decision,
    Measurement,
    Retry,
    decide,
)
from hotswap.engine.shipping.wire import BenchReply
from hotswap.profiles import TierBench
from hotswap.profiles.records import BenchResult, GateDecision, Paired

NOW_S = 123.5
SERVING, CANDIDATE = "default", "max-autotune"


def _pair(ratio: float, low: float, high: float, *, contended: int = 0, rounds: int = 12,
          serving: str = SERVING, candidate: str = CANDIDATE) -> Paired:
    return Paired("g", serving, candidate, 1.0, ratio, ratio, low, high, rounds, contended)


def _medians(**medians: float) -> BenchReply:
    return BenchReply([TierBench("g", tier.replace("_", "-"), BenchResult(ms, ms, ms, 10, "fake"))
                       for tier, ms in medians.items()])


def _of(reply: BenchReply | BaseException, candidate: str = CANDIDATE) -> Measurement:
    return Measurement("g", SERVING, candidate, reply)


def _measured(action: Action, pair: Paired, words: str, *, retry: Retry | None = None,
              threshold: float = 0.02, attempt: int = 1) -> Decision:
    """The Decision on ``pair``: ``words`` is its record's reason, as status shows it."""
    outcome = {Action.ADOPT: "adopt", Action.KEEP: "keep", Action.RETRY: "undecided"}[action]
    confidence = ("" if action is Action.RETRY
                  else "low" if "still undecided" in words else "confident")
    record = GateDecision("g", pair.candidate, pair.serving, action is Action.ADOPT, words,
                          pair.candidate_ms, pair.serving_ms, threshold, NOW_S, outcome,
                          confidence, 1 - pair.ratio, 1 - pair.ratio_high, 1 - pair.ratio_low,
                          pair.rounds, pair.contended, attempt)
    reason = words if action is Action.ADOPT else f"gate: {words}"
    return Decision(action, reason, record, retry)


FASTER = _pair(0.8, 0.78, 0.82)
NOT_FASTER = _pair(1.0, 0.99, 1.01)
STRADDLES = _pair(0.97, 0.95, 1.01)
CONTENDED = _pair(0.5, 0.45, 0.55, contended=8)
# threshold 0.25; every ratio below is exact in binary, so the edges are met exactly
AT_THRESHOLD = _pair(0.75, 0.5, 0.9)         # gain = threshold, slow end still gains: adopt
SLOW_END_ZERO = _pair(0.75, 0.5, 1.0)        # gain = threshold, slow end gains nothing
FAST_END_AT = _pair(0.875, 0.75, 1.0)        # fast end gains exactly the threshold
FAST_END_BELOW = _pair(0.875, 0.8125, 1.0)   # fast end gains less than the threshold
EAGER_HOLDS = _pair(2.0, 1.9, 2.1, candidate="eager")

_FASTER_WORDS = ("0.8000 ms vs 1.0000 ms for 'default': +20.0% (95% interval +18.0% to "
                 "+22.0%), 12 of 12 rounds clean; adopts at >= 2.0% faster: adopt "
                 "(confident: faster)")
_STRADDLES = ("0.9700 ms vs 1.0000 ms for 'default': +3.0% (95% interval -1.0% to +5.0%), 12 "
              "of 12 rounds clean; adopts at >= 2.0% faster: ")
_CONTENDED = ("0.5000 ms vs 1.0000 ms for 'default': +50.0% (95% interval +45.0% to +55.0%), "
              "4 of 12 rounds clean; adopts at >= 2.0% faster: ")

# (measurement, attempt, contended, threshold, the Decision)
CASES: dict[str, tuple[Measurement, int, int, float, Decision]] = {
    "adopt": (_of(BenchReply([], pairs=[FASTER])), 1, 0, 0.02,
              _measured(Action.ADOPT, FASTER, _FASTER_WORDS)),
    "adopt at the last attempt": (_of(BenchReply([], pairs=[FASTER])), MAX_ATTEMPTS, 0, 0.02,
                                  _measured(Action.ADOPT, FASTER, _FASTER_WORDS,
                                            attempt=MAX_ATTEMPTS)),
    "keep": (_of(BenchReply([], pairs=[NOT_FASTER])), 1, 0, 0.02, _measured(
        Action.KEEP, NOT_FASTER, "1.0000 ms vs 1.0000 ms for 'default': +0.0% (95% interval "
        "-1.0% to +1.0%), 12 of 12 rounds clean; adopts at >= 2.0% faster: keep (confident: "
        "not faster)")),
    "straddles, first attempt: again, longer, after 1 s": (
        _of(BenchReply([], pairs=[STRADDLES])), 1, 0, 0.02, _measured(
            Action.RETRY, STRADDLES, _STRADDLES + "undecided (the interval straddles the "
            "threshold)", retry=Retry(1.0, 2, 0))),
    "straddles, second attempt: again after 2 s": (
        _of(BenchReply([], pairs=[STRADDLES])), 2, 1, 0.02, _measured(
            Action.RETRY, STRADDLES, _STRADDLES + "undecided (the interval straddles the "
            "threshold)", retry=Retry(2.0, 3, 1), attempt=2)),
    "straddles at the last attempt: kept, low": (
        _of(BenchReply([], pairs=[STRADDLES])), MAX_ATTEMPTS, 0, 0.02, _measured(
            Action.KEEP, STRADDLES, _STRADDLES + "keep (low: the interval straddles the "
            "threshold; still undecided at attempt 3: the serving tier stays)", attempt=3)),
    "straddles past the last attempt: kept, low": (
        _of(BenchReply([], pairs=[STRADDLES])), MAX_ATTEMPTS + 1, 0, 0.02, _measured(
            Action.KEEP, STRADDLES, _STRADDLES + "keep (low: the interval straddles the "
            "threshold; still undecided at attempt 4: the serving tier stays)", attempt=4)),
    "contended: as long again, after 1 s": (
        _of(BenchReply([], pairs=[CONTENDED])), 1, 0, 0.02, _measured(
            Action.RETRY, CONTENDED, _CONTENDED + "undecided (contended: 8 of 12 rounds "
            "preempted)", retry=Retry(1.0, 1, 1))),
    "contended at the last attempt: pauses double, attempts do not count": (
        _of(BenchReply([], pairs=[CONTENDED])), MAX_ATTEMPTS, 2, 0.02, _measured(
            Action.RETRY, CONTENDED, _CONTENDED + "undecided (contended: 8 of 12 rounds "
            "preempted)", retry=Retry(4.0, MAX_ATTEMPTS, 3), attempt=MAX_ATTEMPTS)),
    "contended, the last pause": (
        _of(BenchReply([], pairs=[CONTENDED])), 1, MAX_CONTENDED - 1, 0.02, _measured(
            Action.RETRY, CONTENDED, _CONTENDED + "undecided (contended: 8 of 12 rounds "
            "preempted)", retry=Retry(32.0, 1, MAX_CONTENDED))),
    "contended once too often: kept, low": (
        _of(BenchReply([], pairs=[CONTENDED])), 1, MAX_CONTENDED, 0.02, _measured(
            Action.KEEP, CONTENDED, _CONTENDED + "keep (low: contended: 8 of 12 rounds "
            "preempted; still undecided at attempt 1: the serving tier stays)")),
    "gain at the threshold, surely faster: adopt": (
        _of(BenchReply([], pairs=[AT_THRESHOLD])), 1, 0, 0.25, _measured(
            Action.ADOPT, AT_THRESHOLD, "0.7500 ms vs 1.0000 ms for 'default': +25.0% (95% "
            "interval +10.0% to +50.0%), 12 of 12 rounds clean; adopts at >= 25.0% faster: "
            "adopt (confident: faster)", threshold=0.25)),
    "gain at the threshold, slow end gains nothing: again": (
        _of(BenchReply([], pairs=[SLOW_END_ZERO])), 1, 0, 0.25, _measured(
            Action.RETRY, SLOW_END_ZERO, "0.7500 ms vs 1.0000 ms for 'default': +25.0% (95% "
            "interval +0.0% to +50.0%), 12 of 12 rounds clean; adopts at >= 25.0% faster: "
            "undecided (the interval straddles the threshold)", retry=Retry(1.0, 2, 0),
            threshold=0.25)),
    "fast end at the threshold: again": (
        _of(BenchReply([], pairs=[FAST_END_AT])), 1, 0, 0.25, _measured(
            Action.RETRY, FAST_END_AT, "0.8750 ms vs 1.0000 ms for 'default': +12.5% (95% "
            "interval +0.0% to +25.0%), 12 of 12 rounds clean; adopts at >= 25.0% faster: "
            "undecided (the interval straddles the threshold)", retry=Retry(1.0, 2, 0),
            threshold=0.25)),
    "fast end below the threshold: keep": (
        _of(BenchReply([], pairs=[FAST_END_BELOW])), 1, 0, 0.25, _measured(
            Action.KEEP, FAST_END_BELOW, "0.8750 ms vs 1.0000 ms for 'default': +12.5% (95% "
            "interval +0.0% to +18.8%), 12 of 12 rounds clean; adopts at >= 25.0% faster: "
            "keep (confident: not faster)", threshold=0.25)),
    "eager measured slower than the tier: keep": (
        _of(BenchReply([], pairs=[EAGER_HOLDS]), "eager"), 1, 0, 0.02, _measured(
            Action.KEEP, EAGER_HOLDS, "2.0000 ms vs 1.0000 ms for 'default': -100.0% (95% "
            "interval -110.0% to -90.0%), 12 of 12 rounds clean; adopts at >= 2.0% faster: "
            "keep (confident: not faster)")),
    "the measurement failed: by order": (
        _of(RuntimeError("benchmark worker unavailable")), 1, 0, 0.02, Decision(Action.BY_ORDER)),
    "medians alone: a pair known exactly": (
        _of(_medians(default=2.0, max_autotune=1.0)), 1, 0, 0.02, Decision(
            Action.ADOPT, "1.0000 ms vs 2.0000 ms for 'default': +50.0% (95% interval +50.0% "
            "to +50.0%), 8 of 8 rounds clean; adopts at >= 2.0% faster: adopt (confident: "
            "faster)", GateDecision(
                "g", CANDIDATE, SERVING, True, "1.0000 ms vs 2.0000 ms for 'default': +50.0% "
                "(95% interval +50.0% to +50.0%), 8 of 8 rounds clean; adopts at >= 2.0% "
                "faster: adopt (confident: faster)", 1.0, 2.0, 0.02, NOW_S, "adopt",
                "confident", 0.5, 0.5, 0.5, 8, 0, 1))),
    "no median for the candidate: kept, saying why": (
        _of(BenchReply([], errors={CANDIDATE: "no median"})), 1, 0, 0.02,
        Decision(Action.KEEP, "gate: could not benchmark it (max-autotune: no median)")),
    "another pair's measurement and nothing else: kept": (
        _of(BenchReply([], pairs=[_pair(0.5, 0.4, 0.6, serving="no-fusion")])), 1, 0, 0.02,
        Decision(Action.KEEP, "gate: could not benchmark it (no result)")),
    "no median for the serving tier: by order": (
        _of(_medians(max_autotune=1.0)), 1, 0, 0.02, Decision(Action.BY_ORDER)),
}


@pytest.mark.parametrize(("measurement", "attempt", "contended", "threshold", "expected"),
                         list(CASES.values()), ids=list(CASES))
def test_decide(measurement: Measurement, attempt: int, contended: int, threshold: float,
                expected: Decision) -> None:
    decision = decide(measurement, attempt=attempt, contended=contended, threshold=threshold,
                      now_s=NOW_S)
    assert decision == expected
    assert (decision.action is Action.RETRY) == (decision.retry is not None)


def test_decide_logs_nothing_and_gives_the_same_decision_twice(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="hotswap"):
        for reply in (BenchReply([], pairs=[STRADDLES]), RuntimeError("worker gone")):
            measurement = _of(reply)
            first, second = (decide(measurement, attempt=1, contended=0, threshold=0.02,
                                    now_s=NOW_S) for _ in range(2))
            assert first == second
    assert caplog.records == []
