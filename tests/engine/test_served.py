"""A tier's calls timed as it serves them (hotswap/engine/served.py), against the gate's
measurement: two windows, the hot path bare between and after them, and a steady window
slower than measured reported and counted; an ungated tier on probation against eager's calls.
Fake tiers: no inductor, no workers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hotswap
from hotswap.engine import served
from hotswap.engine.graph import GraphRunner
from hotswap.engine.journey import GraphJourney, GraphStatus
from hotswap.engine.options import Tier
from hotswap.engine.recording import Recorder
from hotswap.engine.served import CallClock

X = torch.arange(4.0)


@pytest.fixture(autouse=True)
def _short_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served, "WINDOW", 5)
    monkeypatch.setattr(served, "MIN_CALLS", 3)
    monkeypatch.setattr(served, "STEADY_AFTER_S", 0.2)


def _journey() -> GraphJourney:
    gm = torch.fx.symbolic_trace(lambda x: (x * 2 + 1,))
    runner = GraphRunner("g", gm, ["fast"])
    journey = GraphJourney(runner, gm, [Tier("fast")], Recorder(None))
    runner.clock = CallClock()  # a graph on the CPU (the journey reads the device from inputs)
    journey.arrived("fast", "worker")
    return journey


@torch.fx.wrap
def _nap(x: torch.Tensor, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return x


def _napping(eager_s: float) -> GraphJourney:
    """A journey whose eager graph sleeps ``eager_s`` a call, its tier ready to swap in."""
    gm = torch.fx.symbolic_trace(lambda x: (_nap(x, eager_s) * 2 + 1,))
    runner = GraphRunner("g", gm, ["fast"])
    journey = GraphJourney(runner, gm, [Tier("fast")], Recorder(None))
    runner.clock = CallClock()
    journey.arrived("fast", "worker")
    return journey


def _two_tiers() -> GraphJourney:
    gm = torch.fx.symbolic_trace(lambda x: (x * 2 + 1,))
    runner = GraphRunner("g", gm, ["fast", "best"])
    journey = GraphJourney(runner, gm, [Tier("fast"), Tier("best")], Recorder(None))
    runner.clock = CallClock()
    for name in ("fast", "best"):
        journey.arrived(name, "worker")
    return journey


def _sleeping(seconds: Callable[[], float]) -> Callable[..., Any]:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        time.sleep(seconds())
        return (x * 2 + 1,)

    return fn


def _until(journey: GraphJourney, done: Callable[[GraphStatus], bool]) -> GraphStatus:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = journey.status()
        if done(status):
            return status
        time.sleep(0.01)
    raise AssertionError(f"not reached in 10 s: {journey.status()}")


def _timed_again(journey: GraphJourney, tier: Callable[..., Any]) -> None:
    """Wait for the steady window's timer (on the scheduler lane, which other work may hold)."""
    deadline = time.monotonic() + 10
    while journey.runner.serving is tier:
        assert time.monotonic() < deadline, "the steady window never began"
        time.sleep(0.01)


def _call(journey: GraphJourney, n: int) -> None:
    for _ in range(n):
        torch.testing.assert_close(journey.runner(X)[0], X * 2 + 1)


def _serve_both_windows(journey: GraphJourney, tier: Callable[..., Any]) -> None:
    """Swap ``tier`` in as "fast", then call it: its first call, its first window and, once
    its timer has begun it, its steady window (at once where it no longer serves)."""
    journey.swap_in("fast", tier)
    _call(journey, 1 + served.WINDOW)
    _timed_again(journey, tier)
    _call(journey, served.WINDOW)


def test_two_windows_are_timed_and_the_hot_path_is_bare_between_and_after() -> None:
    delay = [0.004]
    tier = _sleeping(lambda: delay[0])
    journey = _journey()
    journey.measured("fast", 8.0, contended=False)  # sleep(4 ms) overshoots on a busy box
    journey.swap_in("fast", tier)
    _call(journey, 1 + served.WINDOW)  # the first call (probation), then the first window
    assert journey.runner.serving is tier  # the window is full: the artifact alone
    first = _until(journey, lambda s: "first" in s.served_ms.get("fast", {}))
    assert 4.0 <= first.served_ms["fast"]["first"] < 40.0
    assert first.served_ms["fast"]["first_max"] >= first.served_ms["fast"]["first"]
    _timed_again(journey, tier)  # the steady window
    with hotswap.counters_delta() as d:
        _call(journey, served.WINDOW)
        steady = _until(journey, lambda s: "steady" in s.served_ms["fast"])
    assert journey.runner.serving is tier
    assert steady.served_ms["fast"]["measured"] == 8.0
    assert steady.served_gap == "" and d["served_gaps"] == 0  # as measured: no gap


def test_a_steady_window_slower_than_measured_is_reported_and_counted() -> None:
    journey = _journey()
    journey.measured("fast", 1.0, contended=True)
    tier = _sleeping(lambda: 0.005)
    journey.swap_in("fast", tier)
    with hotswap.counters_delta() as d:
        _call(journey, 1 + served.WINDOW)
        _timed_again(journey, tier)
        _call(journey, served.WINDOW)
        status = _until(journey, lambda s: bool(s.served_gap))
    assert d["served_gaps"] == 1
    assert status.served_gap.startswith("'fast' serves at ")
    assert "slower than the gate measured it in a worker: 1 ms (a contended measurement)" \
        in status.served_gap
    assert status.served_ms["fast"]["steady"] >= 5.0
    assert status.served_gap in status.summary()


def test_a_tier_replaced_before_its_steady_window_is_not_timed_again() -> None:
    journey = _two_tiers()
    runner = journey.runner
    fast, best = _sleeping(lambda: 0.0), _sleeping(lambda: 0.0)
    journey.swap_in("fast", fast)
    _call(journey, 1 + served.WINDOW)
    journey.swap_in("best", best)
    time.sleep(served.STEADY_AFTER_S + 0.2)
    _call(journey, 1)  # best's probation call: its own first window begins
    assert runner.tier == "best"
    _call(journey, served.WINDOW)
    assert runner.serving is best
    status = _until(journey, lambda s: "first" in s.served_ms.get("best", {}))
    assert "steady" not in status.served_ms["fast"]


def test_a_call_that_raises_in_a_timed_window_drops_the_tier_to_eager() -> None:
    journey = _journey()
    calls = [0]

    def flaky(x: torch.Tensor) -> tuple[torch.Tensor]:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("the tier broke")
        return (x * 2 + 1,)

    journey.swap_in("fast", flaky)
    _call(journey, 3)  # probation, then the window's first call, then the one that raises
    status = journey.status()
    assert status.tier == "eager"
    assert status.failures == (("fast", "raised in a call and was dropped: RuntimeError: "
                                        "the tier broke"),)


def test_a_swap_during_the_windows_last_call_leaves_no_timing_behind() -> None:
    journey = _two_tiers()
    runner = journey.runner
    calls = [0]

    def fast(x: torch.Tensor) -> tuple[torch.Tensor]:
        calls[0] += 1
        if calls[0] == 1 + served.WINDOW:  # the window's last call: another tier swaps in
            journey.swap_in("best", _sleeping(lambda: 0.0))
        return (x * 2 + 1,)

    journey.swap_in("fast", fast)
    _call(journey, 1 + served.WINDOW)
    assert runner.tier == "best"
    assert runner.give_way("best") == "fast"
    assert runner.serving is fast  # the bare artifact, not the spent window's wrapper
    _timed_again(journey, fast)  # and its steady window still comes


def test_the_gap_said_is_the_serving_tiers() -> None:
    gm = torch.fx.symbolic_trace(lambda x: (x * 2 + 1,))
    runner = GraphRunner("g", gm, ["fast", "best"])
    journey = GraphJourney(runner, gm, [Tier("fast"), Tier("best")], Recorder(None))
    journey.measured("fast", 1.0, contended=False)
    journey.measured("fast", 50.0, contended=True)  # a contended figure keeps the clean one
    journey.served(served.Window("fast", "steady", (2.0,) * 3))
    journey.arrived("fast", "worker")
    journey.swap_in("fast", _sleeping(lambda: 0.0))
    status = journey.status()
    assert status.served_ms["fast"]["measured"] == 1.0
    assert status.served_gap.startswith("'fast' serves at 2 ms per call, 100% slower")
    journey.arrived("best", "worker")
    journey.swap_in("best", _sleeping(lambda: 0.0))
    assert journey.status().served_gap == ""  # 'fast' no longer serves


def test_a_tier_serving_from_the_first_call_is_timed_too() -> None:
    journey = _journey()
    tier = _sleeping(lambda: 0.0)
    journey.serve_now("fast", tier)
    _call(journey, served.WINDOW)
    assert journey.runner.serving is tier
    _until(journey, lambda s: "first" in s.served_ms.get("fast", {}))


def test_the_clock_is_the_first_cuda_devices_else_the_cpus() -> None:
    assert type(served.clock_for(["cpu", "cpu"])) is CallClock
    cuda = served.clock_for(["cpu", "cuda:1"])  # a CPU scalar beside CUDA tensors
    assert isinstance(cuda, served.CudaClock) and cuda._index == 1
    assert served.clock_for(["meta"]) is None
    assert served.clock_for([]) is None


def test_a_tier_on_probation_that_serves_slower_than_eager_gives_way_to_eager() -> None:
    journey = _napping(0.002)
    journey.on_probation()
    _call(journey, 1 + served.WINDOW)  # eager's first call (untimed), then its window
    eager = _until(journey, lambda s: "first" in s.served_ms.get("eager", {}))
    assert eager.served_ms["eager"]["first"] >= 2.0
    slow = _sleeping(lambda: 0.003)  # 1.5x: slower, not far slower
    with hotswap.counters_delta() as d:
        journey.swap_in("fast", slow)
        _call(journey, 1 + served.WINDOW)  # its first call, then its first window
        _until(journey, lambda s: "first" in s.served_ms.get("fast", {}))
        assert journey.status().tier == "fast"  # the first window does not decide
        _timed_again(journey, slow)
        _call(journey, served.WINDOW)  # its steady window
        status = _until(journey, lambda s: s.tier == "eager")
    assert d["probation_reverts"] == 1 and d["swaps"] == 1
    [(tier, reason)] = status.kept
    assert tier == "fast" and reason.startswith("eager is ") and \
        " faster as served; kept eager (per call " in reason, reason
    assert f"medians of {served.WINDOW} eager and {served.WINDOW} 'fast' calls" in reason
    assert status.final and dict(status.states)["fast"] == "kept"
    assert journey.runner.serving is not slow
    with hotswap.counters_delta() as d:
        _call(journey, 3)  # eager answers, as it did
    assert d["eager_calls"] == 3


def test_a_tier_on_probation_gives_way_to_the_lower_tier_it_replaced_and_says_so() -> None:
    """async with the rung: the pieces serve, then the whole graph, which proves slower than
    eager: the pieces serve again (they serve on probation too), and the reason names them."""
    gm = torch.fx.symbolic_trace(lambda x: (_nap(x, 0.002) * 2 + 1,))
    runner = GraphRunner("g", gm, ["pieces", "whole"])
    journey = GraphJourney(runner, gm, [Tier("pieces"), Tier("whole")], Recorder(None))
    runner.clock = CallClock()
    journey.arrived("pieces", "worker")
    journey.arrived("whole", "worker")
    journey.on_probation()
    _call(journey, 1 + served.WINDOW)
    _until(journey, lambda s: "first" in s.served_ms.get("eager", {}))
    pieces, whole = _sleeping(lambda: 0.0), _sleeping(lambda: 0.003)
    journey.swap_in("pieces", pieces)
    _call(journey, 1 + served.WINDOW)
    _until(journey, lambda s: "first" in s.served_ms.get("pieces", {}))
    with hotswap.counters_delta() as d:
        journey.swap_in("whole", whole)
        _call(journey, 1 + served.WINDOW)
        _timed_again(journey, whole)
        _call(journey, served.WINDOW)
        status = _until(journey, lambda s: s.tier != "whole")
    assert d["probation_reverts"] == 1 and d["swaps"] == 1
    assert status.tier == "pieces" and dict(status.states)["whole"] == "kept"
    [(tier, reason)] = status.kept
    assert tier == "whole" and " faster as served; kept 'pieces' (per call " in reason, reason
    with hotswap.counters_delta() as d:
        _call(journey, 3)
    assert d["eager_calls"] == 0  # the pieces answer, not eager


def test_a_tier_on_probation_as_fast_as_eager_or_faster_stays() -> None:
    journey = _napping(0.004)
    journey.on_probation()
    _call(journey, 1 + served.WINDOW)
    _until(journey, lambda s: "first" in s.served_ms.get("eager", {}))
    fast = _sleeping(lambda: 0.0)
    with hotswap.counters_delta() as d:
        _serve_both_windows(journey, fast)
        status = _until(journey, lambda s: "steady" in s.served_ms.get("fast", {}))
    assert d["probation_reverts"] == 0
    assert status.tier == "fast" and status.kept == ()


def test_eagers_window_ends_at_the_swap_and_too_few_calls_weigh_nothing() -> None:
    journey = _napping(0.0)
    journey.on_probation()
    _call(journey, 1 + served.MIN_CALLS - 1)  # one call too few in eager's window
    slow = _sleeping(lambda: 0.005)
    with hotswap.counters_delta() as d:
        _serve_both_windows(journey, slow)
        status = _until(journey, lambda s: "steady" in s.served_ms.get("fast", {}))
    assert "eager" not in status.served_ms and d["probation_reverts"] == 0
    assert status.tier == "fast"


def test_eagers_window_cut_short_by_the_swap_still_weighs_the_tier() -> None:
    journey = _napping(0.001)
    journey.on_probation()
    _call(journey, 1 + served.MIN_CALLS)  # the swap ends eager's window at MIN_CALLS calls
    slow = _sleeping(lambda: 0.010)
    _serve_both_windows(journey, slow)
    status = _until(journey, lambda s: s.tier == "eager")
    assert f"medians of {served.MIN_CALLS} eager and " in status.kept[0][1]


def test_a_far_slower_tier_gives_way_after_its_first_window() -> None:
    """Every call of its first window took over FAR_SLOWER times eager's median: no
    contention does that to every call, so it need not wait for its steady window."""
    journey = _napping(0.002)
    journey.on_probation()
    _call(journey, 1 + served.WINDOW)
    _until(journey, lambda s: "first" in s.served_ms.get("eager", {}))
    journey.swap_in("fast", _sleeping(lambda: 0.010))
    with hotswap.counters_delta() as d:
        _call(journey, 1 + served.WINDOW)
        status = _until(journey, lambda s: s.tier == "eager")
    assert d["probation_reverts"] == 1 and "steady" not in status.served_ms["fast"]
    assert "or at once where its fastest call took 2x eager's median" in status.kept[0][1]


def test_a_slow_first_window_alone_does_not_send_a_tier_back() -> None:
    """The calls right after a swap run beside its store and other loads: a first window
    slower (1.5x, not FAR_SLOWER) decides nothing, and this tier's steady calls are as fast
    as eager's."""
    journey = _napping(0.002)
    journey.on_probation()
    _call(journey, 1 + served.WINDOW)
    calls = [0]

    def settling(x: torch.Tensor) -> tuple[torch.Tensor]:
        calls[0] += 1
        time.sleep(0.003 if calls[0] <= 1 + served.WINDOW else 0.0)
        return (x * 2 + 1,)

    with hotswap.counters_delta() as d:
        _serve_both_windows(journey, settling)
        status = _until(journey, lambda s: "steady" in s.served_ms.get("fast", {}))
    assert status.served_ms["fast"]["first"] >= 3.0 > status.served_ms["fast"]["steady"]
    assert status.tier == "fast" and d["probation_reverts"] == 0


def test_a_forgotten_graph_is_not_sent_back() -> None:
    """After torch.compiler.reset() nobody calls it: a late window changes nothing."""
    journey = _napping(0.0)
    journey.on_probation()
    journey.served(served.Window("eager", "first", (1.0,) * 5))
    journey.swap_in("fast", _sleeping(lambda: 0.0))
    journey.forget()
    with hotswap.counters_delta() as d:
        journey.served(served.Window("fast", "steady", (5.0,) * 5))
    assert d["probation_reverts"] == 0 and journey.runner.tier == "fast"


def test_without_probation_a_slower_tier_keeps_serving() -> None:
    """A gated ladder weighed it before it served (or gate=False): eager is not timed."""
    journey = _napping(0.002)
    _call(journey, 1 + served.WINDOW)
    slow = _sleeping(lambda: 0.010)
    with hotswap.counters_delta() as d:
        _serve_both_windows(journey, slow)
        status = _until(journey, lambda s: "steady" in s.served_ms.get("fast", {}))
    assert d["probation_reverts"] == 0 and "eager" not in status.served_ms
    assert status.tier == "fast"


def test_a_tier_still_compiling_below_the_one_that_swaps_in_is_kept_at_once() -> None:
    """The higher tier arrives first (async sends its whole graph before the pieces): once it
    serves, the lower one still compiling is kept, and the graph is final without it."""
    gm = torch.fx.symbolic_trace(lambda x: (x * 2 + 1,))
    runner = GraphRunner("g", gm, ["pieces", "whole"])
    journey = GraphJourney(runner, gm, [Tier("pieces"), Tier("whole")], Recorder(None))
    runner.clock = CallClock()
    assert not journey.unwanted("pieces") and not journey.final
    journey.arrived("whole", "worker")
    journey.swap_in("whole", gm.forward)
    assert not journey.status().final  # a gate would still weigh the pieces
    journey.keep_below("whole")  # adopted by rank (the ladder's offer, with no gate)
    status = journey.status()
    assert status.tier == "whole" and status.final
    assert status.kept == (("pieces", "tier 'whole' already serves"),)
    assert journey.unwanted("pieces") and not journey.unwanted("whole")
