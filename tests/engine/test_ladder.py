"""Modes, ladders and the gate with a compiler that compiles nothing (hotswap.testing.fake):
every part of hotswap but inductor and the worker processes, in milliseconds per test."""

from __future__ import annotations

import concurrent.futures
import math
import pickle
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import hotswap
from hotswap.cache import VERDICT_TIER, ArtifactCache
from hotswap.engine import served, threads
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options, Plan
from hotswap.engine.shipping.wire import BenchReply, BenchRequest, CachedEntry
from hotswap.profiles import TierBench
from hotswap.profiles.records import BenchResult, GateDecision, Paired
from hotswap.testing import audit
from hotswap.testing.fake import FakeCompiler
from tests.conftest import cache_readers
from tests.engine.models import tier_failure

LADDER = ("default", "max-autotune")
FAST_TOP = {"eager": 2.0, "default": 1.0, "max-autotune": 0.5}
SLOW_TOP = {"eager": 2.0, "default": 1.0, "max-autotune": 1.5}
GATED = ["default", {"name": "no-fusion", "config": {"max_fusion_size": 1}}]


def _model() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)), (torch.randn(3, 8),)


def _fake(**kwargs: Any) -> FakeCompiler:
    """A fake whose compiles wait for ``_run``'s first calls: those are served eagerly."""
    return FakeCompiler(hold=True, **kwargs)


def _run(fake: FakeCompiler, mode: str = "progressive", *, calls_before_wait: int = 1,
         **options: Any) -> tuple[Coordinator, hotswap.GraphStatus, dict[str, int]]:
    """Compile the model with ``fake``, call it, wait for its ladder, call it again; every
    output equals eager's. Returns the coordinator, the graph's status and the counters' delta."""
    model, inputs = _model()
    expected = model(*inputs)
    coordinator = Coordinator(Options.create(mode=mode, **options), compiler=fake,
                              measure=fake.measure)
    if coordinator.options.plan.waits:
        fake.release()  # the first call waits for its tier
    compiled = torch.compile(model, backend=coordinator)
    with hotswap.counters_delta() as d:
        for _ in range(calls_before_wait):
            torch.testing.assert_close(compiled(*inputs), expected)
        fake.release()
        [status] = coordinator.wait(timeout_s=30)
        torch.testing.assert_close(compiled(*inputs), expected)
    assert d["internal_errors"] == 0
    return coordinator, status, dict(d)


@pytest.mark.parametrize(("mode", "plan"), [
    ("inprocess", Plan(here=True, waits=True, climbs=False, gated=False)),
    ("subprocess", Plan(here=False, waits=True, climbs=False, gated=False)),
    ("async", Plan(here=False, waits=False, climbs=False, gated=False, probation=True)),
    ("progressive", Plan(here=False, waits=False, climbs=True, gated=True)),
])
def test_each_mode_is_a_composition(mode: str, plan: Plan) -> None:
    assert Options.create(mode=mode).plan == plan
    ungated = Options.create(mode=mode, gate=False).plan
    assert not ungated.gated and not ungated.probation


def test_async_serves_its_tier_on_probation_against_eagers_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No gate weighs async's tier: it serves when it arrives, and gives way to eager once its
    steady calls ran slower than eager's had (here 10 ms against microseconds). One that does
    not stays: tests/engine/test_served.py. (A training graph is not on probation: its calls
    time the forward alone.)"""
    monkeypatch.setattr(served, "WINDOW", 5)
    monkeypatch.setattr(served, "MIN_CALLS", 3)
    monkeypatch.setattr(served, "STEADY_AFTER_S", 0.2)
    fake = _fake(call_s={"default": 0.010})
    model, inputs = _model()
    expected = model(*inputs)
    coordinator = Coordinator(Options.create(mode="async", tiers=["default"]), compiler=fake,
                              measure=fake.measure)
    compiled = torch.compile(model, backend=coordinator)
    with torch.no_grad(), hotswap.counters_delta() as d:
        for _ in range(1 + served.WINDOW):  # eager: its first call, then its window
            torch.testing.assert_close(compiled(*inputs), expected)
        fake.release()
        [status] = coordinator.wait(timeout_s=30)
        assert status.tier == "default" and status.final
        deadline = time.monotonic() + 10
        while status.tier != "eager":  # its first call, then its first window
            assert time.monotonic() < deadline, status
            torch.testing.assert_close(compiled(*inputs), expected)
            [status] = coordinator.status()
        torch.testing.assert_close(compiled(*inputs), expected)
    assert d["probation_reverts"] == 1 and status.final
    assert status.served_ms["eager"]["first"] < status.served_ms["default"]["first"]
    assert status.kept[0][0] == "default" and "faster as served" in status.kept[0][1]
    assert fake.calls["default"] >= 1 + served.WINDOW  # far slower: back after a window
    assert not fake.benches  # no gate measurement: its calls decided
    # A later process keeps the tier out as the gate's verdicts are kept: its tier would
    # come from the cache before eager served enough calls to weigh it.
    later = Coordinator(Options.create(mode="async", tiers=["default"]), compiler=fake,
                        measure=fake.measure)
    with torch.no_grad(), hotswap.counters_delta() as d:
        torch.testing.assert_close(torch.compile(model, backend=later)(*inputs), expected)
        [status] = later.wait(timeout_s=30)
    assert status.tier == "eager" and status.final and d["cache_hits"] == 0
    assert status.kept[0][1].startswith("gate (earlier run, confident): probation: eager is ")
    assert len(fake.compiles) == 1


def test_a_training_graph_is_not_on_probation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grad on and parameters that need it: a call times the forward alone, not the backward
    its tier compiled with it, so eager's calls are not timed and nothing is weighed."""
    monkeypatch.setattr(served, "WINDOW", 5)
    monkeypatch.setattr(served, "MIN_CALLS", 3)
    fake = _fake(call_s={"default": 0.010})
    model, inputs = _model()
    coordinator = Coordinator(Options.create(mode="async", tiers=["default"]), compiler=fake,
                              measure=fake.measure)
    compiled = torch.compile(model, backend=coordinator)
    with hotswap.counters_delta() as d:
        for _ in range(1 + served.WINDOW):
            compiled(*inputs).sum().backward()
        fake.release()
        [status] = coordinator.wait(timeout_s=30)
        for _ in range(1 + served.WINDOW):
            compiled(*inputs).sum().backward()
    assert status.tier == "default" and "eager" not in status.served_ms
    assert d["probation_reverts"] == 0


def test_progressive_climbs_and_the_gate_adopts_a_faster_top_tier() -> None:
    fake = _fake(delay_s={"max-autotune": 0.2}, medians=FAST_TOP)
    _, status, d = _run(fake)
    assert status.tier == "max-autotune" and status.final and not status.failures
    assert status.states == (("default", "replaced"), ("max-autotune", "serving"))
    assert sorted(t for _, t in fake.compiles) == sorted(LADDER)
    # The first tier was weighed against eager before it served (it won); the second
    # against the first.
    assert [b.pair for b in fake.benches] == [("eager", "default"), ("default", "max-autotune")]
    assert [sorted(b.entries) for b in fake.benches] == [["default"], sorted(LADDER)]
    assert fake.benches[0].graph_bytes and not fake.benches[1].graph_bytes
    assert (d["worker_compiles"], d["swaps"], d["gate_benchmarks"], d["eager_checks"],
            d["gate_kept"], d["eager_calls"]) == (2, 2, 1, 1, 0, 1)
    assert fake.calls["max-autotune"] == 1  # the call after wait()
    # What the gate measured of each tier, per call, beside its calls as they serve
    assert {t: f["measured"] for t, f in status.served_ms.items()} == FAST_TOP


def test_the_gate_keeps_a_slower_tier_out_and_a_warm_process_neither_compiles_nor_loads_it(
        tmp_path: Any) -> None:
    cache = str(tmp_path / "cache")
    fake = _fake(delay_s={"max-autotune": 0.2}, medians=SLOW_TOP)
    _, status, d = _run(fake, cache_dir=cache)
    assert status.tier == "default" and status.final
    [(tier, why)] = status.kept
    assert tier == "max-autotune" and why.startswith(
        "gate: 'default' is 33.3% faster than 'max-autotune'; kept 'default' (")
    assert status.states == (("default", "serving"), ("max-autotune", "kept"))
    assert (d["swaps"], d["gate_benchmarks"], d["gate_kept"]) == (1, 1, 1)

    warm = _fake(medians=SLOW_TOP)
    _, status, d = _run(warm, cache_dir=cache)
    # Neither compiled nor measured again: the kept tier's verdict and the served tier's
    # check against eager are on file.
    assert warm.compiles == [] and warm.benches == []
    assert status.tier == "default" and status.path == "cache"
    assert status.kept[0][1].startswith("gate (earlier run, confident): 'default' is 33.3% "
                                        "faster than 'max-autotune'")
    assert (d["cache_hits"], d["worker_compiles"]) == (1, 0)

    # A ladder without 'default': the verdict kept max-autotune for a tier that is not there,
    # so it does not hold; max-autotune is weighed against eager, which it beats.
    alone = _fake(medians=SLOW_TOP)
    _, status, d = _run(alone, cache_dir=cache, tiers=["max-autotune"])
    assert status.tier == "max-autotune" and status.final and not status.kept
    assert [sorted(b.entries) for b in alone.benches] == [["max-autotune"]]


def test_a_tier_below_the_serving_one_is_measured_against_it() -> None:
    """The top tier came first and beat eager; the lower one arrives later and must beat it
    (it does not: kept out, the top one serves)."""
    fake = _fake(delay_s={"default": 0.3}, medians=FAST_TOP)
    _, status, d = _run(fake)
    assert status.tier == "max-autotune"
    assert status.states == (("default", "kept"), ("max-autotune", "serving"))
    assert (d["swaps"], d["gate_benchmarks"], d["gate_kept"]) == (1, 1, 1)


def test_a_tier_the_benchmark_cannot_run_is_kept_and_a_failed_benchmark_adopts_by_rank(
        tmp_path: Any) -> None:
    fake = _fake(delay_s={"max-autotune": 0.2}, medians={"default": 1.0})
    _, status, _ = _run(fake)
    assert status.tier == "default"
    assert status.kept == (("max-autotune", "gate: could not benchmark it (max-autotune: "
                                            "no median)"),)

    def broken(request: Any) -> Any:
        raise RuntimeError("benchmark worker unavailable")

    fake = FakeCompiler(delay_s={"max-autotune": 0.2})
    model, inputs = _model()
    coordinator = Coordinator(Options.create(mode="progressive", cache_dir=str(tmp_path)),
                              compiler=fake, measure=broken)
    compiled = torch.compile(model, backend=coordinator)
    compiled(*inputs)
    [status] = coordinator.wait(timeout_s=30)
    assert status.tier == "max-autotune" and not status.kept


@pytest.mark.parametrize("mode", ["async", "subprocess"])
def test_one_tier_modes_compile_the_top_tier_alone(mode: str) -> None:
    fake = _fake()
    _, status, d = _run(fake, mode, tiers=list(LADDER))
    assert [t for _, t in fake.compiles] == ["max-autotune"] and fake.benches == []
    assert status.tier == "max-autotune" and status.states == (("max-autotune", "serving"),)
    # subprocess: the first call waited for the tier; async: it ran eagerly
    assert d["eager_calls"] == (1 if mode == "async" else 0)
    assert d["swaps"] == (1 if mode == "async" else 0)


def test_a_crashed_compile_is_retried_once_then_fails_its_tier(tmp_path: Any) -> None:
    fake = _fake(crashes={"default": 1})
    _, status, d = _run(fake, "async")
    assert status.tier == "default" and not status.failures
    assert (d["worker_crashes"], d["worker_compiles"]) == (1, 1)
    assert len(fake.compiles) == 2

    fake = _fake(crashes={"default": 2})
    _, status, d = _run(fake, "async", cache_dir=str(tmp_path))  # not the entry just stored
    assert status.tier == "eager" and status.final
    assert status.failures[0][1].startswith("WorkerCrashed: worker 0 died (signal SIGKILL)")
    assert status.states == (("default", "failed"),)
    assert (d["worker_crashes"], d["fallbacks"], d["eager_calls"]) == (2, 1, 2)


def test_a_failed_tier_leaves_the_lower_one_serving() -> None:
    fake = _fake(fail={"max-autotune": "no kernel"}, medians=FAST_TOP)
    _, status, _ = _run(fake)
    assert status.tier == "default"
    assert status.failures == (("max-autotune", "CompileFailed: compile raised RuntimeError: "
                                                "no kernel"),)


def test_on_failure_raise_when_the_first_call_waits() -> None:
    fake = FakeCompiler(fail={"default": "no kernel"})
    model, inputs = _model()
    coordinator = Coordinator(Options.create(mode="subprocess", on_failure="raise"),
                              compiler=fake, measure=fake.measure)
    compiled = torch.compile(model, backend=coordinator)
    with pytest.raises(Exception) as info:
        compiled(*inputs)
    failed = tier_failure(info.value)
    assert failed is not None and failed.tier == "default" and "no kernel" in failed.reason


def test_a_graph_lets_go_of_its_shipped_form_once_final() -> None:
    import gc

    from hotswap.engine.shipping.request import GraphRequest

    def shipped() -> int:  # type(), not isinstance: gc lists weak proxies too
        return sum(type(o) is GraphRequest for o in gc.get_objects())

    before = shipped()
    fake = _fake(delay_s={"max-autotune": 0.1}, medians=FAST_TOP)
    _, status, _ = _run(fake)
    assert status.final
    # wait() returns after the load thread's last step (earlier tests' requests may be
    # collected meanwhile: no more than before, not exactly as many)
    assert shipped() <= before


# The gate's cases as they ran with real workers and inductor (tests/profiles before): the
# same assertions, on the fake compiler.

def _fake_measure(medians: dict[str, float] | None, seen: list[BenchRequest]) -> Any:
    def measure(request: BenchRequest) -> Future[BenchReply]:
        seen.append(request)
        if medians is None:
            raise RuntimeError("benchmark worker unavailable")
        future: Future[BenchReply] = Future()
        future.set_result(BenchReply([
            TierBench(request.graph_id, tier, BenchResult(medians[tier], medians[tier],
                                                          medians[tier], 10, "fake"),
                      purpose=request.purpose) for tier in request.entries if tier in medians]))
        return future

    return measure


def _between_tiers(seen: list[BenchRequest]) -> list[BenchRequest]:
    """The gate's measurements of one tier against another (not a tier against eager)."""
    return [r for r in seen if "eager" not in r.pair]


def _gated(medians: dict[str, float] | None, seen: list[BenchRequest],
           cache_dir: str | None = None) -> tuple[Any, Any]:
    model, inputs = _model()
    expected = model(*inputs)
    # The lower tier compiles faster: the gate meets the tiers in ladder order.
    options = Options.create(mode="progressive", tiers=GATED, cache_dir=cache_dir)
    coordinator = Coordinator(options, compiler=FakeCompiler(delay_s={"no-fusion": 0.2}),
                              measure=_fake_measure(medians, seen))
    compiled = torch.compile(model, backend=coordinator)
    torch.testing.assert_close(compiled(*inputs), expected)
    [status] = coordinator.wait(timeout_s=240)
    torch.testing.assert_close(compiled(*inputs), expected)
    return coordinator, status


def test_gate_keeps_a_slower_tier_out_and_a_warm_process_skips_it() -> None:
    seen: list[BenchRequest] = []
    with hotswap.counters_delta() as d:
        _, status = _gated({"default": 1.0, "no-fusion": 1.5}, seen)
    assert status.tier == "default" and status.final and not status.failures
    [(tier, why)] = status.kept
    assert tier == "no-fusion" and why.startswith("gate: 'default' is 33.3% faster than "
                                                  "'no-fusion'; kept 'default'")
    seen = _between_tiers(seen)
    assert [sorted(r.entries) for r in seen] == [["default", "no-fusion"]]
    # The benchmark worker reads both artifacts from the cache; their bytes do not travel.
    assert all(isinstance(e, CachedEntry) for e in seen[0].entries.values())
    assert (d["swaps"], d["gate_benchmarks"], d["gate_kept"], d["worker_compiles"]) == (1, 1, 1, 2)
    # Another process (here: a fresh coordinator on the same cache) neither compiles nor
    # benchmarks the kept tier again: the verdict is on file.
    torch._dynamo.reset()
    with hotswap.counters_delta() as d:
        _, status = _gated({"default": 1.0, "no-fusion": 1.5}, seen)
    assert status.tier == "default" and status.kept[0][0] == "no-fusion"
    assert "earlier run" in status.kept[0][1]
    assert (d["worker_compiles"], d["cache_hits"], d["gate_benchmarks"], d["swaps"]) == (0, 1, 0, 1)


def test_without_a_cache_the_gate_job_carries_the_entries_themselves(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")  # the cache cannot be opened here: hotswap runs without one
    seen: list[BenchRequest] = []
    _, status = _gated({"default": 1.0, "no-fusion": 1.5}, seen, cache_dir=str(not_a_dir))
    assert status.tier == "default" and status.kept[0][0] == "no-fusion"
    [request] = _between_tiers(seen)
    entries = request.entries.values()
    assert len(entries) == 2 and all(type(e) is bytes for e in entries)  # picklable, not views
    pickle.dumps(request)


@pytest.mark.parametrize("medians", [{"default": 1.5, "no-fusion": 1.0}, None],
                         ids=["faster", "benchmark-fails"])
def test_gate_adopts_a_faster_tier(medians: dict[str, float] | None) -> None:
    seen: list[BenchRequest] = []
    with hotswap.counters_delta() as d:
        _, status = _gated(medians, seen)
    assert status.tier == "no-fusion" and status.final and not status.kept
    assert (d["swaps"], d["gate_benchmarks"], d["gate_kept"]) == (2, 1, 0)
    assert len(_between_tiers(seen)) == 1


def test_gate_off_swaps_without_measuring() -> None:
    model, inputs = _model()
    seen: list[BenchRequest] = []
    coordinator = Coordinator(Options.create(mode="progressive", tiers=GATED, gate=False),
                              compiler=FakeCompiler(), measure=_fake_measure({}, seen))
    compiled = torch.compile(model, backend=coordinator)
    compiled(*inputs)
    [status] = coordinator.wait(timeout_s=240)
    assert status.tier == "no-fusion" and seen == []


# The gate's decisions on noisy measurements: scripted pairs, as measure_pair returns them.

def _pair(ratio: float, low: float, high: float, contended: int = 0) -> Paired:
    return Paired("", "", "", 1.0, ratio, ratio, low, high, 12, contended)


STRADDLES = _pair(0.97, 0.95, 1.01)     # 3 % faster by the estimate, 1 % slower at worst
WIDE = _pair(0.97, 0.80, 1.01)          # 3 % faster by the estimate, 20 % faster at best
CONTENDED = _pair(0.5, 0.45, 0.55, contended=8)
BLIND = _pair(0.5, 0.45, 0.55, contended=12)  # not one clean round
FASTER = _pair(0.8, 0.78, 0.82)
NOT_FASTER = _pair(1.0, 0.99, 1.01)
BEATS_EAGER = _pair(0.5, 0.45, 0.55)    # a tier against eager: twice as fast


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hotswap.engine.policy.gate.RETRY_AFTER_S", 0.01)


def test_an_undecided_gate_keeps_the_serving_tier_and_measures_again(quick_retries: None,
                                                                     tmp_path: Path) -> None:
    fake = _fake(delay_s={"max-autotune": 0.1}, pairs=[BEATS_EAGER, STRADDLES, CONTENDED, FASTER])
    coordinator, status, d = _run(fake, cache_dir=str(tmp_path))
    assert status.tier == "max-autotune" and status.final
    gate = [b for b in fake.benches if "eager" not in b.pair]
    # Straddling: measured again, longer; contended: measured again as long, after a pause.
    assert [b.budget_ms for b in gate] == [200.0, 400.0, 400.0]
    assert (d["gate_benchmarks"], d["gate_undecided"], d["swaps"]) == (3, 2, 2)
    decisions = [r for r in coordinator.recorder.timeline.records()
                 if isinstance(r, GateDecision) and r.candidate == "max-autotune"]
    assert [(r.outcome, r.attempt) for r in decisions] == [
        ("undecided", 1), ("undecided", 2), ("adopt", 2)]
    assert "contended: 8 of 12 rounds preempted" in decisions[1].reason


def _called_once(fake: FakeCompiler) -> Coordinator:
    """Progressive over the default ladder with ``fake``: the model compiled and called once."""
    model, inputs = _model()
    backend = Coordinator(Options.create(mode="progressive"), compiler=fake,
                          measure=fake.measure)
    torch.compile(model, backend=backend)(*inputs)
    return backend


@pytest.mark.parametrize("undecided", [STRADDLES, CONTENDED, BLIND],
                         ids=["close", "contended", "first blind"])
def test_an_undecided_cpu_measurement_is_measured_again_at_once(
        undecided: Paired, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark of a CPU graph takes only CPU the caller leaves (the workers' priority):
    a pause before measuring an undecided pair again would delay the decision for nothing."""
    monkeypatch.setattr("hotswap.engine.policy.gate.RETRY_AFTER_S", 600.0)
    fake = _fake(delay_s={"max-autotune": 0.1}, pairs=[BEATS_EAGER, undecided, FASTER])
    _, status, d = _run(fake)  # waits at most 30 s
    assert status.tier == "max-autotune" and status.final
    assert (d["gate_benchmarks"], d["gate_undecided"]) == (2, 1)
    assert [r.again for r in fake.benches] == [True] * 3  # the pool may hold the worker


@pytest.mark.parametrize(("device", "pairs", "pause"), [
    ("cpu", [BLIND, BLIND], "20 s"), ("cuda:0", [BLIND], "10 s"), ("cuda:0", [CONTENDED], "10 s"),
    ("cuda:0", [STRADDLES], "10 s")])
def test_a_measurement_waits_out_the_pause_on_a_gpu_or_without_a_clean_round(
        device: str, pairs: list[Paired], pause: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's benchmark shares the device with the caller's kernels, and one without a clean
    round would be raised to the caller's priority if it starved (starvation.py): the gate's
    pause is waited out (on the CPU from the second such measurement on: the first is
    measured again within the worker's hold)."""
    monkeypatch.setattr("hotswap.engine.policy.gate.RETRY_AFTER_S", 10.0)
    monkeypatch.setattr("hotswap.engine.policy.ladder._device", lambda journey: device)
    fake = _fake(delay_s={"max-autotune": 0.1}, pairs=[BEATS_EAGER, *pairs, FASTER])
    backend = _called_once(fake)
    fake.release()
    deadline = time.monotonic() + 30
    while f"measuring again in {pause}" not in (backend.status()[0].gate or ""):
        assert time.monotonic() < deadline, backend.status()[0].gate
        time.sleep(0.01)
    assert backend.wait(timeout_s=0.5)[0].final is False
    assert len(fake.benches) == 1 + len(pairs)


def test_a_gated_compile_says_that_its_result_is_measured_next(tmp_path: Path) -> None:
    """What lets the local pool keep the worker for that measurement (executors.base.hold_for)."""
    fake = _fake(delay_s={"max-autotune": 0.1}, medians=FAST_TOP)
    _run(fake, cache_dir=str(tmp_path / "progressive"))
    assert sorted((r.tier, r.measured) for r in fake.requests) == [
        ("default", True), ("max-autotune", True)]
    fake = _fake(medians=FAST_TOP)
    _run(fake, "async", cache_dir=str(tmp_path / "async"))
    assert [r.measured for r in fake.requests] == [False]


def test_status_says_when_each_tier_arrived_and_when_the_graph_became_final(
        quick_retries: None) -> None:
    # Undecided once on the top tier: the graph is final only after a second measurement.
    fake = _fake(delay_s={"max-autotune": 0.1}, pairs=[BEATS_EAGER, STRADDLES, FASTER])
    backend = _called_once(fake)
    [before] = hotswap.status(backend)
    assert (before.final, before.arrived_s, before.final_after_s) == (False, (), None)
    fake.release()
    [status] = backend.wait(timeout_s=30)
    assert status.tier == "max-autotune" and status.final
    assert [tier for tier, _ in status.arrived_s] == ["default", "max-autotune"]
    assert [tier for tier, _ in status.served_after_s] == ["default", "max-autotune"]
    (_, default_in), (_, top_in) = status.arrived_s
    (_, default_served), (_, top_served) = status.served_after_s
    assert status.final_after_s is not None
    assert 0 < default_in <= default_served and default_in < top_in <= top_served
    assert top_served <= status.final_after_s
    # Seconds after the graph reached hotswap, fixed once final: asked again, the same.
    assert hotswap.status(backend)[0].final_after_s == status.final_after_s


def test_a_low_confidence_verdict_is_stored_with_its_conditions_and_measured_again(
        quick_retries: None, tmp_path: Path) -> None:
    # 3 % faster by the estimate, the interval from 1 % slower to 20 % faster, three times:
    # the last attempt keeps the serving tier, weakly.
    cache = str(tmp_path)
    fake = _fake(delay_s={"max-autotune": 0.1}, pairs=[BEATS_EAGER, WIDE, WIDE, WIDE])
    _, status, d = _run(fake, cache_dir=cache, gate_threshold=0.05)
    assert d["gate_undecided"] == 2
    assert status.tier == "default"
    [(tier, why)] = status.kept
    assert tier == "max-autotune" and why.startswith(
        "gate: 'max-autotune' is 3.0% faster than 'default'; kept 'default' (")
    assert "low: the interval straddles the threshold; still undecided at attempt 3" in why
    [stored] = [e for e in ArtifactCache(cache).entries()
                if e.tier == VERDICT_TIER and "kept for" in e.origin]
    assert stored.origin == "max-autotune kept for default: +3.0%, low"
    verdict = msgpack.unpackb(ArtifactCache(cache).get(stored.key), raw=False)
    assert verdict["device"] == "cpu" and verdict["confidence"] == "low"
    assert (verdict["gain_low"], verdict["gain_high"]) == pytest.approx((-0.01, 0.20))
    assert verdict["rounds"] == 12 and time.time() - verdict["date_unix_s"] < 60
    # A warm process does not take a low-confidence verdict as final: it loads the tier
    # from the cache and measures it again (confidently not faster now: kept, for good).
    torch._dynamo.reset()
    warm = _fake(pairs=[NOT_FASTER])
    _, status, d = _run(warm, cache_dir=cache, gate_threshold=0.05)
    assert warm.compiles == [] and d["gate_remeasured"] == 1
    assert [b.pair for b in warm.benches] == [("default", "max-autotune")]
    assert status.tier == "default" and "confident: not faster" in status.kept[0][1]
    torch._dynamo.reset()
    again = _fake()
    _, status, d = _run(again, cache_dir=cache, gate_threshold=0.05)
    assert again.benches == [] and d["gate_remeasured"] == 0
    assert "gate (earlier run, confident)" in status.kept[0][1]


def test_a_close_verdict_is_taken_as_it_is_by_a_warm_process(
        quick_retries: None, tmp_path: Path) -> None:
    # Still undecided at the last attempt, but the interval (1 % slower to 5 % faster) has the
    # candidate at most 2.5 thresholds (12.5 %) faster: kept what serves, "close"; a warm process
    # takes that verdict instead of measuring the pair again at its start.
    cache = str(tmp_path)
    fake = _fake(delay_s={"max-autotune": 0.1},
                 pairs=[BEATS_EAGER, STRADDLES, STRADDLES, STRADDLES])
    _, status, d = _run(fake, cache_dir=cache, gate_threshold=0.05)
    assert status.tier == "default" and status.final
    assert "close: the interval straddles the threshold; still undecided at attempt 3" in \
        status.kept[0][1]
    assert "within 12%: what keeping it out may cost" in status.kept[0][1]
    torch._dynamo.reset()
    warm = _fake()
    _, status, d = _run(warm, cache_dir=cache, gate_threshold=0.05)
    assert warm.benches == [] and d["gate_remeasured"] == 0
    assert status.tier == "default" and "gate (earlier run, close)" in status.kept[0][1]


def test_a_tier_slower_than_eager_never_serves(tmp_path: Path) -> None:
    cache = str(tmp_path)
    slower = {"eager": 0.5, "default": 1.0, "max-autotune": 0.8}
    fake = _fake(delay_s={"max-autotune": 0.1}, medians=slower)
    _, status, d = _run(fake, cache_dir=cache)
    # Each compiled tier was weighed against eager before serving, and kept out.
    assert status.tier == "eager" and status.final
    assert status.states == (("default", "kept"), ("max-autotune", "kept"))
    assert [why.split(" (")[0] for _, why in status.kept] == [
        "slower than eager: eager is 2.0x faster than 'default'; kept eager",
        "slower than eager: eager is 37.5% faster than 'max-autotune'; kept eager"]
    assert (d["eager_checks"], d["gate_kept"], d["swaps"]) == (2, 2, 0)
    assert fake.calls == {}  # no compiled tier answered a call
    # A warm process serves eager and neither compiles nor loads either tier.
    torch._dynamo.reset()
    warm = _fake(medians=slower)
    _, status, d = _run(warm, cache_dir=cache)
    assert status.tier == "eager" and warm.compiles == [] and warm.benches == []
    assert d["swaps"] == 0 and d["cache_hits"] == 0


def test_force_tier_serves_that_tier_unmeasured() -> None:
    fake = _fake(delay_s={"max-autotune": 0.1}, medians=SLOW_TOP)
    _, status, d = _run(fake, force_tier="max-autotune")
    assert status.tier == "max-autotune" and not status.kept
    assert d["gate_benchmarks"] == 0
    # Its compile does not hold the pool's worker for a measurement (executors.base.hold_for)
    assert {r.tier: r.measured for r in fake.requests}["max-autotune"] is False
    with pytest.raises(ValueError, match="force_tier must name a tier"):
        Options.create(force_tier="nope")


def test_the_audit_measures_each_final_decision_again_and_scores_its_regret() -> None:
    # The gate: max-autotune "not faster" (kept) on a noisy measurement; the reference says
    # it was 10 % faster: that decision cost 1 / 0.9 - 1 = 11 %.
    fake = _fake(delay_s={"max-autotune": 0.1},
                 pairs=[BEATS_EAGER, NOT_FASTER, BEATS_EAGER, _pair(0.9, 0.88, 0.92)])
    model, inputs = _model()
    backend = Coordinator(Options.create(mode="progressive"), compiler=fake,
                          measure=fake.measure, retain_artifacts=True)
    compiled = torch.compile(model, backend=backend)
    compiled(*inputs)
    fake.release()
    [status] = backend.wait(timeout_s=30)
    assert status.tier == "default" and status.final
    made = audit.decisions(backend)
    assert [(d.serving, d.candidate, d.outcome) for d in made] == [
        ("eager", "default", "adopt"), ("default", "max-autotune", "keep")]
    rows = audit.reference(backend, budget_ms=50, rounds=10)
    assert [r["regret"] for r in rows] == [0.0, pytest.approx(1 / 0.9 - 1)]
    reference = fake.benches[-1]
    assert (reference.pair, reference.budget_ms, reference.rounds) == (
        ("default", "max-autotune"), 50, 10)
    assert audit.regret(True, 1.2) == pytest.approx(0.2) and audit.regret(True, 0.8) == 0.0


# Contended in all 12 rounds, 1 % slower: each measurement alone decides nothing.
CLOSE_CONTENDED = Paired("", "", "", 1.0, 1.01, 1.01, -math.inf, math.inf, 12, 12)


def test_a_pair_too_close_to_call_costs_a_later_process_one_measurement(
        quick_retries: None, tmp_path: Path) -> None:
    cache = str(tmp_path)
    fake = _fake(delay_s={"max-autotune": 0.1}, pairs=[BEATS_EAGER, *[CLOSE_CONTENDED] * 5])
    _, status, d = _run(fake, cache_dir=cache)
    assert status.tier == "default" and d["gate_undecided"] == 4
    assert "'default' is 1.0% faster than 'max-autotune' over 5 measurements; kept 'default'" \
        in status.kept[0][1]

    def stored() -> dict[str, Any]:
        [entry] = [e for e in ArtifactCache(cache).entries()
                   if e.tier == VERDICT_TIER and "kept for" in e.origin]
        return dict(msgpack.unpackb(ArtifactCache(cache).get(entry.key), raw=False))

    verdict = stored()
    assert verdict["confidence"] == "low" and verdict["measured"] == 5
    assert verdict["evidence"] == pytest.approx(5 * math.log(1.01))
    # A warm process measures the low verdict again, going on from those five: one more
    # measurement as close keeps what serves, where it used to take five of its own.
    torch._dynamo.reset()
    warm = _fake(pairs=[CLOSE_CONTENDED])
    _, status, d = _run(warm, cache_dir=cache)
    assert d["gate_remeasured"] == 1 and d["gate_undecided"] == 0
    assert [b.pair for b in warm.benches] == [("default", "max-autotune")]
    assert "over 6 measurements; kept 'default'" in status.kept[0][1]
    assert stored()["measured"] == 6


def test_a_profiling_comparison_cut_short_by_shutdown_is_no_failure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A profiling run compares the tiers once the graph is final; a shutdown that closes
    the pool under that comparison is what the user asked for, not a failure to warn of."""
    from hotswap.errors import PoolClosed

    fake = _fake(medians=FAST_TOP)

    def measure(request: BenchRequest) -> Future[BenchReply]:
        if request.purpose != "compare":
            return fake.measure(request)
        future: Future[BenchReply] = Future()
        future.set_exception(PoolClosed("the pool was terminated while it ran"))
        return future

    model, inputs = _model()
    coordinator = Coordinator(Options.create(mode="progressive", tiers=list(LADDER),
                                             profile_dir=str(tmp_path)),
                              compiler=fake, measure=measure)
    compiled = torch.compile(model, backend=coordinator)
    caplog.set_level("INFO", logger="hotswap")
    compiled(*inputs)
    fake.release()
    [status] = coordinator.wait(timeout_s=30)
    deadline = time.monotonic() + 10
    while "not compared" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert status.final and "tiers not compared: the worker pool closed first" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("mode", ["async", "progressive"])
def test_a_profiling_comparison_carries_where_the_cache_holds_each_tier(
        mode: str, tmp_path: Path) -> None:
    """The comparison of a final graph runs after the store of the tier that made it final,
    so it names the cache's entry instead of carrying the artifact's bytes (a fresh
    process's first CPU entry carries inductor's precompiled header: copying it beside the
    swap held the GIL through a user's call); and ``wait()`` returns only once it ran."""
    fake = FakeCompiler(medians=FAST_TOP)
    model, inputs = _model()
    coordinator = Coordinator(Options.create(mode=mode, tiers=list(LADDER),
                                             cache_dir=str(tmp_path / "cache"),
                                             profile_dir=str(tmp_path / "profile")),
                              compiler=fake, measure=fake.measure)
    compiled = torch.compile(model, backend=coordinator)
    torch.testing.assert_close(compiled(*inputs), model(*inputs))
    [status] = coordinator.wait(timeout_s=60)
    assert status.final
    [compare] = [b for b in fake.benches if b.purpose == "compare"]
    assert compare.entries and all(isinstance(e, CachedEntry) for e in compare.entries.values())
    assert compare.graph_bytes  # eager compared too


def test_wait_returns_after_the_comparison_even_when_the_step_that_queues_it_is_slow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph is final before the end of the step that queues its comparison, and the
    gate's decision wakes the waits in between: a wait() still waits for the comparison
    (``hotswap profile`` writes the profile right after it)."""
    slow = Coordinator._finish_if_final

    def finish_slowly(self: Coordinator, journey: Any) -> None:
        if threads.scheduler.here():  # the step that made it final, not the user's call
            time.sleep(0.3)
        slow(self, journey)

    monkeypatch.setattr(Coordinator, "_finish_if_final", finish_slowly)
    fake = FakeCompiler(medians=FAST_TOP, delay_s={"max-autotune": 0.3})
    model, inputs = _model()
    coordinator = Coordinator(Options.create(mode="progressive", tiers=list(LADDER),
                                             profile_dir=str(tmp_path / "profile")),
                              compiler=fake, measure=fake.measure)
    torch.compile(model, backend=coordinator)(*inputs)
    [status] = coordinator.wait(timeout_s=60)
    assert status.final
    assert [b.purpose for b in fake.benches].count("compare") == 1



def test_a_warm_graphs_cache_is_read_off_the_call_and_a_refused_top_entry_falls_to_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache's entries are read and checked on hotswap's io thread, not in the call dynamo
    traces; where the best one is refused (corrupted), the next tier down still loads from the
    cache at once, as it did when the call read them."""
    import threading

    from hotswap.testing import corrupt_entry

    cache = str(tmp_path / "cache")
    _run(_fake(medians=FAST_TOP), cache_dir=cache, gate=False, tiers=["default"])
    torch._dynamo.reset()
    coordinator, status, _ = _run(_fake(medians=FAST_TOP), cache_dir=cache, gate=False)
    assert status.tier == "max-autotune"  # both in the cache now
    [journey] = coordinator.graphs.journeys()
    top = journey.keys["max-autotune"]
    torch._dynamo.reset()
    assert corrupt_entry(coordinator.cache._cache, top)
    readers = cache_readers(monkeypatch)
    warm = _fake(medians=FAST_TOP)
    _, status, d = _run(warm, cache_dir=cache, gate=False)
    assert readers and threading.main_thread().name not in readers, readers
    assert d["cache_hits"] == 1 and d["cache_rejects"] == 1, (d, status)
    assert [tier for _, tier in warm.compiles] == ["max-autotune"]  # the refused one, compiled
    assert status.tier == "max-autotune" and dict(status.states)["default"] == "replaced"


def test_a_cache_that_cannot_be_read_off_the_call_fails_the_tiers_and_eager_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error out of reading a present entry on the io thread (the store's own errors are
    misses: below) fails the graph's tiers: the graph serves eager and is final, nothing
    waits for good."""
    from hotswap.engine.sources.cache_access import CacheAccess

    cache = str(tmp_path / "cache")
    _run(_fake(), "async", cache_dir=cache)
    torch._dynamo.reset()

    def broken(self: CacheAccess, key: str | None) -> Any:
        raise MemoryError("no room for the entry")

    monkeypatch.setattr(CacheAccess, "get", broken)
    _, status, d = _run(_fake(), "async", cache_dir=cache)
    assert status.tier == "eager" and status.final and d["cache_hits"] == 0
    assert [tier for tier, _ in status.failures] == ["default"]
    assert "the artifact cache could not be read: MemoryError: no room" in status.failures[0][1]


def test_a_cache_read_that_raises_is_a_miss_and_the_tier_compiles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cache = str(tmp_path / "cache")
    _run(_fake(), "async", cache_dir=cache)
    torch._dynamo.reset()

    def broken(self: ArtifactCache, key: str, **kwargs: Any) -> Any:
        raise RuntimeError("an index in a format this build does not know")

    monkeypatch.setattr(ArtifactCache, "get", broken)
    fake = _fake()
    with caplog.at_level("WARNING", logger="hotswap"):
        _, status, d = _run(fake, "async", cache_dir=cache)
    assert status.tier == "default" and status.failures == () and d["cache_hits"] == 0
    assert [tier for _, tier in fake.compiles] == ["default"]
    assert caplog.text.count("could not read the artifact cache") == 1


class _Refusing(FakeCompiler):
    """A pool that takes none of the compiles of ``tiers`` (all where None): submitting one
    raises, as a pool that cannot start does."""

    def __init__(self, tiers: set[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tiers = tiers

    def submit(self, request: Any, timeout_s: float | None) -> Future[Any]:
        if self.tiers is None or request.tier in self.tiers:
            raise RuntimeError("the pool could not start")
        return super().submit(request, timeout_s)


REFUSED = "RuntimeError: the pool could not start"


def test_a_compile_the_pool_will_not_take_fails_its_tier_and_the_call_serves_eager() -> None:
    coordinator, status, _ = _run(_Refusing(), "async")
    assert status.tier == "eager" and status.final and status.failures == (("default", REFUSED),)
    [journey] = coordinator.graphs.journeys()
    assert journey.request is None  # final: its shipped graph let go


def test_a_cached_graph_whose_next_tier_the_pool_will_not_take_serves_the_cached_one(
        tmp_path: Path) -> None:
    """Started off the call (its cache holds ``default``), the climb's compile is refused:
    ``default`` serves, ``max-autotune`` failed, the graph final; nothing waits for good."""
    cache = str(tmp_path / "cache")
    _run(_fake(), cache_dir=cache, gate=False, tiers=["default"])
    torch._dynamo.reset()
    _, status, d = _run(_Refusing({"max-autotune"}, medians=FAST_TOP), cache_dir=cache, gate=False)
    assert status.tier == "default" and status.final and d["cache_hits"] == 1
    assert status.failures == (("max-autotune", REFUSED),)


def test_a_compile_after_waiting_out_another_claim_that_the_pool_will_not_take_fails_its_tier(
        tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    model, inputs = _model()
    holder = _fake()  # claims the graph's key and compiles until released
    first = Coordinator(Options.create(mode="async", cache_dir=cache), compiler=holder,
                        measure=holder.measure)
    torch.compile(model, backend=first)(*inputs)
    torch._dynamo.reset()
    try:  # waits 1 s for the holder, then compiles here: refused
        _, status, _ = _run(_Refusing(), "async", cache_dir=cache, timeout_s=1.0)
    finally:
        holder.release()
        first.wait(timeout_s=30)
    assert status.tier == "eager" and status.final and status.failures == (("default", REFUSED),)


def test_a_tier_kept_while_it_compiled_is_stored_for_the_process_waiting_on_its_claim(
        tmp_path: Path) -> None:
    """A tier that arrives after a higher one (kept: it will not serve here) is stored all
    the same before its claim is released: a process waiting on that claim loads it, instead
    of finding nothing and compiling it again."""
    cache = str(tmp_path / "cache")
    model, inputs = _model()
    climber = FakeCompiler(hold=True, delay_s={"default": 0.5}, medians=FAST_TOP)
    climbing = Coordinator(Options.create(mode="progressive", cache_dir=cache, gate=False),
                           compiler=climber, measure=climber.measure)
    torch.compile(model, backend=climbing)(*inputs)  # claims both tiers' keys
    waiter = FakeCompiler()
    waiting = Coordinator(Options.create(mode="async", cache_dir=cache), compiler=waiter,
                          measure=waiter.measure)
    compiled = torch.compile(model, backend=waiting)
    torch.testing.assert_close(compiled(*inputs), model(*inputs))  # default's claim is held
    climber.release()  # max-autotune arrives first, default half a second later
    [top] = climbing.wait(timeout_s=30)
    [status] = waiting.wait(timeout_s=30)
    assert top.tier == "max-autotune" and dict(top.states)["default"] == "kept"
    assert waiter.compiles == [] and status.tier == "default" and status.path == "cache"


def test_a_tier_that_arrives_before_its_callback_is_attached_is_taken_in_on_the_scheduler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback that offers a tier to the ladder runs on the scheduler's thread even when
    the tier was in before ``_start`` attached it (a fast load), not inline in the user's call."""
    from hotswap.engine.sources.tiers import TierLifecycle

    started = TierLifecycle.start

    def start_then_wait(self: TierLifecycle, *args: Any, **kwargs: Any) -> Future[Any]:
        future = started(self, *args, **kwargs)
        concurrent.futures.wait([future], timeout=30)  # in before the callback is attached
        return future

    threads_seen: list[bool] = []
    arrived = Coordinator._arrived

    def recording(self: Coordinator, *args: Any) -> None:
        threads_seen.append(threads.scheduler.here())
        arrived(self, *args)

    monkeypatch.setattr(TierLifecycle, "start", start_then_wait)
    monkeypatch.setattr(Coordinator, "_arrived", recording)
    _, status, d = _run(FakeCompiler(), "async")
    assert status.tier == "default" and d["swaps"] == 1
    assert threads_seen == [True]


def test_ctrl_c_while_the_first_call_waits_for_its_tier_leaves_its_compile_to_the_next_call(
        tmp_path: Path) -> None:
    class Interrupting(FakeCompiler):
        """Ctrl-C reaches the main thread while the compile runs and the call waits for it."""

        def submit(self, request: Any, timeout_s: float | None) -> Future[Any]:
            main = threading.main_thread().ident
            assert main is not None
            threading.Timer(0.3, signal.pthread_kill, args=(main, signal.SIGINT)).start()
            return super().submit(request, timeout_s)

    # Python's own Ctrl-C handler, also where this test runs with SIGINT ignored (a shell's
    # background job)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_a_wait(tmp_path, Interrupting(delay_s={"default": 2.0}))
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_a_wait(tmp_path: Path, fake: FakeCompiler) -> None:
    model, inputs = _model()
    expected = model(*inputs)
    coordinator = Coordinator(Options.create(mode="subprocess", cache_dir=str(tmp_path / "c")),
                              compiler=fake, measure=fake.measure)
    compiled = torch.compile(model, backend=coordinator)
    with pytest.raises(KeyboardInterrupt):
        compiled(*inputs)
    # The interrupt stopped the wait, not the compile. Dynamo traces the next call again: its
    # graph waits on the interrupted one's claim and loads its entry, stored unloaded.
    with hotswap.counters_delta() as d:
        torch.testing.assert_close(compiled(*inputs), expected)
    [status] = coordinator.wait(timeout_s=30)  # the interrupted graph let go
    assert status.final and status.tier == "default" and status.path == "cache"
    assert len(fake.compiles) == 1 and d["eager_calls"] == 0


def test_ctrl_c_while_a_compile_is_submitted_reaches_the_caller_and_leaves_nothing_held(
        tmp_path: Path) -> None:
    class Interrupted(FakeCompiler):
        def submit(self, request: Any, timeout_s: float | None) -> Future[Any]:
            raise KeyboardInterrupt

    cache = str(tmp_path / "cache")
    model, inputs = _model()
    interrupted = Interrupted()
    coordinator = Coordinator(Options.create(mode="async", cache_dir=cache),
                              compiler=interrupted, measure=interrupted.measure)
    with pytest.raises(KeyboardInterrupt):
        torch.compile(model, backend=coordinator)(*inputs)
    [status] = coordinator.wait(timeout_s=30)
    assert status.final and status.tier == "eager"
    assert status.failures == (("default", "could not start: KeyboardInterrupt"),)
    torch._dynamo.reset()
    # its claim released: another process compiles the graph at once, not after timeout_s
    _, later, _ = _run(FakeCompiler(), "async", cache_dir=cache, timeout_s=600.0)
    assert later.tier == "default"
