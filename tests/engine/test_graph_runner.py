"""GraphRunner's swap rules, and the journey's record of them (status, the tiers' states), with
fake compiled callables: no inductor, no workers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import hotswap
from hotswap.engine.graph import GraphRunner, TierFailed
from hotswap.engine.journey import GraphJourney, TierState
from hotswap.engine.options import Tier
from hotswap.engine.recording import Recorder


def _gm() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(lambda x: (x * 2 + 1,))


X = torch.arange(4.0)
GOOD = (X * 2 + 1,)


def _journey(gm: torch.fx.GraphModule | None = None, tiers: tuple[str, ...] = ("fast", "best"),
             *, verify: bool = False, raise_failures: bool = False) -> GraphJourney:
    """A journey whose tiers are loaded already (what swap_in expects)."""
    gm = gm or _gm()
    runner = GraphRunner("g", gm, list(tiers), verify=verify)
    journey = GraphJourney(runner, gm, [Tier(t) for t in tiers], Recorder(None),
                           raise_failures=raise_failures)
    for tier in tiers:
        journey.arrived(tier, "worker")
    return journey


def _runner(**kwargs: Any) -> GraphRunner:
    return _journey(**kwargs).runner


def test_serves_eagerly_then_swaps_and_counts() -> None:
    runner = _runner()
    with hotswap.counters_delta() as d:
        assert torch.equal(runner(X)[0], GOOD[0])
        assert runner.swap_in("fast", lambda x: GOOD)
        assert runner(X) is GOOD
    assert (d["eager_calls"], d["swaps"]) == (1, 1)
    assert runner.tier == "fast"


def test_lower_tier_arriving_late_is_kept_not_served() -> None:
    journey = _journey()
    journey.swap_in("best", lambda x: GOOD)
    journey.swap_in("fast", lambda x: ("slower",))
    status = journey.status()
    assert status.tier == "best" and status.kept == (("fast", "tier 'best' already serves"),)


def test_verify_rejects_a_tier_that_disagrees() -> None:
    journey = _journey(verify=True)
    journey.swap_in("fast", lambda x: (x * 3,))  # wrong
    with hotswap.counters_delta() as d:
        out = journey.runner(X)
    assert torch.equal(out[0], GOOD[0])  # the call is answered by the previous tier
    status = journey.status()
    assert status.tier == "eager"
    assert status.failures == (("fast", "verify: its output disagrees with the previous tier's"),)
    assert d["fallbacks"] == 1


def test_verify_tolerates_bf16_rounding() -> None:
    journey = _journey(torch.fx.symbolic_trace(lambda x: (x.bfloat16() * 3,)), ("fast",),
                       verify=True)
    journey.swap_in("fast", lambda x: ((x.bfloat16() * 3) * (1 + 2**-9),))  # within bf16 tol.
    journey.runner(torch.linspace(1, 2, 64))
    assert journey.status().tier == "fast" and not journey.status().failures


def test_a_tier_that_raises_is_dropped_and_the_call_still_answered() -> None:
    def broken(x: torch.Tensor) -> Any:
        raise RuntimeError("bad artifact")

    journey = _journey()
    journey.swap_in("fast", lambda x: GOOD)
    journey.runner(X)  # graduates "fast"
    journey.swap_in("best", broken)
    assert journey.state("fast") is TierState.REPLACED
    with hotswap.counters_delta() as d:
        out = journey.runner(X)  # eager answers, so the artifact is at fault
    assert torch.equal(out[0], GOOD[0])  # eager's answer, computed to judge the tier
    assert (d["eager_calls"], d["fallbacks"], d["internal_errors"]) == (1, 1, 0)
    assert journey.runner(X) is GOOD  # "fast", the tier before, serves again
    status = journey.status()
    assert status.tier == "fast"
    assert status.failures[0][0] == "best" and "bad artifact" in status.failures[0][1]
    assert status.states == (("fast", "serving"), ("best", "failed"))


def test_eager_errors_are_the_users_errors() -> None:
    runner = GraphRunner("g", torch.fx.symbolic_trace(lambda x: (x @ x,)), ["fast"])
    with pytest.raises(RuntimeError):
        runner(torch.ones(2, 3))


def _gather_journey() -> tuple[GraphJourney, Any]:
    """A graph that indexes, and a compiled tier that checks its bounds as inductor's C++
    kernels do: another exception type and message than eager's ``IndexError``."""
    gm = torch.fx.symbolic_trace(lambda x, i: (x[i],))

    def compiled(x: torch.Tensor, i: torch.Tensor) -> Any:
        if bool((i >= len(x)).any()):
            raise RuntimeError(f"index out of bounds: 0 <= tmp0 < {len(x)}")
        return GOOD

    return _journey(gm, ("fast",)), compiled


BAD_INDEX = torch.tensor([9])


@pytest.mark.parametrize("graduated", [True, False], ids=["graduated", "on-probation"])
def test_an_input_eager_rejects_is_the_users_error_and_the_tier_stays(graduated: bool) -> None:
    journey, compiled = _gather_journey()
    runner = journey.runner
    runner.listener = seen = _Seen()
    runner.swap_in("fast", compiled)
    if graduated:
        runner(X, torch.tensor([1]))
    with pytest.raises(IndexError) as eager:
        journey.gm(X, BAD_INDEX)
    with hotswap.counters_delta() as d:
        for _ in range(2):
            with pytest.raises(IndexError) as info:
                runner(X, BAD_INDEX)
            assert str(info.value) == str(eager.value)
            # Not chained to the tier's RuntimeError: the traceback is eager's.
            assert info.value.__context__ is None and info.value.__cause__ is None
        assert runner(X, torch.tensor([1])) is GOOD  # the compiled tier answers
    assert (d["eager_calls"], d["fallbacks"], d["internal_errors"]) == (2, 0, 0)
    assert runner.tier == "fast" and journey.status().failures == ()
    assert seen.events == [("swap", "fast", "eager"), ("first_call", "fast", "fast")]
    assert runner(X, torch.tensor([1])) is GOOD and len(seen.events) == 2  # graduated once


def test_an_input_eager_rejects_while_eager_serves_drops_nothing() -> None:
    journey, _ = _gather_journey()
    journey.runner.listener = seen = _Seen()
    with hotswap.counters_delta() as d, pytest.raises(IndexError) as info:
        journey.runner(X, BAD_INDEX)
    assert info.value.__context__ is None
    assert (d["eager_calls"], d["fallbacks"], d["internal_errors"]) == (1, 0, 0)
    assert journey.runner.tier == "eager" and seen.events == []


def test_a_faulty_tier_failing_in_two_calls_at_once_is_dropped_once() -> None:
    both_in = threading.Barrier(2, timeout=10)

    def broken(x: torch.Tensor) -> Any:
        both_in.wait()
        raise RuntimeError("bad artifact")

    journey = _journey()
    journey.swap_in("fast", lambda x: GOOD)
    journey.runner(X)
    journey.swap_in("best", broken)
    outs: list[Any] = []
    with hotswap.counters_delta() as d:
        threads = [threading.Thread(target=lambda: outs.append(journey.runner(X)))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
    assert len(outs) == 2 and all(torch.equal(out[0], GOOD[0]) for out in outs)
    assert (d["fallbacks"], d["internal_errors"]) == (1, 0)
    assert journey.status().states == (("fast", "serving"), ("best", "failed"))


def test_a_tier_swapped_in_during_a_first_call_is_not_undone_by_it() -> None:
    journey = _journey()
    runner = journey.runner

    def fast(x: torch.Tensor) -> Any:
        runner.swap_in("best", lambda x: ("best",))  # the load thread, mid-call
        return GOOD

    runner.swap_in("fast", fast)
    assert runner(X) is GOOD
    assert runner.tier == "best" and runner(X) == ("best",)


def test_on_failure_raise_raises_once_then_serves() -> None:
    journey = _journey(raise_failures=True)
    journey.fail("fast", "CompileFailed: boom")
    with pytest.raises(TierFailed) as info:
        journey.runner(X)
    assert (info.value.tier, info.value.reason) == ("fast", "CompileFailed: boom")
    assert torch.equal(journey.runner(X)[0], GOOD[0])


def test_keep_records_a_ready_tier_that_will_not_serve() -> None:
    journey = _journey()
    journey.swap_in("fast", lambda x: GOOD)
    assert not journey.final  # "best" is loaded, not decided
    journey.keep("best", "gate: not faster")
    status = journey.status()
    assert status.tier == "fast" and status.kept == (("best", "gate: not faster"),)
    assert status.final


def test_a_measured_swap_may_go_down_the_ladder() -> None:
    runner = _runner()
    assert runner.swap_in("best", lambda x: GOOD)
    assert not runner.swap_in("fast", lambda x: GOOD)  # by rank: refused
    assert runner.swap_in("fast", lambda x: GOOD, measured=True)
    assert runner.tier == "fast"


class _Seen:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def swapped(self, tier: str, previous: str) -> None:
        self.events.append(("swap", tier, previous))

    def first_call(self, tier: str, start_s: float, end_s: float) -> None:
        self.events.append(("first_call", tier, tier))

    def dropped(self, tier: str, back_to: str, reason: str) -> None:
        self.events.append(("dropped", back_to, tier))


def test_listener_sees_swaps_first_calls_and_drops() -> None:
    runner = GraphRunner("g", _gm(), ["fast", "best"])
    runner.listener = seen = _Seen()

    def broken(x: torch.Tensor) -> Any:
        raise RuntimeError("boom")

    runner.swap_in("fast", lambda x: GOOD)
    runner(X)
    runner(X)
    runner.swap_in("best", broken)
    runner(X)
    assert seen.events == [("swap", "fast", "eager"), ("first_call", "fast", "fast"),
                           ("swap", "best", "fast"), ("dropped", "fast", "best")]


def test_final_and_pending() -> None:
    gm = _gm()
    runner = GraphRunner("g", gm, ["fast", "best"])
    journey = GraphJourney(runner, gm, [Tier("fast"), Tier("best")], Recorder(None))
    assert journey.status().pending == ("fast", "best") and not journey.status().final
    journey.arrived("fast", "worker")
    journey.swap_in("fast", lambda x: GOOD)
    journey.fail("best", "JobTimeout: slow")
    status = journey.status()
    assert status.final and status.pending == () and status.tier == "fast"
    assert status.states == (("fast", "serving"), ("best", "failed"))


def test_a_move_the_state_machine_forbids_fails_the_tier_and_is_counted() -> None:
    gm = _gm()
    journey = GraphJourney(GraphRunner("g", gm, ["fast"]), gm, [Tier("fast")], Recorder(None))
    with hotswap.counters_delta() as d:
        journey.to("fast", TierState.SERVING)  # pending -> serving skips compiled and loaded
    assert d["internal_errors"] == 1
    assert journey.state("fast") is TierState.FAILED and journey.final
    assert "pending -> serving" in journey.status().failures[0][1]


def _planned(answer: tuple[Any, ...], plans: int, made: list[str], name: str) -> Any:
    """A loaded tier whose first call builds ``plans`` per-thread plans (per_thread.py); each
    one a thread makes ahead is noted in ``made``."""
    from hotswap.engine.loading.per_thread import PerThread

    def plan(i: int) -> None:
        made.append(f"{name}{i}")

    return PerThread(lambda x: answer, [(plan, (i,), {}) for i in range(plans)])


def test_a_tier_swapped_in_while_another_makes_its_plans_stands_in_with_eager() -> None:
    # Not with the other tier's planning: that would make both tiers' plans in one call.
    runner = _runner()
    made: list[str] = []
    fast, best = ("fast",), ("best",)
    assert runner.swap_in("fast", _planned(fast, 3, made, "f"))
    assert torch.equal(runner(X)[0], GOOD[0]) and made == ["f0"]
    assert runner.swap_in("best", _planned(best, 2, made, "b"))
    served = [runner(X) for _ in range(3)]
    assert made == ["f0", "b0", "b1"]  # one plan per call, none of the replaced tier's
    assert [torch.equal(s[0], GOOD[0]) if s not in (fast, best) else s for s in served] == [
        True, True, best]


def test_a_failure_to_raise_once_is_not_raised_again_while_a_tier_makes_its_plans() -> None:
    journey = _journey(raise_failures=True)
    runner = journey.runner
    runner.raise_next(TierFailed("g", "fast", "boom"))
    made: list[str] = []
    assert runner.swap_in("best", _planned(("best",), 2, made, "b"))
    for _ in range(2):  # eager answers while the plans are made: no TierFailed
        assert torch.equal(runner(X)[0], GOOD[0])
    assert runner(X) == ("best",)


def test_plans_end_for_every_thread_after_a_few_calls_per_plan() -> None:
    # A server with a thread per request: no one thread makes every plan.
    from hotswap.engine.loading.per_thread import PLANNING_CALLS_PER_PLAN

    runner = _runner()
    made: list[str] = []
    assert runner.swap_in("fast", _planned(("fast",), 2, made, "f"))
    answers: list[Any] = []

    def request() -> None:
        answers.append(runner(X))

    for _ in range(2 * PLANNING_CALLS_PER_PLAN + 1):
        thread = threading.Thread(target=request)
        thread.start()
        thread.join()
    assert answers[-1] == ("fast",) and len(made) == 2 * PLANNING_CALLS_PER_PLAN
    assert all(torch.equal(a[0], GOOD[0]) for a in answers[:-1])
