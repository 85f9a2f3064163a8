"""``hotswap gate-audit``'s report: its lines, its targets and its summary, on made-up results."""

from __future__ import annotations

from typing import Any

from hotswap.tools.gate_audit import summarize, verdicts


def _row(regret: float, graph: str = "g1") -> dict[str, Any]:
    return {"graph": graph, "serving": "default", "candidate": "max-autotune",
            "outcome": "keep", "confidence": "confident", "gain": 0.0, "gain_low": -0.01,
            "gain_high": 0.01, "ref_gain": 0.0, "ref_gain_low": -0.01, "ref_gain_high": 0.01,
            "regret": regret}


def _graph(arrived_s: dict[str, float], final_after_s: float | None) -> dict[str, Any]:
    to_final = None if final_after_s is None else final_after_s - max(arrived_s.values())
    return {"tier": "default", "final": final_after_s is not None, "arrived_s": arrived_s,
            "final_after_s": final_after_s, "to_final_s": to_final}


def _model(rows: list[dict[str, Any]], graphs: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"model": "mlp", "final": True, "final_s": 9.0, "undecided": 1, "eager_ms": 1.0,
            "largest_ms": 30.0, "largest_gate_ms": 5.0, "rows": rows, "graphs": graphs, **more}


def test_a_run_within_every_target_passes() -> None:
    # 19 of 20 decisions without regret, one at 4 %: 95 % within 2 %, none above 10 %.
    graphs = {"g1": _graph({"default": 2.0, "max-autotune": 5.5}, 8.0),
              "g2": _graph({"default": 3.0}, 4.0)}
    lines, missed = summarize([_model([_row(0.0)] * 19 + [_row(0.04, "g2")], graphs)])
    assert missed == []
    assert lines[-1] == (
        "summary, busy caller: PASS: "
        "20 decisions, 19 within 2% regret = 95.0% (target >= 95%): PASS; "
        "worst regret 4.0% (mlp g2 default -> max-autotune) (target <= 10%): PASS; "
        "worst time from last arrival to final 2.5 s (mlp g1) (target <= 120 s, busy caller): "
        "PASS; 1 of 1 models final (every model final): PASS; "
        "largest call beside a gate measurement (<= 2x eager + 10 ms): PASS")
    assert ("mlp                g1     tiers arrived: default 2.0 s, max-autotune 5.5 s; "
            "final at 8.0 s, 2.5 s after the last arrival (target <= 120 s, busy caller)"
            in lines)


def test_each_missed_target_says_by_how_much_and_the_caller_picks_the_time_target() -> None:
    graphs = {"g1": _graph({"default": 1.0, "max-autotune": 10.0}, 50.0)}
    results = [_model([_row(0.0), _row(0.12)], graphs, largest_gate_ms=13.0),
               {"model": "convnet", "error": "boom"}]
    lines, missed = summarize(results, "idle")
    assert lines[-1] == (
        "summary, idle caller: MISS: "
        "2 decisions, 1 within 2% regret = 50.0% (target >= 95%): MISS, 45.0 points short; "
        "worst regret 12.0% (mlp g1 default -> max-autotune) (target <= 10%): "
        "MISS, 2.0 points over; "
        "worst time from last arrival to final 40.0 s (mlp g1) (target <= 30 s, idle caller): "
        "MISS, 10.0 s over; 1 of 2 models final (every model final): MISS, convnet failed; "
        "largest call beside a gate measurement (<= 2x eager + 10 ms): "
        "MISS, mlp 13.0 ms > 12.0 ms")
    assert missed == [
        "mlp g1: final 40.0 s after its last tier arrived > 30 s",
        "mlp: a call beside a gate measurement took 13.0 ms > 12.0 ms",
        "convnet: failed",
        "2 decisions, 1 within 2% regret = 50.0% (target >= 95%)",
        "worst regret 12.0% (mlp g1 default -> max-autotune) (target <= 10%)"]
    # The same 40 s with a busy caller is within its 120 s.
    time_target = verdicts(results, "busy")[2]
    assert (time_target.target, time_target.passed, time_target.miss) == (
        "target <= 120 s, busy caller", True, "")


def test_a_graph_not_final_or_without_decisions_is_not_held_to_what_it_lacks() -> None:
    graphs = {"g1": _graph({"default": 1.0}, None)}
    lines, missed = summarize([_model([], graphs, final=False)])
    assert "mlp                g1     tiers arrived: default 1.0 s; NOT FINAL" in lines
    assert missed == ["mlp: never decided within the timeout"]
    assert [(v.found, v.passed) for v in verdicts([_model([], graphs, final=False)])] == [
        ("no decisions", None), ("no worst regret", None),
        ("no graph final with a tier arrived", None), ("0 of 1 models final", False),
        ("largest call beside a gate measurement", True)]


def test_a_process_that_fails_at_its_exit_keeps_its_results_and_misses() -> None:
    graphs = {"g1": _graph({"default": 1.0, "max-autotune": 3.0}, 4.0)}
    failed = _model([_row(0.0)], graphs, exit="exit status 134: terminate called without an "
                                               "active exception")
    lines, missed = summarize([failed])
    assert ("mlp                the audited process failed at its exit (exit status 134: "
            "terminate called without an active exception)") in lines
    assert missed == ["mlp: failed at its exit"]
    assert "1 of 1 models final (every model final): MISS, mlp failed at its exit" in lines[-1]
