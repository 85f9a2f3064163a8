"""Inputs eager rejects, in every mode: the call raises what eager raises, it costs one eager
call and nothing else, and the tier serving keeps serving.

Where a bad input is caught depends on the input, not on hotswap. Dynamo's guards check each
input's dtype, device, rank, shape and None-ness, and a call that fails them is traced again:

- an index out of range passes every guard and reaches the graph's compiled tier, which
  raises (inductor's own bounds check, with another message); eager, asked on the same
  arguments, raises too, so eager's exception is the user's;
- a float64 input to a float32 ``Linear`` is traced again into a new graph (dynamo's fake
  tensors let the mismatch through), handed to hotswap like any graph; its tiers raise
  eager's error on every call;
- a wrong shape, rank or device is rejected by dynamo's trace before any backend sees it
  (``TorchRuntimeError``, the same with every backend), and ``None`` where a tensor was
  traced raises eager's ``TypeError`` there too.

So each case is held to what ``torch.compile(backend="eager")`` raises: dynamo with the graph
run as it is, the parity torch.compile itself has. Where the input reaches hotswap's graph,
that is exactly eager's exception, which the tests check as well. A CPU box has no second
device to send a tensor to; a ``meta`` tensor (which eager rejects next to CPU weights) plays
the wrong device.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hotswap
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options
from hotswap.testing.fake import FakeCompiler

FAKE_MODES = ["async", "progressive", "subprocess"]
TOP = {"async": "default", "progressive": "max-autotune", "subprocess": "default",
       "inprocess": "default"}
COUNTED = ("eager_calls", "fallbacks", "internal_errors", "graphs", "swaps", "worker_compiles")
# hotswap's frames between dynamo and the graph: its runner's call, the eager check, eager.
OWN_FRAMES = 3


def _linear() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())


def _embedding() -> torch.nn.Module:
    return torch.nn.Embedding(10, 4)


# case -> (model, a good input, a bad one, where the bad one is caught)
Case = tuple[Callable[[], torch.nn.Module], Callable[[], Any], Callable[[], Any], str]
CASES: dict[str, Case] = {
    "index": (_embedding, lambda: torch.tensor([1, 2, 3]), lambda: torch.tensor([1, 20, 3]),
              "graph"),
    "dtype": (_linear, lambda: torch.randn(2, 8),
              lambda: torch.randn(2, 8, dtype=torch.float64), "new graph"),
    "shape": (_linear, lambda: torch.randn(2, 8), lambda: torch.randn(2, 7), "dynamo"),
    "rank": (_linear, lambda: torch.randn(2, 8), lambda: torch.tensor(1.0), "dynamo"),
    "device": (_linear, lambda: torch.randn(2, 8), lambda: torch.randn(2, 8, device="meta"),
               "dynamo"),
    "none": (_linear, lambda: torch.randn(2, 8), lambda: None, "dynamo"),
}


def _raised(fn: Callable[..., Any], *args: Any) -> BaseException:
    try:
        fn(*args)
    except Exception as e:
        return e
    raise AssertionError(f"{fn} accepted {args}")


def _frames(error: BaseException) -> int:
    return len(traceback.extract_tb(error.__traceback__))


def _references(model: torch.nn.Module, good: Any,
                bad: Any) -> tuple[BaseException, list[BaseException]]:
    """What eager raises, and what dynamo running its graphs as they are raises in two bad
    calls after a good one (what dynamo says depends on what it saw: a second shape is traced
    with a dynamic size)."""
    eager = _raised(model, bad)
    dynamo = torch.compile(model, backend="eager")
    dynamo(good)
    raised = [_raised(dynamo, bad) for _ in range(2)]
    torch._dynamo.reset()
    return eager, raised


def _check_raised(error: BaseException, eager: BaseException, dynamo: BaseException,
                  where: str) -> None:
    assert (type(error), str(error)) == (type(dynamo), str(dynamo))
    assert _frames(error) <= _frames(dynamo) + OWN_FRAMES, traceback.format_exception(error)
    if where != "dynamo":  # it reached hotswap's graph: eager's own exception, unchained
        assert (type(error), str(error)) == (type(eager), str(eager))
        assert error.__context__ is None and error.__cause__ is None


def _but_eager_calls(status: hotswap.GraphStatus) -> hotswap.GraphStatus:
    return dataclasses.replace(status, eager_calls=0)


def _expected(case: str, mode: str, kept: int) -> dict[str, int]:
    """Counter deltas of two bad calls, a wait and one good call."""
    where = CASES[case][3]
    delta = dict.fromkeys(COUNTED, 0)
    if where != "dynamo":
        delta["eager_calls"] = 2  # each bad call ran eager once, whichever tier served it
    if where == "new graph":  # the float64 graph walks its ladder like any other
        tiers = 2 if mode == "progressive" else 1
        delta.update(graphs=1, worker_compiles=tiers,
                     swaps=0 if mode == "subprocess" else tiers - kept)
    return delta


@pytest.mark.parametrize("mode", FAKE_MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_raises_what_eager_raises_and_the_tier_keeps_serving(
        case: str, mode: str) -> None:
    build, good_input, bad_input, where = CASES[case]
    model, good, bad = build(), good_input(), bad_input()
    eager, dynamo = _references(model, good, bad)
    expected = model(good)
    fake = FakeCompiler(delay_s={"max-autotune": 0.2})
    # The gate is not what is tested: without it every tier that arrives serves.
    coordinator = Coordinator(Options.create(mode=mode, gate=False), compiler=fake,
                              measure=fake.measure)
    compiled = torch.compile(model, backend=coordinator)
    torch.testing.assert_close(compiled(good), expected)
    [before] = coordinator.wait(timeout_s=30)
    assert before.tier == TOP[mode] and before.final and not before.failures
    with hotswap.counters_delta() as d:
        for reference in dynamo:
            _check_raised(_raised(compiled, bad), eager, reference, where)
        statuses = coordinator.wait(timeout_s=30)
        served = fake.calls[before.tier]
        torch.testing.assert_close(compiled(good), expected)
    assert fake.calls[before.tier] == served + 1  # the next good call ran the compiled tier
    # No tier dropped, no failure, no state moved (eager ran, to judge the bad calls).
    assert _but_eager_calls(statuses[0]) == _but_eager_calls(before)
    new = statuses[1:]
    assert len(new) == (where == "new graph")
    for status in new:
        assert status.tier == TOP[mode] and status.final and not status.failures
    kept = sum(len(s.kept) for s in new)
    assert {k: d[k] for k in COUNTED} == _expected(case, mode, kept)


def test_a_bad_input_while_eager_serves_is_the_users_error_and_drops_nothing() -> None:
    model = _embedding()
    good, bad = torch.tensor([1, 2, 3]), torch.tensor([1, 20, 3])
    eager = _raised(model, bad)
    fake = FakeCompiler(hold=True)
    coordinator = Coordinator(Options.create(mode="async"), compiler=fake, measure=fake.measure)
    compiled = torch.compile(model, backend=coordinator)
    with hotswap.counters_delta() as d:
        compiled(good)
        error = _raised(compiled, bad)  # no tier has arrived: eager serves
        fake.release()
        [status] = coordinator.wait(timeout_s=30)
        torch.testing.assert_close(compiled(good), model(good))
    assert (type(error), str(error), error.__context__) == (type(eager), str(eager), None)
    assert status.tier == "default" and not status.failures
    assert (d["eager_calls"], d["fallbacks"], d["internal_errors"], d["swaps"]) == (2, 0, 0, 1)
    assert fake.calls["default"] == 1


def test_a_new_dtype_that_eager_accepts_compiles_a_graph_as_torch_compile_does() -> None:
    """A guard failure with a good input is dynamo's recompile: one more graph, compiled."""
    fake = FakeCompiler()
    coordinator = Coordinator(Options.create(mode="async"), compiler=fake, measure=fake.measure)
    compiled = torch.compile(lambda x: (x * 2).sin(), backend=coordinator)
    x = torch.randn(8)
    torch.testing.assert_close(compiled(x), (x * 2).sin())
    coordinator.wait(timeout_s=30)
    with hotswap.counters_delta() as d:
        torch.testing.assert_close(compiled(x.double()), (x.double() * 2).sin())
        statuses = coordinator.wait(timeout_s=30)
        torch.testing.assert_close(compiled(x.double()), (x.double() * 2).sin())
    assert [s.tier for s in statuses] == ["default", "default"]
    assert not any(s.failures for s in statuses)
    assert (d["graphs"], d["swaps"], d["fallbacks"], d["internal_errors"]) == (1, 1, 0, 0)


# ---------------------------------------------------------------------- real inductor

# Inprocess has no fake (its inductor runs here): every case; the worker modes on the inputs
# that reach hotswap's graphs, where inductor's own error differs from eager's.
REAL = [*[(case, "inprocess") for case in CASES],
        *[(case, mode) for mode in ("subprocess", "async") for case in ("index", "dtype")]]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "mode"), REAL)
def test_a_bad_input_on_real_inductor(case: str, mode: str) -> None:
    build, good_input, bad_input, where = CASES[case]
    model, good, bad = build(), good_input(), bad_input()
    eager, dynamo = _references(model, good, bad)
    expected = model(good)
    compiled = hotswap.compile(model, mode=mode, workers=2, gate=False)
    torch.testing.assert_close(compiled(good), expected)
    [before] = hotswap.wait(compiled, timeout_s=240)
    assert before.tier == "default" and not before.failures
    with hotswap.counters_delta() as d:
        for reference in dynamo:
            _check_raised(_raised(compiled, bad), eager, reference, where)
        statuses = hotswap.wait(compiled, timeout_s=240)
    with hotswap.counters_delta() as after:
        torch.testing.assert_close(compiled(good), expected)
    assert after["eager_calls"] == 0  # the compiled tier answered
    assert _but_eager_calls(statuses[0]) == _but_eager_calls(before)
    reached = where != "dynamo"
    assert (d["eager_calls"], d["fallbacks"], d["internal_errors"], d["graphs"]) == (
        2 * reached, 0, 0, int(where == "new graph"))
    # The float64 graph compiles (inductor's kernel raises in the call, as eager does).
    for status in statuses[1:]:
        assert status.tier == "default" and not status.failures
