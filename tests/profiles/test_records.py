"""The profile's building blocks on hand-made records: no inductor, no workers."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hotswap.profiles import (
    BenchResult,
    Call,
    GateDecision,
    GraphInfo,
    KernelBreakdown,
    Span,
    Swap,
    TierBench,
    Timeline,
    category_of,
    chrome_trace,
    compare_report,
    gate_decision,
    kernel_category,
    merge_torch_trace,
    plot_latency,
    read_records,
    self_time_by_category,
    summarize,
    text_report,
)
from hotswap.profiles.bench import GATE_ROUNDS, MIN_CLEAN, measure_pair, median_interval
from hotswap.profiles.kernels import summarize_kernels
from hotswap.profiles.records import Paired, RunInfo, record_from_dict
from hotswap.profiles.trace import call_mark

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[2]


def _span(name: str, start: float, end: float, category: str = "", tier: str = "default",
          pid: int = 7) -> Span:
    return Span(name, start, end, "g1", tier, pid, f"worker {pid}", category)


def _run(directory: Path) -> Timeline:
    timeline = Timeline(directory, argv=["demo"], versions={"torch": "x"})
    t0 = timeline.info.started_s
    for record in (
        GraphInfo("g1", "sig-mlp", "forward (model.py:12)"),
        _span("inductor_compile", t0 + 1.0, t0 + 3.0),
        _span("GraphLowering.run", t0 + 1.0, t0 + 1.5, "lowering"),
        _span("compile_file", t0 + 1.6, t0 + 2.6, "kernel_compile"),
        Span("load", t0 + 3.1, t0 + 3.3, "g1", "default", os.getpid(), "hotswap-load"),
        Swap("g1", "eager", "default", t0 + 3.3, "swap"),
        _span("inductor_compile", t0 + 1.2, t0 + 3.6, tier="max-autotune"),
        Swap("g1", "default", "max-autotune", t0 + 3.8, "kept"),
        TierBench("g1", "eager", BenchResult(2.0, 1.9, 2.2, 50), 1.0),
        TierBench("g1", "default", BenchResult(1.0, 0.9, 1.1, 50), 2.0),
        GateDecision("g1", "max-autotune", "default", False, "not faster", 1.0, 1.0, 0.02,
                     outcome="keep", confidence="confident"),
        KernelBreakdown("g1", "default", "cpu", 10, 10.0, 90.0, {"cpp_fused": 6.0, "extern": 3.0},
                        (("cpp_fused_relu_0", "cpp_fused", 6.0, 10),)),
    ):
        timeline.add(record)
    timeline.add_call("g1", "eager", t0 + 0.5, t0 + 0.502, "MainThread", 1)
    timeline.add_call("g1", "default", t0 + 3.5, t0 + 3.501, "MainThread", 2)
    timeline.close()
    return timeline


def test_records_round_trip_through_dicts() -> None:
    bench = TierBench("g1", "default", BenchResult(1.0, 0.9, 1.2, 40, "x"), 1.5, "cpu", "gate")
    assert record_from_dict(bench.to_dict()) == bench
    call = Call("g1", "eager", 1.0, 2.0, "MainThread", 3)
    assert record_from_dict(json.loads(json.dumps(call.to_dict()))) == call
    with pytest.raises(ValueError, match="unknown profile record type"):
        record_from_dict({"type": "nope"})


def test_bench_result_percentiles() -> None:
    result = BenchResult.from_samples([5.0, 1.0, 2.0, 3.0, 4.0], "t")
    assert (result.median_ms, result.p20_ms, result.p80_ms, result.n) == (3.0, 2.0, 4.0, 5)
    with pytest.raises(ValueError):
        BenchResult.from_samples([], "t")


def test_self_time_counts_nested_time_once() -> None:
    spans = [_span("fx_codegen_and_compile", 0.0, 10.0, "lowering"),
             _span("Scheduler.codegen", 1.0, 5.0, "codegen"),
             _span("CachingAutotuner.benchmark_all_configs", 2.0, 4.0, "autotuning"),
             _span("compile_file", 6.0, 9.0, "kernel_compile")]
    assert self_time_by_category(spans) == {"lowering": 3.0, "codegen": 2.0, "autotuning": 2.0,
                                            "kernel_compile": 3.0}


@pytest.mark.parametrize(("name", "category"), [
    ("GraphLowering.run", "lowering"), ("compile_file", "kernel_compile"),
    ("mm_template_autotuning", "autotuning"), ("CachingAutotuner.coordinate_descent_tuning",
                                               "autotuning"),
    ("create_aot_dispatcher_function", "aot_autograd"), ("CompiledArtifact.save", "artifact_save"),
    ("Scheduler.__init__", "codegen"), ("something_new", "inductor_other")])
def test_inductor_event_categories(name: str, category: str) -> None:
    assert category_of(name) == category


@pytest.mark.parametrize(("name", "category"), [
    ("triton_poi_fused_add_cos_sin_0", "pointwise"), ("triton_red_fused_sum_1", "reduction"),
    ("triton_per_fused_softmax_2", "persistent_reduction"), ("triton_tem_fused_mm_3", "template"),
    ("triton_for_fused_4", "foreach"), ("graph_0_cpp_fused_relu_0", "cpp_fused"),
    ("sm90_xmma_gemm_bf16", "extern"), ("Memcpy HtoD (Pageable -> Device)", "memory")])
def test_kernel_categories(name: str, category: str) -> None:
    assert kernel_category(name) == category


def test_kernel_summary_merges_overlaps_for_busy_time() -> None:
    kb = summarize_kernels("g1", "t", "cuda", 1, 10.0, [
        ("triton_poi_a", 0.0, 4000.0), ("triton_poi_a", 2000.0, 5000.0), ("gemm", 8000.0, 9000.0)])
    assert kb.busy_pct == pytest.approx(60.0)
    assert kb.category_ms == {"pointwise": 7.0, "extern": 1.0}
    assert kb.top_kernels[0] == ("triton_poi_a", "pointwise", 7.0, 2)


def _pair(ratio: float, low: float, high: float, *, rounds: int = 24,
          contended: int = 0) -> Paired:
    return Paired("g1", "a", "b", 1.0, ratio, ratio, low, high, rounds, contended)


def test_gate_decides_on_the_interval_not_on_two_medians() -> None:
    decide = functools.partial(gate_decision, threshold=0.02, last_attempt=False)
    adopt = decide(_pair(0.90, 0.88, 0.93))
    assert (adopt.outcome, adopt.confidence, adopt.adopt) == ("adopt", "confident", True)
    assert "95% interval +7.0% to +12.0%" in adopt.reason and "24 of 24 rounds clean" in adopt.reason
    keep = decide(_pair(1.01, 0.99, 1.03))  # even the fast end gains under 2 %
    assert (keep.outcome, keep.confidence, keep.adopt) == ("keep", "confident", False)
    # 3 % faster by the estimate, but the interval reaches 1 % slower: no verdict.
    straddle = decide(_pair(0.97, 0.95, 1.01))
    assert (straddle.outcome, straddle.confidence) == ("undecided", "")
    assert "straddles" in straddle.reason
    # Contention: too few clean rounds, whatever the numbers say.
    contended = decide(_pair(0.5, 0.45, 0.55, contended=17))
    assert contended.outcome == "undecided" and "contended: 17 of 24 rounds" in contended.reason
    # The last attempt keeps what serves, and says it is a weak decision.
    last = gate_decision(_pair(0.96, 0.93, 1.01), threshold=0.02, attempt=3)
    assert (last.outcome, last.confidence, last.adopt) == ("keep", "low", False)
    assert "still undecided at attempt 3: the serving tier stays" in last.reason
    never = gate_decision(_pair(0.5, -math.inf, math.inf, contended=24), threshold=0.02)
    assert (never.outcome, never.confidence) == ("keep", "low")
    # The candidate at most 4 % faster (-1 % to +4 %): keeping it out costs under 2.5
    # thresholds, too little to measure again at every start.
    close = gate_decision(_pair(0.985, 0.96, 1.01), threshold=0.02, attempt=3)
    assert (close.outcome, close.confidence, close.adopt) == ("keep", "close", False)
    assert "the candidate is at most 4.0% faster, within 5%" in close.reason
    # How much slower it might be costs nothing (-8 % to +4 %): it does not serve.
    slower = gate_decision(_pair(1.02, 0.96, 1.08), threshold=0.02, attempt=3)
    assert (slower.outcome, slower.confidence) == ("keep", "close")
    # The candidate maybe 6 % faster: keeping it out may cost more than 5 %.
    maybe = gate_decision(_pair(0.99, 0.94, 1.03), threshold=0.02, attempt=3)
    assert (maybe.outcome, maybe.confidence) == ("keep", "low")


def test_median_interval_is_the_binomial_order_statistics() -> None:
    assert median_interval([1.0] * 5) == (-math.inf, math.inf)  # 5 values: no 95 % interval
    assert median_interval([float(i) for i in range(12)]) == (2.0, 9.0)
    assert median_interval([float(i) for i in range(24)]) == (6.0, 17.0)


def _spin(seconds: float) -> Callable[[], None]:
    def spin() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return spin


def test_measure_pair_ranks_two_callables() -> None:
    pair = measure_pair("g1", "slow", "fast", {"slow": _spin(2e-4), "fast": _spin(1e-4)},
                        budget_ms=100)
    assert pair.rounds >= GATE_ROUNDS and pair.calls_per_block >= 1
    assert 0.4 < pair.ratio < 0.65 and pair.serving_ms > pair.candidate_ms
    if pair.clean >= MIN_CLEAN:  # a machine this busy decides nothing, which is the point
        decision = gate_decision(pair, threshold=0.02)
        assert decision.outcome == "adopt" and pair.ratio_low <= pair.ratio <= pair.ratio_high


_CONTENDED = """
import json, os, subprocess, sys, time
import psutil
from hotswap.profiles.bench import measure_pair
spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1))]
try:
    # Spinning before the measurement starts: their interpreters' start took longer than the
    # 200 ms measurement on a loaded machine, and it then saw no contention.
    deadline = time.monotonic() + 30
    while (any(sum(psutil.Process(p.pid).cpu_times()[:2]) < 0.1 for p in spin)
           and time.monotonic() < deadline):
        time.sleep(0.02)
    a = lambda: sum(range(300_000))  # a few ms: longer than a time slice shared 3 ways
    # 600 ms, not 200: once in a test run every round of a 200 ms measurement kept a clean
    # block of each tier.
    pair = measure_pair("g1", "a", "b", {"a": a, "b": a}, budget_ms=600)
finally:
    for p in spin:
        p.kill()
print(json.dumps(pair.to_dict()))
"""


def test_measure_pair_sees_contention() -> None:
    """Twice as many spinning processes as cores: blocks get preempted, and the measurement
    counts those rounds out instead of ranking on them."""
    done = subprocess.run([sys.executable, "-c", _CONTENDED], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    pair = record_from_dict(json.loads(done.stdout))
    assert pair.contended >= 1, pair


def test_record_file_survives_a_truncated_tail(tmp_path: Path) -> None:
    timeline = _run(tmp_path)
    assert timeline.path is not None
    whole = read_records(tmp_path)
    with open(timeline.path, "ab") as f:
        f.write(struct.pack("B", 0x85) + b"\xa4type")  # a map cut off mid-record
    assert read_records(timeline.path) == whole
    assert sum(isinstance(r, Call) for r in whole) == 2


def test_chrome_trace_is_valid_with_tracks_calls_and_swaps(tmp_path: Path) -> None:
    trace = json.loads(json.dumps(chrome_trace(read_records(_run(tmp_path).path or ""))))
    events = trace["traceEvents"]
    for event in events:
        assert {"ph", "pid", "tid", "name"} <= set(event)
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"hotswap coordinator", "hotswap worker 7"}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"worker 7", "hotswap-load", "MainThread"} <= threads
    calls = [e for e in events if e.get("cat") == "call"]
    assert [c["name"] for c in calls] == ["g1 [eager]", "g1 [default]"]
    assert calls[0]["cname"] != calls[1]["cname"]
    assert any(e["ph"] == "i" and e["name"] == "swap g1: eager -> default" for e in events)
    assert any(e["ph"] == "i" and e["cat"] == "gate" for e in events)


def test_merge_aligns_a_torch_trace_on_call_marks(tmp_path: Path) -> None:
    ours = chrome_trace(read_records(_run(tmp_path).path or ""))
    calls = [e for e in ours["traceEvents"] if e.get("cat") == "call"]
    offset = 5_000_000.0
    theirs = {"traceEvents": [
        {"ph": "X", "name": call_mark("g1", c["args"]["seq"]), "pid": 1, "tid": 1,
         "ts": c["ts"] + offset, "dur": 1.0} for c in calls] + [
        {"ph": "X", "name": "triton_poi_fused_sin_0", "cat": "kernel", "pid": 0, "tid": 7,
         "ts": calls[1]["ts"] + offset + 0.5, "dur": 0.3}]}
    merged = merge_torch_trace(ours, theirs)
    assert merged["otherData"]["hotswap"]["offset_us"] == offset
    shifted = [e for e in merged["traceEvents"] if e.get("cat") == "call"]
    assert [e["ts"] for e in shifted] == [c["ts"] + offset for c in calls]
    assert any(e["name"] == "triton_poi_fused_sin_0" for e in merged["traceEvents"])
    with pytest.raises(ValueError, match="no hotswap call marks"):
        merge_torch_trace(ours, {"traceEvents": []})


def test_text_and_compare_reports(tmp_path: Path) -> None:
    records = read_records(_run(tmp_path).path or "")
    report = text_report(records)
    for needle in ("graph g1", "calls served: eager 1, default 1", "inductor_compile",
                   "  lowering", "kernel_compile", "2.00x", "gate: max-autotune vs default kept out",
                   "cpp_fused 67%", "cpp_fused_relu_0", "p50", "p99", "speed-up"):
        assert needle in report, (needle, report)
    assert "graph g1: forward (model.py:12)" in report
    diff = compare_report(records, records)
    assert "graph g1: forward (model.py:12)" in diff and "1.00x" in diff
    assert "warning" not in diff and "only in" not in diff

    def renamed(graph_id: str, signature: str) -> list[Any]:  # the run's graph, numbered or
        out: list[Any] = []                                   # made otherwise
        for r in records:
            if isinstance(r, GraphInfo):
                r = dataclasses.replace(r, signature=signature)
            if hasattr(r, "graph_id"):
                r = dataclasses.replace(r, graph_id=graph_id)
            out.append(r)
        return out

    # The same graph as g2 of a run that traced another graph first: paired by signature.
    diff = compare_report(records, [GraphInfo("g1", "sig-other"), *renamed("g2", "sig-mlp")])
    assert "graph g1 (A) = g2 (B): forward (model.py:12)" in diff and "1.00x" in diff
    assert "only in B (no graph with the same signature in the other run): g1" in diff
    # Another model whose graph is also g1: not compared, and said so.
    diff = compare_report(records, renamed("g1", "sig-other"))
    assert "1.00x" not in diff and "no graph of one run matches a graph of the other" in diff
    # Records without signatures (an older hotswap): by id, with a warning.
    unsigned = [r for r in records if not isinstance(r, GraphInfo)]
    diff = compare_report(records, unsigned)
    assert "graphs are matched by id" in diff and "1.00x" in diff
    other = [dataclasses.replace(r, argv=("other.py",)) if isinstance(r, RunInfo) else r
             for r in records]
    assert "note: the runs ran different commands" in compare_report(records, other)


def test_plot_is_a_png(tmp_path: Path) -> None:
    records = read_records(_run(tmp_path / "run").path or "")
    path = tmp_path / "latency.png"
    assert plot_latency(records, path)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_matplotlib_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    records = read_records(_run(tmp_path / "run").path or "")
    assert plot_latency(records, tmp_path / "latency.png") is False
    assert not (tmp_path / "latency.png").exists()


def test_a_kernel_breakdown_keeps_kinetos_markers_off_the_terminal() -> None:
    """Kineto writes "USDT: ... profiler_start" to fd 2 on every profile; a worker's fd 2 is
    the user's terminal. Other output of the profiled calls still gets through."""
    import subprocess

    script = ("import os, torch\n"
              "from hotswap.profiles.kernels import kernel_breakdown\n"
              "x = torch.randn(64, 64)\n"
              "def fn():\n"
              "    os.write(2, b'the job speaks\\n')\n"
              "    return x @ x\n"
              "kernel_breakdown('g1', 'default', fn, calls=2)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0, done.stderr
    assert b"the job speaks" in done.stderr and b"USDT:" not in done.stderr, done.stderr


def test_a_paired_record_reads_back_with_its_clean_rounds_or_none() -> None:
    pair = Paired("g1", "a", "b", 1.0, 0.9, 0.9, 0.8, 1.0, 24, 20, clean_ratios=(0.8, 0.9))
    assert record_from_dict(json.loads(json.dumps(pair.to_dict()))) == pair
    for odd in (None, "0.8", [0.8, "x"], {"a": 1}):
        data = {**pair.to_dict(), "clean_ratios": odd}
        assert record_from_dict(data).clean_ratios == ()
    older = {k: v for k, v in pair.to_dict().items() if k not in ("clean_ratios", "measurements")}
    assert record_from_dict(older) == Paired("g1", "a", "b", 1.0, 0.9, 0.9, 0.8, 1.0, 24, 20)


def test_process_stages_reach_the_profile_and_the_trace_not_the_graphs(tmp_path: Path) -> None:
    from hotswap.profiles.timeline import process_span

    process_span("warmup:bytecode", 0.5, 1.0)  # before the profile opened: not in it
    timeline = Timeline(tmp_path)
    process_span("warmup:imports", 1.0, 1.5)
    timeline.close()
    process_span("warmup:later", 2.0, 2.5)  # a closed profile takes no more
    records = read_records(tmp_path)
    spans = [r for r in records if isinstance(r, Span)]
    assert [(s.name, s.graph_id, s.duration_s) for s in spans] == [
        ("warmup:imports", "process", 0.5)]
    _, graphs = summarize(records)
    assert graphs == {}  # a stage of the process is no graph's
    assert any(e.get("name") == "warmup:imports" for e in chrome_trace(records)["traceEvents"])


def test_contended_figures_are_marked_in_the_profile_and_its_plot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap.profiles import bench

    # compare_tiers counts the rounds a measurement's threads waited for a CPU
    waited = iter(range(0, 10**12, 10**9))  # a second of waiting between any two looks
    monkeypatch.setattr(bench, "_waited_ns", lambda: next(waited))
    busy = bench.compare_tiers("g1", {"eager": lambda: None}, budget_ms=4, rounds=2)
    assert [(b.contended, b.rounds) for b in busy] == [(2, 2)]
    monkeypatch.setattr(bench, "_waited_ns", lambda: 0)
    quiet = bench.compare_tiers("g1", {"eager": lambda: None}, budget_ms=4, rounds=2)
    assert [(b.contended, b.rounds) for b in quiet] == [(0, 2)]
    # ... and the profile says so, beside the gate's contended decisions
    records = [*read_records(_run(tmp_path / "run").path or ""),
               TierBench("g1", "max-autotune", BenchResult(3.0, 2.9, 3.1, 50), 0.7,
                         contended=3, rounds=4),
               GateDecision("g1", "max-autotune", "default", False, "not faster", 3.0, 1.0,
                            0.02, time_s=time.monotonic(), outcome="undecided", rounds=24,
                            contended=24)]
    report = text_report(records)
    assert "(contended: 3 of 4 rounds)" in report and "figures are upper bounds" in report
    assert "undecided, measured again [contended: 24 of 24 rounds]" in report
    # A tier that gave way and one dropped are marked on the plot as demotions
    t = records[-1].time_s
    demotions = [Swap("g1", "default", "eager", t + 0.1, "kept"),
                 Swap("g1", "eager", "default", t + 0.2, "swap"),
                 Swap("g1", "default", "eager", t + 0.3, "dropped")]
    assert plot_latency([*records, *demotions], tmp_path / "latency.png")
    assert (tmp_path / "latency.png").read_bytes()[:8] == PNG_MAGIC
