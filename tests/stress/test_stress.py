"""The stress runner: its fault accounting, its verdicts and the CLI's exit codes."""

from __future__ import annotations

from typing import Any

import pytest

from hotswap import testing
from hotswap.cli import main
from hotswap.tools import stress


def test_injected_faults_are_exactly_the_observed_ones() -> None:
    plan = testing.FaultPlan({"crash": 0.25, "unpicklable": 0.25, "hang": 0.15, "slow": 0.15,
                              "corrupt-cache": 1.0}, seed=11, slow_s=0.05)
    report = stress.run_stress(["pointwise", "mlp"], ["subprocess", "async"], reps=2,
                               faults=plan, workers=2, calls=3, job_timeout_s=8)
    assert report.ok, report.table()
    assert len(report.cases) == 8 and report.leaked == []
    injected = report.injected
    assert sum(injected.values()) >= 6 and injected.get("corrupt-cache", 0) >= 1, injected
    for kind, counter in stress.OBSERVED.items():
        assert report.observed[counter] == injected.get(kind, 0), (kind, report.table())
    crashes_and_kills = injected.get("crash", 0) + injected.get("hang", 0)
    assert report.restarts == crashes_and_kills
    # A tier whose job failed for good shows why; every case still served correct outputs.
    assert all(c.max_error <= c.tolerance and not c.call_errors for c in report.cases)
    assert "faults: " in report.table() and "result: PASS" in report.table()


def test_a_hung_compile_times_out_and_is_counted_once() -> None:
    plan = testing.FaultPlan({"hang": 1.0})
    report = stress.run_stress(["pointwise"], ["async"], faults=plan, workers=2, calls=2,
                               job_timeout_s=3)
    [case] = report.cases
    assert report.ok and report.injected == {"hang": 1}
    assert report.observed["job_timeouts"] == 1 and report.restarts == 1
    assert [reason.split(":")[0] for _, reason in case.failures] == ["JobTimeout"]
    assert case.calls == {"eager": 5}  # served throughout, correctly, by the eager graph


def _report(**case: Any) -> stress.StressReport:
    return stress.StressReport([stress.CaseResult("mlp", "async", 1, tolerance=1e-3, **case)],
                               {}, {}, 0, 0, [], 1.0)


@pytest.mark.parametrize(("case", "leaked", "ok"), [
    ({}, [], True), ({"max_error": 1.0}, [], False), ({"call_errors": ["boom"]}, [], False),
    ({"hang": "not final"}, [], False), ({}, [4242], False)])
def test_verdicts(case: dict[str, Any], leaked: list[int], ok: bool) -> None:
    report = _report(**case)
    report.leaked = leaked
    assert report.ok is ok


def test_cli_exit_codes_and_bad_input(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    outcomes = iter([_report(), _report(max_error=1.0)])
    monkeypatch.setattr(stress, "run_stress", lambda *a, **k: next(outcomes))
    assert main(["stress", "--models", "mlp", "--modes", "async"]) == 0
    assert main(["stress", "--models", "mlp", "--modes", "async"]) == 1
    assert "WRONG" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown fault kind"):
        stress.parse_faults("meteor=0.5")
    with pytest.raises(ValueError, match="KIND=RATE"):
        stress.parse_faults("crash=lots")
    with pytest.raises(ValueError, match="add up to more than 1"):
        testing.FaultPlan({"crash": 0.7, "hang": 0.7})
