"""The gate's decision alone: one measurement reply in, one Decision out, exactly.

No coordinator, no worker, no clock: ``decide`` is handed the reply, the pair's attempt and
contended counts, the threshold and the time its record carries."""

from __future__ import annotations

import logging
import math

import pytest

from hotswap.engine.policy.gate import (
    MAX_ATTEMPTS,
    RETRY_AFTER_S,
    RETRY_CAP_S,
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
          serving: str = SERVING, candidate: str = CANDIDATE,
          every: tuple[float, float] | None = None) -> Paired:
    """``every``: the least and greatest ratio of any round, contended ones included."""
    return Paired("g", serving, candidate, 1.0, ratio, ratio, low, high, rounds, contended,
                  round_low=every[0] if every else None, round_high=every[1] if every else None)


def _medians(**medians: float) -> BenchReply:
    return BenchReply([TierBench("g", tier.replace("_", "-"), BenchResult(ms, ms, ms, 10, "fake"))
                       for tier, ms in medians.items()])


def _of(reply: BenchReply | BaseException, serving: str = SERVING,
        candidate: str = CANDIDATE) -> Measurement:
    return Measurement("g", serving, candidate, reply)


def _measured(action: Action, pair: Paired, words: str, *, retry: Retry | None = None,
              threshold: float = 0.02, attempt: int = 1,
              meanwhile: str | None = None) -> Decision:
    """The Decision on ``pair``: ``words`` is its record's reason, as status shows it;
    ``meanwhile`` (a retry's) defaults to the serving tier."""
    outcome = {Action.ADOPT: "adopt", Action.KEEP: "keep", Action.RETRY: "undecided"}[action]
    confidence = ("" if action is Action.RETRY
                  else "low" if "still undecided" in words else "confident")
    inf = math.isinf(pair.ratio_low)
    record = GateDecision("g", pair.candidate, pair.serving, action is Action.ADOPT, words,
                          pair.candidate_ms, pair.serving_ms, threshold, NOW_S, outcome,
                          confidence, 1 - pair.ratio, None if inf else 1 - pair.ratio_high,
                          None if inf else 1 - pair.ratio_low, pair.rounds, pair.contended,
                          attempt)
    reason = words if action is Action.ADOPT else f"gate: {words}"
    if meanwhile is None:
        meanwhile = pair.serving if action is Action.RETRY else ""
    return Decision(action, reason, record, retry, meanwhile)


FASTER = _pair(0.8, 0.78, 0.82)
NOT_FASTER = _pair(1.0, 0.99, 1.01)
STRADDLES = _pair(0.97, 0.95, 1.01)
CONTENDED = _pair(0.5, 0.45, 0.55, contended=8)
# threshold 0.25; every ratio below is exact in binary, so the edges are met exactly
AT_THRESHOLD = _pair(0.75, 0.5, 0.9)         # gain = threshold, slow end still gains: adopt
SLOW_END_ZERO = _pair(0.75, 0.5, 1.0)        # gain = threshold, slow end gains nothing
FAST_END_AT = _pair(0.875, 0.75, 1.0)        # fast end gains exactly the threshold
FAST_END_BELOW = _pair(0.875, 0.8125, 1.0)   # fast end gains less than the threshold
BEATS_EAGER = _pair(0.5, 0.45, 0.55, serving="eager", candidate="default")
# Every round preempted, and every round says the same wide gap (contended rounds by their
# fastest blocks): contention cannot fake that.
INF = math.inf
SWEPT_SLOWER = _pair(10.0, -INF, INF, rounds=24, contended=24, every=(8.0, 12.0))
SWEPT_FASTER = _pair(0.1, -INF, INF, rounds=24, contended=24, every=(0.08, 0.12))
NARROW = _pair(0.8, -INF, INF, rounds=24, contended=24, every=(0.7, 0.9))
# ... but one round of 24 says the other way: not decided.
SPLIT = _pair(0.1, -INF, INF, rounds=24, contended=24, every=(0.08, 1.2))

LOG_HALF = math.log(0.5)
_PER_CALL = "per call 'max-autotune' {:.4f} ms, 'default' 1.0000 ms"
_FASTER_WORDS = ("'max-autotune' is 20.0% faster than 'default'; adopted 'max-autotune' "
                 "(median of 12 paired rounds, 95% interval +18.0% to +22.0%; 12 of 12 rounds "
                 "clean; " + _PER_CALL.format(0.8) + "; adopts at >= 2.0% faster; confident: "
                 "faster)")
_STRADDLES = ("'max-autotune' is 3.0% faster than 'default'{} (median of 12 paired rounds, "
              "95% interval -1.0% to +5.0%; 12 of 12 rounds clean; " + _PER_CALL.format(0.97)
              + "; adopts at >= 2.0% faster; ")
_STRADDLES_AGAIN = _STRADDLES.format(" so far; deciding") + "the interval straddles the threshold)"
_CONTENDED = ("'max-autotune' is 2.0x faster than 'default' so far; deciding (median of 4 "
              "paired rounds; 4 of 12 rounds clean, 8 contended; " + _PER_CALL.format(0.5)
              + " (contended); adopts at >= 2.0% faster; contended: 8 of 12 rounds preempted)")
_SWEPT = ("median of 24 contended rounds, their fastest blocks; 0 of 24 rounds clean, 24 "
          "contended; " + _PER_CALL + " (contended); adopts at >= 2.0% faster; ")

# (measurement, attempt, contended, threshold, the Decision)
CASES: dict[str, tuple[Measurement, int, int, float, Decision]] = {
    "adopt": (_of(BenchReply([], pairs=[FASTER])), 1, 0, 0.02,
              _measured(Action.ADOPT, FASTER, _FASTER_WORDS)),
    "adopt at the last attempt": (_of(BenchReply([], pairs=[FASTER])), MAX_ATTEMPTS, 0, 0.02,
                                  _measured(Action.ADOPT, FASTER, _FASTER_WORDS,
                                            attempt=MAX_ATTEMPTS)),
    "keep": (_of(BenchReply([], pairs=[NOT_FASTER])), 1, 0, 0.02, _measured(
        Action.KEEP, NOT_FASTER, "'max-autotune' and 'default' measured the same; kept "
        "'default' (median of 12 paired rounds, 95% interval -1.0% to +1.0%; 12 of 12 rounds "
        "clean; " + _PER_CALL.format(1.0) + "; adopts at >= 2.0% faster; confident: not "
        "faster)")),
    "straddles, first attempt: again, longer, after 1 s": (
        _of(BenchReply([], pairs=[STRADDLES])), 1, 0, 0.02, _measured(
            Action.RETRY, STRADDLES, _STRADDLES_AGAIN, retry=Retry(1.0, 2, 0), meanwhile="")),
    "straddles, second attempt: again after 2 s": (
        _of(BenchReply([], pairs=[STRADDLES])), 2, 1, 0.02, _measured(
            Action.RETRY, STRADDLES, _STRADDLES_AGAIN, retry=Retry(2.0, 3, 1), attempt=2,
            meanwhile="")),
    "straddles at the last attempt: kept, low": (
        _of(BenchReply([], pairs=[STRADDLES])), MAX_ATTEMPTS, 0, 0.02, _measured(
            Action.KEEP, STRADDLES, _STRADDLES.format("; kept 'default'") + "low: the interval "
            "straddles the threshold; still undecided at attempt 3: the serving tier stays)",
            attempt=3)),
    "straddles past the last attempt: kept, low": (
        _of(BenchReply([], pairs=[STRADDLES])), MAX_ATTEMPTS + 1, 0, 0.02, _measured(
            Action.KEEP, STRADDLES, _STRADDLES.format("; kept 'default'") + "low: the interval "
            "straddles the threshold; still undecided at attempt 4: the serving tier stays)",
            attempt=4)),
    "contended: as long again, after 1 s, the faster median serving meanwhile": (
        _of(BenchReply([], pairs=[CONTENDED])), 1, 0, 0.02, _measured(
            Action.RETRY, CONTENDED, _CONTENDED, retry=Retry(1.0, 1, 1, LOG_HALF, 1, clean=4, rounds=12),
            meanwhile=CANDIDATE)),
    "contended at the last attempt: attempts do not count": (
        _of(BenchReply([], pairs=[CONTENDED])), MAX_ATTEMPTS, 2, 0.02, _measured(
            Action.RETRY, CONTENDED, _CONTENDED,
            retry=Retry(1.0, MAX_ATTEMPTS, 3, LOG_HALF, 1, clean=4, rounds=12),
            attempt=MAX_ATTEMPTS, meanwhile=CANDIDATE)),
    "contended, however many before, with clean rounds to pool: again after 1 s": (
        _of(BenchReply([], pairs=[CONTENDED])), 1, 5, 0.02, _measured(
            Action.RETRY, CONTENDED, _CONTENDED,
            retry=Retry(1.0, 1, 6, LOG_HALF, 1, clean=4, rounds=12),
            meanwhile=CANDIDATE)),
    "every round contended, every round 10x slower: keep": (
        _of(BenchReply([], pairs=[SWEPT_SLOWER])), 1, 0, 0.02, _measured(
            Action.KEEP, SWEPT_SLOWER, "'default' is 10.0x faster than 'max-autotune'; kept "
            "'default' (" + _SWEPT.format(10.0) + "confident: slower by more than the threshold in "
            "every one of 24 rounds (24 contended: candidate / serving from 8.00 to 12.00))")),
    "every round contended, every round 10x faster: adopt": (
        _of(BenchReply([], pairs=[SWEPT_FASTER])), 1, 0, 0.02, _measured(
            Action.ADOPT, SWEPT_FASTER, "'max-autotune' is 10.0x faster than 'default'; "
            "adopted 'max-autotune' (" + _SWEPT.format(0.1) + "confident: faster by more than "
            "the threshold in every one of 24 rounds (24 contended: candidate / serving from "
            "0.08 to 0.12))")),
    "every round contended, one round the other way: again, the faster median meanwhile": (
        _of(BenchReply([], pairs=[SPLIT])), 1, 0, 0.02, _measured(
            Action.RETRY, SPLIT, "'max-autotune' is 10.0x faster than 'default' so far; "
            "deciding (" + _SWEPT.format(0.1) + "contended: 24 of 24 rounds preempted; "
            "rounds candidate / serving from 0.08 to 1.20)",
            retry=Retry(1.0, 1, 1, math.log(0.1), 1, blind=1, rounds=24), meanwhile=CANDIDATE)),
    "every round contended and agreeing, but by less than 1.5x: again": (
        _of(BenchReply([], pairs=[NARROW])), 1, 0, 0.02, _measured(
            Action.RETRY, NARROW, "'max-autotune' is 20.0% faster than 'default' so far; "
            "deciding (" + _SWEPT.format(0.8) + "contended: 24 of 24 rounds preempted; rounds "
            "candidate / serving from 0.70 to 0.90)",
            retry=Retry(1.0, 1, 1, math.log(0.8), 1, blind=1, rounds=24),
            meanwhile=CANDIDATE)),
    "gain at the threshold, surely faster: adopt": (
        _of(BenchReply([], pairs=[AT_THRESHOLD])), 1, 0, 0.25, _measured(
            Action.ADOPT, AT_THRESHOLD, "'max-autotune' is 25.0% faster than 'default'; "
            "adopted 'max-autotune' (median of 12 paired rounds, 95% interval +10.0% to "
            "+50.0%; 12 of 12 rounds clean; " + _PER_CALL.format(0.75) + "; adopts at >= "
            "25.0% faster; confident: faster)", threshold=0.25)),
    "gain at the threshold, slow end gains nothing: again": (
        _of(BenchReply([], pairs=[SLOW_END_ZERO])), 1, 0, 0.25, _measured(
            Action.RETRY, SLOW_END_ZERO, "'max-autotune' is 25.0% faster than 'default' so "
            "far; deciding (median of 12 paired rounds, 95% interval +0.0% to +50.0%; 12 of 12 "
            "rounds clean; " + _PER_CALL.format(0.75) + "; adopts at >= 25.0% faster; the "
            "interval straddles the threshold)", retry=Retry(1.0, 2, 0), threshold=0.25,
            meanwhile="")),
    "fast end at the threshold: again": (
        _of(BenchReply([], pairs=[FAST_END_AT])), 1, 0, 0.25, _measured(
            Action.RETRY, FAST_END_AT, "'max-autotune' is 12.5% faster than 'default' so far; "
            "deciding (median of 12 paired rounds, 95% interval +0.0% to +25.0%; 12 of 12 "
            "rounds clean; " + _PER_CALL.format(0.875) + "; adopts at >= 25.0% faster; the "
            "interval straddles the threshold)", retry=Retry(1.0, 2, 0), threshold=0.25,
            meanwhile="")),
    "fast end below the threshold: keep": (
        _of(BenchReply([], pairs=[FAST_END_BELOW])), 1, 0, 0.25, _measured(
            Action.KEEP, FAST_END_BELOW, "'max-autotune' is 12.5% faster than 'default'; kept "
            "'default' (median of 12 paired rounds, 95% interval +0.0% to +18.8%; 12 of 12 "
            "rounds clean; " + _PER_CALL.format(0.875) + "; adopts at >= 25.0% faster; "
            "confident: not faster)", threshold=0.25)),
    "a tier against eager, twice as fast: adopt": (
        _of(BenchReply([], pairs=[BEATS_EAGER]), "eager", "default"), 1, 0, 0.02, _measured(
            Action.ADOPT, BEATS_EAGER, "'default' is 2.0x faster than eager; adopted 'default' "
            "(median of 12 paired rounds, 95% interval 1.8x to 2.2x; 12 of 12 rounds clean; "
            "per call 'default' 0.5000 ms, eager 1.0000 ms; adopts at >= 2.0% faster; "
            "confident: faster)")),
    "the measurement failed: by order": (
        _of(RuntimeError("benchmark worker unavailable")), 1, 0, 0.02, Decision(Action.BY_ORDER)),
    "medians alone: a pair known exactly": (
        _of(_medians(default=2.0, max_autotune=1.0)), 1, 0, 0.02, Decision(
            Action.ADOPT, _MEDIANS_WORDS := (
                "'max-autotune' is 2.0x faster than 'default'; adopted 'max-autotune' (median "
                "of 8 paired rounds, 95% interval 2.0x to 2.0x; 8 of 8 rounds clean; per call "
                "'max-autotune' 1.0000 ms, 'default' 2.0000 ms; adopts at >= 2.0% faster; "
                "confident: faster)"), GateDecision(
                "g", CANDIDATE, SERVING, True, _MEDIANS_WORDS, 1.0, 2.0, 0.02, NOW_S, "adopt",
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


@pytest.mark.parametrize("ratio", [0.05, 0.5, 0.9, 0.97, 0.99, 1.0, 1.01, 1.03, 1.1, 2.0, 20.0])
def test_the_words_follow_the_statistic_that_decides(ratio: float) -> None:
    """One statistic, the paired ratio, gives the faster tier named, its margin and the
    verdict: never a number whose sign disagrees with the words."""
    pair = _pair(ratio, ratio * 0.99, ratio * 1.01, rounds=24)
    decision = decide(_of(BenchReply([], pairs=[pair])), attempt=MAX_ATTEMPTS, contended=0,
                      threshold=0.02, now_s=NOW_S)
    words = decision.reason.removeprefix("gate: ")
    if ratio < 1:
        assert words.startswith("'max-autotune' is ") and " faster than 'default'" in words
    elif ratio > 1:
        assert words.startswith("'default' is ") and " faster than 'max-autotune'" in words
        assert decision.action is Action.KEEP and "; kept 'default' (" in words
    if decision.action is Action.ADOPT:
        assert ratio < 1 and "; adopted 'max-autotune' (" in words


def test_medians_that_disagree_with_the_paired_ratio_are_said_to() -> None:
    # As a busy machine measured them: the per-call medians have the candidate faster, the
    # median of the paired rounds' ratios has it 2.6 % slower, and the ratio decides.
    pair = Paired("g", SERVING, CANDIDATE, 1.6058, 1.5928, 1.026, 1.01, 1.04, 24, 0)
    decision = decide(_of(BenchReply([], pairs=[pair])), attempt=1, contended=0,
                      threshold=0.02, now_s=NOW_S)
    assert decision.action is Action.KEEP
    assert decision.reason.startswith("gate: 'default' is 2.5% faster than 'max-autotune'; "
                                      "kept 'default' (")
    assert ("per call 'max-autotune' 1.5928 ms, 'default' 1.6058 ms (these medians point the "
            "other way; the paired rounds decide)") in decision.reason


def test_one_lucky_contended_measurement_does_not_serve_a_tier_the_others_had_slower() -> None:
    # As on the 2-core box beside a full test run: contended measurements had eager 4x-13x
    # faster than scalar, then one had scalar 14 % faster. Eager serves on.
    lucky = _pair(0.86, -INF, INF, rounds=24, contended=24, every=(0.57, 9.96),
                  serving="eager", candidate="scalar")
    earlier = 3 * math.log(5.0)
    decision = decide(_of(BenchReply([], pairs=[lucky]), "eager", "scalar"), attempt=1,
                      contended=3, threshold=0.02, now_s=NOW_S, evidence=earlier, blind=3)
    assert decision.action is Action.RETRY and decision.meanwhile == "eager"
    assert decision.retry == Retry(8.0, 1, 4, earlier + math.log(0.86), 1, blind=4, rounds=24)
    # After nine such (the fifth contended measurement on), slower on average: kept out.
    kept = decide(_of(BenchReply([], pairs=[lucky]), "eager", "scalar"), attempt=1,
                  contended=9, threshold=0.02, now_s=NOW_S, evidence=9 * math.log(5.0))
    assert kept.action is Action.KEEP and kept.record is not None
    assert kept.record.confidence == "low" and "kept eager" in kept.reason


def test_a_tier_on_trial_stays_while_ahead_and_gives_way_once_behind() -> None:
    # As the cold demo's two tiers 1-4 % apart: the first contended measurement had the
    # candidate 2x faster (it serves on trial). Next, one has it 1.96x slower: over both it
    # is 1 % ahead, under the threshold: nothing swaps (each way it was swapped before).
    # One at 2.1x slower puts it behind: the serving tier serves again.
    earlier = math.log(0.5)
    for ratio, meanwhile in ((1.96, ""), (2.1, SERVING), (0.9, CANDIDATE)):
        again = _pair(ratio, -INF, INF, rounds=24, contended=24, every=(0.4, 2.5))
        decision = decide(_of(BenchReply([], pairs=[again])), attempt=1, contended=1,
                          threshold=0.02, now_s=NOW_S, evidence=earlier)
        assert decision.action is Action.RETRY and decision.meanwhile == meanwhile, ratio


def _in_a_row(pair: Paired, streak: int) -> Decision:
    return decide(_of(BenchReply([], pairs=[pair])), attempt=1, contended=abs(streak),
                  threshold=0.02, now_s=NOW_S, streak=streak)


def test_contended_measurements_in_a_row_with_one_tier_ahead_decide() -> None:
    # As the demo's caller does on 2 cores: no round clean, the rounds' range across 1.0, and
    # measurement after measurement 'max-autotune' 25-35 % faster.
    ahead = _pair(0.75, -INF, INF, rounds=24, contended=24, every=(0.45, 1.5))
    first, second = _in_a_row(ahead, 0), _in_a_row(ahead, 1)
    assert (first.action, first.retry.streak if first.retry else None) == (Action.RETRY, 1)
    assert (second.action, second.retry.streak if second.retry else None) == (Action.RETRY, 2)
    third = _in_a_row(ahead, 2)
    assert third.action is Action.ADOPT and third.record is not None
    assert third.record.confidence == "confident"
    assert third.reason.startswith("'max-autotune' is 25.0% faster than 'default'; adopted ")
    assert "faster by more than the threshold in each of 3 contended measurements in a row" in (
        third.reason)
    behind = _pair(1.4, -INF, INF, rounds=24, contended=24, every=(0.7, 2.5))
    kept = _in_a_row(behind, -2)
    assert kept.action is Action.KEEP
    assert "slower by more than the threshold in each of 3 contended measurements" in kept.reason


def test_a_measurement_the_other_way_or_too_close_starts_the_row_again() -> None:
    other_way = _pair(1.4, -INF, INF, rounds=24, contended=24, every=(0.7, 2.5))
    again = _in_a_row(other_way, 2)
    assert again.action is Action.RETRY and again.retry is not None and again.retry.streak == -1
    close = _pair(0.99, -INF, INF, rounds=24, contended=24, every=(0.7, 1.3))
    reset = _in_a_row(close, 2)
    assert reset.action is Action.RETRY and reset.retry is not None and reset.retry.streak == 0


@pytest.mark.parametrize(("blind", "pause_s"), [(0, 1.0), (1, 2.0), (2, 4.0), (5, RETRY_CAP_S),
                                               (50, RETRY_CAP_S)])
def test_pauses_double_after_measurements_that_kept_no_clean_round(blind: int,
                                                                   pause_s: float) -> None:
    """A busy caller leaves each measurement a few clean rounds, which pool: the next one
    follows after a second. Only a measurement with none waits for the machine, each such
    pause twice the last, up to the cap."""
    decision = decide(_of(BenchReply([], pairs=[SPLIT])), attempt=1, contended=blind,
                      threshold=0.02, now_s=NOW_S, blind=blind, evidence=blind * math.log(0.5))
    assert decision.action is Action.RETRY and decision.retry is not None
    assert decision.retry.after_s == pause_s and decision.retry.blind == blind + 1


def test_far_apart_but_never_three_in_a_row_is_measured_again_however_long_it_takes() -> None:
    # A hundred contended measurements before, averaging 0.7 (not close), the last one the other
    # way: no tier three times in a row ahead, so the pair is measured again, after the cap.
    earlier = 100 * math.log(0.7)
    decision = decide(_of(BenchReply([], pairs=[CONTENDED])), attempt=1, contended=100,
                      threshold=0.02, now_s=NOW_S, evidence=earlier, streak=-1)
    assert decision.action is Action.RETRY and decision.meanwhile == CANDIDATE
    assert decision.retry == Retry(RETRY_AFTER_S, 1, 101, earlier + LOG_HALF, 1, clean=4,
                                   rounds=12)


def test_contended_measurements_too_close_to_call_keep_what_serves() -> None:
    # As the demo's max-autotune against default on a busy 2-core box: within a few per cent,
    # either way, measurement after measurement.
    close = _pair(1.03, -INF, INF, rounds=24, contended=24, every=(0.8, 1.3))
    earlier = math.log(0.96) + math.log(0.99) + math.log(1.05) + math.log(0.98)
    early = decide(_of(BenchReply([], pairs=[close])), attempt=1, contended=3, threshold=0.02,
                   now_s=NOW_S, evidence=earlier - math.log(0.98))
    assert early.action is Action.RETRY  # the fourth contended measurement: not yet
    kept = decide(_of(BenchReply([], pairs=[close])), attempt=1, contended=4, threshold=0.02,
                  now_s=NOW_S, evidence=earlier)
    assert kept.action is Action.KEEP and kept.record is not None
    # Its ratio came from contended rounds alone (no clean round: their fastest blocks, which
    # contention pulls toward 1.0): low confidence, measured again by a later process.
    assert kept.record.confidence == "low"
    assert "too close to call on this machine: over 5 contended measurements" in kept.reason
    # Its words state the statistic that decided (the mean), not this measurement's own
    # ratio, so that words and figures cannot point different ways.
    assert kept.reason.startswith(
        "gate: 'default' is 0.1% faster than 'max-autotune' over 5 measurements; "
        "kept 'default' (this measurement: 'max-autotune' 1.0300 ms, 'default' 1.0000 ms"), (
        kept.reason)
    # The same, where every measurement's ratio is the median of its clean rounds (a few each,
    # 8 or more together): contention bent none of them, so the pair is close.
    few_clean = _pair(1.03, -INF, INF, rounds=24, contended=20, every=(0.8, 1.3))
    pooled = decide(_of(BenchReply([], pairs=[few_clean])), attempt=1, contended=4,
                    threshold=0.02, now_s=NOW_S, evidence=earlier, clean=16, blind=0)
    assert pooled.action is Action.KEEP and pooled.record is not None
    assert pooled.record.confidence == "close"
    blind = decide(_of(BenchReply([], pairs=[few_clean])), attempt=1, contended=4,
                   threshold=0.02, now_s=NOW_S, evidence=earlier, clean=12, blind=1)
    assert blind.record is not None and blind.record.confidence == "low"


def test_contended_measurements_with_the_candidate_slower_on_average_keep_what_serves() -> None:
    # As the cold demo's max-autotune against default: contended measurement after
    # measurement, default ahead by 0.4 % to 16 % but never three times in a row by more
    # than the threshold. Slower by any amount costs nothing kept out: from the fifth on, kept.
    ratios = (1.118, 1.162, 1.004, 1.034)
    once_more = _pair(0.992, -INF, INF, rounds=24, contended=24, every=(0.6, 1.7))
    earlier = sum(math.log(r) for r in ratios)
    early = decide(_of(BenchReply([], pairs=[once_more])), attempt=1, contended=3,
                   threshold=0.02, now_s=NOW_S, evidence=earlier - math.log(ratios[-1]))
    assert early.action is Action.RETRY
    kept = decide(_of(BenchReply([], pairs=[once_more])), attempt=1, contended=4,
                  threshold=0.02, now_s=NOW_S, evidence=earlier)
    assert kept.action is Action.KEEP and kept.record is not None
    assert kept.record.confidence == "low"
    assert kept.reason.startswith("gate: 'default' is 5.7% faster than 'max-autotune' over 5 "
                                  "measurements; kept 'default' ("), kept.reason
    assert "low: slower on this machine: over 5 contended measurements" in kept.reason
    # The other way, a candidate ahead by more than the margin on average is not kept.
    ahead = decide(_of(BenchReply([], pairs=[once_more])), attempt=1, contended=4,
                   threshold=0.02, now_s=NOW_S, evidence=-earlier)
    assert ahead.action is Action.RETRY


def _few(ratios: tuple[float, ...]) -> Paired:
    """A contended measurement: 24 rounds, only ``ratios`` clean, the others disagreeing."""
    ratio = sorted(ratios)[len(ratios) // 2]
    return Paired("g", SERVING, CANDIDATE, 1.0, ratio, ratio, -INF, INF, 24, 24 - len(ratios),
                  round_low=0.5, round_high=2.0, clean_ratios=ratios)


def _next(pair: Paired, so_far: Retry) -> Decision:
    return decide(_of(BenchReply([], pairs=[pair])), attempt=1, contended=so_far.contended,
                  threshold=0.02, now_s=NOW_S, evidence=so_far.evidence, streak=so_far.streak,
                  clean=so_far.clean, blind=so_far.blind, clean_ratios=so_far.clean_ratios,
                  rounds=so_far.rounds)


def test_contended_measurements_pool_their_clean_rounds() -> None:
    # Each leaves 4 or 5 clean rounds, too few alone; together they give an interval.
    first = _next(_few((0.80, 0.82, 0.79, 0.81)), Retry(0.0, 1, 0))
    assert first.action is Action.RETRY and first.retry is not None
    assert first.retry.clean_ratios == (0.80, 0.82, 0.79, 0.81) and first.retry.rounds == 24
    second = _next(_few((0.78, 0.80, 0.83, 0.79, 0.81)), first.retry)
    assert second.action is Action.ADOPT and second.record is not None
    assert (second.record.rounds, second.record.contended) == (48, 39)
    assert second.reason.startswith("'max-autotune' is 20.0% faster than 'default'; adopted ")
    assert ("(median of 9 paired rounds, the clean ones of 2 measurements together, 95% "
            "interval +18.0% to +21.0%; 9 of 48 rounds clean, 39 contended;") in second.reason


def test_pooled_rounds_too_close_to_matter_keep_the_serving_tier_from_the_third_on() -> None:
    # The candidate at most 4 % faster, maybe slower: after three measurements, "close".
    third = _next(_few(NEAR), _undecided(_few(NEAR), 2))
    assert third.action is Action.KEEP and third.record is not None
    assert third.record.confidence == "close"
    assert ("still undecided at attempt 3: the serving tier stays (the candidate is at most "
            "3.0% faster, within 5%") in third.reason
    # Wider than that (maybe 20 % faster): measured again, as before.
    _undecided(_few((0.8, 1.2, 0.85, 1.15, 1.0)), 3)


NEAR = (0.96, 1.01, 0.97, 1.02, 0.995)


def _undecided(pair: Paired, times: int) -> Retry:
    """``pair`` measured ``times`` in a row, each time undecided: what the next one is handed."""
    so_far = Retry(0.0, 1, 0)
    for _ in range(times):
        decision = _next(pair, so_far)
        assert decision.action is Action.RETRY and decision.retry is not None
        so_far = decision.retry
    return so_far


def test_a_streak_decides_before_the_pooled_rounds() -> None:
    # Three contended measurements in a row with the candidate 2.5 % ahead by their medians:
    # the streak adopts it, though the pooled clean rounds alone would have kept the serving
    # tier as "close" (their interval +0.0 % to +4.0 %).
    ahead = (0.975, 0.96, 1.0, 0.97, 0.98)
    so_far = _undecided(_few(ahead), 2)
    assert so_far.streak == 2
    third = _next(_few(ahead), so_far)
    assert third.action is Action.ADOPT and third.record is not None
    assert "in each of 3 contended measurements in a row" in third.reason


def test_measurements_an_earlier_process_made_count_as_evidence_not_toward_pauses() -> None:
    # Far from close (the candidate 1.7x faster, after five near 1.0): measured again. Five of
    # this process's own contended measurements without a clean round would pause 2**5 s
    # (capped); five inherited ones, the first pause.
    far = _pair(0.6, -INF, INF, rounds=24, contended=24, every=(0.3, 1.6))
    earlier = 5 * math.log(1.01)
    own = decide(_of(BenchReply([], pairs=[far])), attempt=1, contended=5, threshold=0.02,
                 now_s=NOW_S, evidence=earlier, blind=5)
    inherited = decide(_of(BenchReply([], pairs=[far])), attempt=1, contended=5,
                       threshold=0.02, now_s=NOW_S, evidence=earlier, inherited=5)
    assert own.retry is not None and inherited.retry is not None
    assert own.retry.after_s == RETRY_CAP_S and inherited.retry.after_s == RETRY_AFTER_S
    assert inherited.retry.contended == 6 and inherited.retry.inherited == 5


def test_inherited_measurements_close_a_pair_only_beside_one_as_close_of_this_process() -> None:
    # Five earlier measurements at 1.0, then this process measures the candidate 15 % faster:
    # measured again, not kept on history; one as close as they were keeps what serves.
    far = _pair(0.85, -INF, INF, rounds=24, contended=24, every=(0.5, 1.2))
    again = decide(_of(BenchReply([], pairs=[far])), attempt=1, contended=5, threshold=0.02,
                   now_s=NOW_S, evidence=0.0, inherited=5)
    assert again.action is Action.RETRY
    close = _pair(0.96, -INF, INF, rounds=24, contended=24, every=(0.5, 1.2))
    kept = decide(_of(BenchReply([], pairs=[close])), attempt=1, contended=5, threshold=0.02,
                  now_s=NOW_S, evidence=0.0, inherited=5)
    assert kept.action is Action.KEEP and kept.record is not None
    # ahead by less than the close band: "within", never "faster ...; kept" the other one
    assert kept.reason.startswith("gate: 'max-autotune' and 'default' are within 0.7% of each "
                                  "other over 6 measurements; kept 'default'"), kept.reason
    assert kept.record.confidence == "low"  # an earlier process's rounds count as without


def test_inherited_measurements_and_this_one_far_slower_keep_what_serves() -> None:
    # Slower by any amount keeps a candidate out: beside five earlier measurements at 1.0,
    # this process's own measurement 30 % slower keeps it out (low: contended), not again.
    far = _pair(1.3, -INF, INF, rounds=24, contended=24, every=(0.9, 1.6))
    kept = decide(_of(BenchReply([], pairs=[far])), attempt=1, contended=5, threshold=0.02,
                  now_s=NOW_S, evidence=0.0, inherited=5)
    assert kept.action is Action.KEEP and kept.record is not None
    assert kept.record.confidence == "low" and "slower on this machine" in kept.reason
