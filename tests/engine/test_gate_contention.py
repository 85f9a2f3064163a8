"""The gate on a busy machine, through a whole ladder (fake compiler, scripted measurements):
a slow tier never serves, a wide gap decides even when every round was preempted, and a
measurement that decides nothing leaves the graph not final, the faster median serving, until
a later one decides."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch

import hotswap
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options
from hotswap.engine.shipping.wire import BenchReply, BenchRequest
from hotswap.profiles.records import Paired
from hotswap.testing.fake import FakeCompiler

# The ladder: a scalar-code tier (10x slower than eager), then the default one.
SCALAR = {"name": "scalar", "config": {"cpp.simdlen": 1}}


def _swept(ratio: float) -> Paired:
    """24 rounds, every one preempted, every one within 20 % of ``ratio`` (candidate /
    serving): as the issue's box measured scalar against default."""
    return Paired("", "", "", 1.0, ratio, ratio, -math.inf, math.inf, 24, 24,
                  round_low=0.8 * ratio, round_high=1.2 * ratio)


def _contended(ratio: float) -> Paired:
    """Too few clean rounds, and the rounds do not agree: decides nothing."""
    return Paired("", "", "", 1.0, ratio, ratio, -math.inf, math.inf, 24, 20,
                  round_low=0.5 * ratio, round_high=2.5 * ratio)


def _clean(ratio: float) -> Paired:
    return Paired("", "", "", 1.0, ratio, ratio, 0.98 * ratio, 1.02 * ratio, 24, 0,
                  round_low=0.9 * ratio, round_high=1.1 * ratio)


def _model() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4)), (torch.randn(3, 8),)


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hotswap.engine.policy.gate.RETRY_AFTER_S", 0.01)
    monkeypatch.setattr("hotswap.engine.policy.gate.RETRY_CAP_S", 0.02)


@pytest.mark.parametrize("order", ["scalar first", "default first"])
def test_a_tier_ten_times_slower_never_serves_though_every_round_was_contended(
        order: str) -> None:
    scalar_first = order == "scalar first"
    # The first tier to arrive is weighed against eager, the second against what serves then:
    # scalar loses 10x to eager (or to default); default wins 10x over eager.
    pairs = [_swept(10.0), _swept(0.1)] if scalar_first else [_swept(0.1), _swept(10.0)]
    fake = FakeCompiler(hold=True, delay_s={"default" if scalar_first else "scalar": 0.2},
                        pairs=pairs)
    model, inputs = _model()
    expected = model(*inputs)
    backend = Coordinator(Options.create(mode="progressive", tiers=[SCALAR, "default"]),
                          compiler=fake, measure=fake.measure)
    compiled = torch.compile(model, backend=backend)
    with hotswap.counters_delta() as d:
        torch.testing.assert_close(compiled(*inputs), expected)
        fake.release()
        [status] = backend.wait(timeout_s=30)
        torch.testing.assert_close(compiled(*inputs), expected)
    assert status.final and status.tier == "default" and status.gate == ""
    assert dict(status.states) == {"scalar": "kept", "default": "serving"}
    assert fake.calls["scalar"] == 0  # not one call
    assert [b.pair for b in fake.benches] == (
        [("eager", "scalar"), ("eager", "default")] if scalar_first
        else [("eager", "default"), ("default", "scalar")])
    [(tier, why)] = status.kept
    assert tier == "scalar" and why.startswith(
        "slower than eager: eager is 10.0x faster than 'scalar'; kept eager (" if scalar_first
        else "gate: 'default' is 10.0x faster than 'scalar'; kept 'default' (")
    # contended figures say so
    assert "0 of 24 rounds clean, 24 contended" in why and "(contended)" in why
    assert (d["swaps"], d["gate_kept"], d["gate_undecided"], d["eager_calls"]) == (1, 1, 0, 1)
    assert (d["eager_checks"], d["gate_benchmarks"]) == ((2, 0) if scalar_first else (1, 1))


class Scripted:
    """A gate measurement answered when the test says so: ``answer(pair)`` replies to the
    request waiting (the next one, once it comes)."""

    def __init__(self) -> None:
        self.requests: list[BenchRequest] = []
        self._waiting: list[tuple[BenchRequest, Future[BenchReply]]] = []
        self._cond = threading.Condition()

    def measure(self, request: BenchRequest) -> Future[BenchReply]:
        future: Future[BenchReply] = Future()
        with self._cond:
            self.requests.append(request)
            self._waiting.append((request, future))
            self._cond.notify_all()
        return future

    def answer(self, pair: Paired) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._waiting, timeout=30), "no measurement came"
            request, future = self._waiting.pop(0)
        serving, candidate = request.pair
        future.set_result(BenchReply([], pairs=[dataclasses.replace(
            pair, graph_id=request.graph_id, serving=serving, candidate=candidate)]))


def _until(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def visible_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pauses long enough for a test to see the graph deciding between two measurements (where
    the gate pauses: a measurement without a clean round, or a GPU graph's)."""
    monkeypatch.setattr("hotswap.engine.policy.gate.RETRY_AFTER_S", 0.4)
    monkeypatch.setattr("hotswap.engine.policy.gate.RETRY_CAP_S", 0.4)


def test_undecided_is_not_final_the_faster_median_serves_and_a_later_measurement_decides(
        visible_retries: None) -> None:
    model, inputs = _model()
    expected = model(*inputs)
    fake, scripted = FakeCompiler(), Scripted()
    backend = Coordinator(Options.create(mode="progressive", tiers=["default"]),
                          compiler=fake, measure=scripted.measure)
    compiled = torch.compile(model, backend=backend)

    def serves(tier: str) -> None:
        _until(lambda: backend.status()[0].tier == tier)
        calls = fake.calls["default"]
        torch.testing.assert_close(compiled(*inputs), expected)
        assert fake.calls["default"] == calls + (tier == "default")

    with hotswap.counters_delta() as d:
        torch.testing.assert_close(compiled(*inputs), expected)
        # Measured against eager before it serves: eager serves meanwhile.
        _until(lambda: scripted.requests)
        [status] = backend.status()
        assert (status.tier, status.final, status.pending) == ("eager", False, ("default",))
        assert status.gate == "measuring 'default' against eager"
        assert "| measuring 'default' against eager" in status.summary()
        # Contended, and the rounds disagree: nothing decided; default's median is faster,
        # so default serves on trial, and the graph is not final.
        scripted.answer(_contended(0.5))
        serves("default")
        seen: list[hotswap.GraphStatus] = []
        _until(lambda: (seen.extend(backend.status()) or "(attempt 2)" in seen[-1].gate))
        status = seen[-1]
        assert not status.final and status.pending == ("default",)
        assert status.gate.startswith(
            "deciding 'default' against eager: 'default' is 2.0x faster than eager so far; "
            "deciding (median of 4 paired rounds; 4 of 24 rounds clean, 20 contended; ")
        assert status.gate.endswith("contended: 20 of 24 rounds preempted; rounds candidate / "
                                    "serving from 0.25 to 1.25); measuring again (attempt 2), "
                                    "'default' serving meanwhile")
        assert "| deciding 'default' against eager: " in status.summary()
        assert backend.wait(timeout_s=0.2)[0].final is False
        # Measured again, still contended, now eager's median is 2x faster: over both
        # measurements default is no longer ahead, and eager serves again.
        scripted.answer(_contended(2.0))
        serves("eager")
        assert not backend.status()[0].final
        # A clean measurement decides: eager is faster; default is kept out, for good.
        scripted.answer(_clean(1.25))
        [status] = backend.wait(timeout_s=30)
        torch.testing.assert_close(compiled(*inputs), expected)
    assert status.final and status.tier == "eager" and status.gate == ""
    assert status.states == (("default", "kept"),)
    [(_, why)] = status.kept
    assert why.startswith("slower than eager: eager is 20.0% faster than 'default'; kept eager")
    assert [r.pair for r in scripted.requests] == [("eager", "default")] * 3
    assert (d["eager_checks"], d["gate_undecided"], d["gate_kept"], d["swaps"]) == (3, 2, 1, 1)
    assert d["internal_errors"] == 0 and d["fallbacks"] == 0


def _few_clean(ratios: tuple[float, ...]) -> Paired:
    """24 rounds of which only ``ratios`` were clean, too few for an interval alone; the
    contended rounds disagree."""
    ratio = sorted(ratios)[len(ratios) // 2]
    return Paired("", "", "", 1.0, ratio, ratio, -math.inf, math.inf, 24, 24 - len(ratios),
                  round_low=0.5 * ratio, round_high=2.5 * ratio, clean_ratios=ratios)


@pytest.mark.parametrize("answers", [
    # Contended and on trial, then adopted by a clean measurement: no second swap.
    [_contended(0.5), _clean(0.5)],
    # A busy machine leaves each measurement a few clean rounds: two measurements' worth, all
    # with default about 2x faster, adopt it without waiting for a third.
    [_few_clean((0.52, 0.48, 0.5, 0.55)), _few_clean((0.49, 0.51, 0.47, 0.53, 0.5))],
], ids=["a clean measurement", "the clean rounds of two contended ones together"])
def test_a_tier_on_trial_that_a_later_measurement_adopts_stays(
        quick_retries: None, answers: list[Paired]) -> None:
    model, inputs = _model()
    expected = model(*inputs)
    fake, scripted = FakeCompiler(), Scripted()
    backend = Coordinator(Options.create(mode="progressive", tiers=["default"]),
                          compiler=fake, measure=scripted.measure)
    compiled = torch.compile(model, backend=backend)
    with hotswap.counters_delta() as d:
        compiled(*inputs)
        for answer in answers:
            scripted.answer(answer)
        [status] = backend.wait(timeout_s=30)
        torch.testing.assert_close(compiled(*inputs), expected)
    assert status.final and status.tier == "default" and not status.kept
    assert [r.pair for r in scripted.requests] == [("eager", "default")] * 2
    assert (d["eager_checks"], d["gate_undecided"], d["swaps"]) == (2, 1, 1)
    assert fake.calls["default"] == 1
