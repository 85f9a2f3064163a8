"""GraphRunner's swap rules with fake compiled callables: no inductor, no workers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hotswap
from hotswap.orchestrator.graph import GraphRunner, TierFailed


def _gm() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(lambda x: (x * 2 + 1,))


X = torch.arange(4.0)
GOOD = (X * 2 + 1,)


def _runner(**kwargs: Any) -> GraphRunner:
    return GraphRunner("g", _gm(), ["fast", "best"], **kwargs)


def test_serves_eagerly_then_swaps_and_counts() -> None:
    runner = _runner()
    with hotswap.counters_delta() as d:
        assert torch.equal(runner(X)[0], GOOD[0])
        assert runner.swap_in("fast", lambda x: GOOD)
        assert runner(X) is GOOD
    assert (d["eager_calls"], d["swaps"]) == (1, 1)
    assert runner.status().tier == "fast"


def test_lower_tier_arriving_late_is_kept_not_served() -> None:
    runner = _runner()
    runner.swap_in("best", lambda x: GOOD)
    assert not runner.swap_in("fast", lambda x: ("slower",))
    status = runner.status()
    assert status.tier == "best" and status.kept == (("fast", "tier 'best' already serves"),)


def test_verify_rejects_a_tier_that_disagrees() -> None:
    runner = _runner(verify=True)
    runner.swap_in("fast", lambda x: (x * 3,))  # wrong
    with hotswap.counters_delta() as d:
        out = runner(X)
    assert torch.equal(out[0], GOOD[0])  # the call is answered by the previous tier
    status = runner.status()
    assert status.tier == "eager"
    assert status.failures == (("fast", "verify: its output disagrees with the previous tier's"),)
    assert d["fallbacks"] == 1


def test_verify_tolerates_bf16_rounding() -> None:
    runner = GraphRunner("g", torch.fx.symbolic_trace(lambda x: (x.bfloat16() * 3,)), ["fast"],
                         verify=True)
    runner.swap_in("fast", lambda x: ((x.bfloat16() * 3) * (1 + 2**-9),))  # within bf16 tolerance
    runner(torch.linspace(1, 2, 64))
    assert runner.status().tier == "fast"


def test_a_tier_that_raises_is_dropped_and_the_call_still_answered() -> None:
    def broken(x: torch.Tensor) -> Any:
        raise RuntimeError("bad artifact")

    runner = _runner()
    runner.swap_in("fast", lambda x: GOOD)
    runner(X)  # graduates "fast"
    runner.swap_in("best", broken)
    out = runner(X)
    assert out is GOOD  # answered by "fast", the tier before
    status = runner.status()
    assert status.tier == "fast"
    assert status.failures[0][0] == "best" and "bad artifact" in status.failures[0][1]


def test_eager_errors_are_the_users_errors() -> None:
    runner = GraphRunner("g", torch.fx.symbolic_trace(lambda x: (x @ x,)), ["fast"])
    with pytest.raises(RuntimeError):
        runner(torch.ones(2, 3))


def test_on_failure_raise_raises_once_then_serves() -> None:
    runner = _runner(raise_failures=True)
    runner.fail("fast", "CompileFailed: boom")
    with pytest.raises(TierFailed) as info:
        runner(X)
    assert (info.value.tier, info.value.reason) == ("fast", "CompileFailed: boom")
    assert torch.equal(runner(X)[0], GOOD[0])


def test_keep_records_a_ready_tier_that_will_not_serve() -> None:
    runner = _runner()
    runner.pending.update({"fast", "best"})
    assert runner.swap_in("fast", lambda x: GOOD)
    runner.keep("best", "gate: not faster")
    status = runner.status()
    assert status.tier == "fast" and status.kept == (("best", "gate: not faster"),)
    assert status.final


def test_a_measured_swap_may_go_down_the_ladder() -> None:
    runner = _runner()
    assert runner.swap_in("best", lambda x: GOOD)
    assert not runner.swap_in("fast", lambda x: GOOD)  # by rank: refused
    assert runner.swap_in("fast", lambda x: GOOD, measured=True)
    assert runner.status().tier == "fast"


def test_observer_sees_swaps_first_calls_and_drops() -> None:
    seen: list[tuple[str, str, str]] = []
    runner = _runner()
    runner.observer = lambda what, tier, previous, start, end: seen.append((what, tier, previous))

    def broken(x: torch.Tensor) -> Any:
        raise RuntimeError("boom")

    runner.swap_in("fast", lambda x: GOOD)
    runner(X)
    runner(X)
    runner.swap_in("best", broken)
    runner(X)
    assert seen == [("swap", "fast", "eager"), ("first_call", "fast", "fast"),
                    ("swap", "best", "fast"), ("dropped", "fast", "best")]


def test_final_and_pending() -> None:
    runner = _runner()
    runner.pending.update({"fast", "best"})
    assert runner.status().pending == ("fast", "best") and not runner.status().final
    runner.swap_in("fast", lambda x: GOOD)
    runner.fail("best", "JobTimeout: slow")
    status = runner.status()
    assert status.final and status.pending == () and status.tier == "fast"
