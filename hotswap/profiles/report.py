"""Reports from a run's records: per-graph text report, run-to-run comparison, latency plot.

``GraphSummary`` is the one digest both the report and the comparison read: stage seconds per
tier, compile self time by category, calls per tier, benchmark results, gate decisions and
kernel breakdowns.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hotswap.profiles.records import (
    GRAPH_TIER,
    Call,
    GateDecision,
    KernelBreakdown,
    RunInfo,
    Span,
    Swap,
    TierBench,
)
from hotswap.profiles.timeline import self_time_by_category

__all__ = [
    "GraphSummary", "compare_report", "plot_latency", "summarize", "text_report", "write_outputs",
]

# hotswap's own stages, in the order a tier goes through them.
STAGE_ORDER = ("dynamo_trace", "serialize", "cache_lookup", "queue_wait", "worker_deserialize",
               "graph_unpickle", "inductor_compile", "collect_files", "transfer", "load",
               "cache_load", "inprocess_compile", "gate_bench", "swap", "first_call")
COMPILE_ORDER = ("aot_autograd", "lowering", "codegen", "autotuning", "kernel_compile",
                 "artifact_save", "load", "inductor_other")


@dataclass
class GraphSummary:
    graph_id: str
    tiers: list[str] = field(default_factory=list)                    # in the order they appeared
    stages_s: dict[tuple[str, str], float] = field(default_factory=dict)   # (tier, stage) -> s
    compile_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (tier, category) -> s
    calls: dict[str, int] = field(default_factory=dict)               # tier -> calls served
    call_ms: dict[str, list[float]] = field(default_factory=dict)     # tier -> each call's ms
    first_call_s: float | None = None
    final_s: float | None = None                                      # last swap/keep/failure
    benches: list[TierBench] = field(default_factory=list)
    gates: list[GateDecision] = field(default_factory=list)
    kernels: list[KernelBreakdown] = field(default_factory=list)
    swaps: list[Swap] = field(default_factory=list)

    @property
    def time_to_final_s(self) -> float | None:
        if self.first_call_s is None or self.final_s is None:
            return None
        return max(0.0, self.final_s - self.first_call_s)


def summarize(records: Iterable[Any]) -> tuple[RunInfo | None, dict[str, GraphSummary]]:
    run: RunInfo | None = None
    graphs: dict[str, GraphSummary] = {}
    spans: dict[tuple[str, str], list[Span]] = {}

    def graph(graph_id: str) -> GraphSummary:
        return graphs.setdefault(graph_id, GraphSummary(graph_id))

    def note_tier(summary: GraphSummary, tier: str) -> None:
        if tier and tier != GRAPH_TIER and tier not in summary.tiers:
            summary.tiers.append(tier)

    for record in records:
        if isinstance(record, RunInfo):
            run = run or record
        elif isinstance(record, Span):
            summary = graph(record.graph_id)
            if not record.category:
                key = (record.tier, record.name)
                summary.stages_s[key] = summary.stages_s.get(key, 0.0) + record.duration_s
            else:
                spans.setdefault((record.graph_id, record.tier), []).append(record)
            note_tier(summary, record.tier)
        elif isinstance(record, Call):
            summary = graph(record.graph_id)
            summary.calls[record.tier] = summary.calls.get(record.tier, 0) + 1
            summary.call_ms.setdefault(record.tier, []).append(
                1e3 * (record.end_s - record.start_s))
            if summary.first_call_s is None or record.start_s < summary.first_call_s:
                summary.first_call_s = record.start_s
        elif isinstance(record, Swap):
            summary = graph(record.graph_id)
            summary.swaps.append(record)
            summary.final_s = max(summary.final_s or record.time_s, record.time_s)
            note_tier(summary, record.new_tier)
        elif isinstance(record, TierBench):
            graph(record.graph_id).benches.append(record)
        elif isinstance(record, GateDecision):
            graph(record.graph_id).gates.append(record)
        elif isinstance(record, KernelBreakdown):
            graph(record.graph_id).kernels.append(record)
    for (graph_id, tier), group in spans.items():
        for category, seconds in self_time_by_category(group).items():
            graphs[graph_id].compile_s[(tier, category)] = seconds
    return run, graphs


def _fmt_s(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in [header, *rows]]
    return ["    " + line for line in lines]


def _stage_rows(summary: GraphSummary) -> tuple[list[str], list[list[str]]]:
    tiers = [GRAPH_TIER, *summary.tiers]
    rows: list[list[str]] = []
    names = [s for s in STAGE_ORDER if any((t, s) in summary.stages_s for t in tiers)]
    names += sorted({s for _, s in summary.stages_s} - set(names))
    for name in names:
        rows.append([name, *[_fmt_s(summary.stages_s.get((t, name))) for t in tiers]])
        if name == "inductor_compile":
            for category in COMPILE_ORDER:
                if any((t, category) in summary.compile_s for t in tiers):
                    rows.append([f"  {category}",
                                 *[_fmt_s(summary.compile_s.get((t, category))) for t in tiers]])
    return ["stage (s)", "graph", *summary.tiers], rows


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _served_rows(summary: GraphSummary) -> list[list[str]]:
    """Each tier's served calls and their latency percentiles, as the caller saw them."""
    return [[tier, str(len(ms)), *(f"{_percentile(ms, q):.3f}" for q in (0.5, 0.9, 0.99)),
             f"{max(ms):.3f}"]
            for tier, ms in summary.call_ms.items()]


def _speedup(value: float | None) -> str:
    """eager ms / tier ms: above 1 the tier is faster than eager."""
    if value is None:
        return ""
    return f"{value:.2f}x" + ("" if value >= 1.0 else " SLOWER")


def _bench_rows(benches: list[TierBench]) -> list[list[str]]:
    latest: dict[str, TierBench] = {}
    for bench in benches:
        if bench.purpose == "compare" or bench.tier not in latest:
            latest[bench.tier] = bench
    return [[b.tier, f"{b.result.median_ms:.4f}", f"{b.result.p20_ms:.4f}",
             f"{b.result.p80_ms:.4f}", str(b.result.n),
             _speedup(b.speedup_vs_eager),
             b.result.benchmarker]
            for b in latest.values()]


def text_report(records: Iterable[Any]) -> str:
    run, graphs = summarize(records)
    out: list[str] = []
    if run is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.started_unix_s))
        versions = ", ".join(f"{k} {v}" for k, v in sorted(run.versions.items()))
        out.append(f"hotswap profile: pid {run.pid}, started {when}"
                   + (f", {versions}" if versions else ""))
        if run.argv:
            out.append(f"command: {' '.join(run.argv)}")
    total_calls = sum(sum(g.calls.values()) for g in graphs.values())
    out.append(f"graphs: {len(graphs)}, calls recorded: {total_calls}")
    for summary in graphs.values():
        out.append("")
        out.append(f"graph {summary.graph_id}")
        if summary.calls:
            served = ", ".join(f"{tier} {n}" for tier, n in summary.calls.items())
            out.append(f"  calls served: {served}; latency in ms as the caller saw it:")
            out.extend(_table(["tier", "calls", "p50", "p90", "p99", "max"],
                              _served_rows(summary)))
        if summary.time_to_final_s is not None:
            out.append(f"  first call -> final tier: {summary.time_to_final_s:.3f} s")
        header, rows = _stage_rows(summary)
        if rows:
            out.extend(_table(header, rows))
        rows = _bench_rows(summary.benches)
        if rows:
            out.append("  tiers on the same inputs (speed-up = eager ms / tier ms; > 1: faster):")
            out.extend(_table(["tier", "median ms", "p20", "p80", "n", "speed-up", "by"], rows))
            slower = [r[0] for r in rows if r[5].endswith("SLOWER")]
            if slower:
                out.append(f"  warning: {', '.join(slower)} measured slower than eager here")
        for gate in summary.gates:
            verdict = "adopted" if gate.adopt else "kept out"
            out.append(f"  gate: {gate.candidate} {verdict} ({gate.reason})")
        for kb in summary.kernels:
            total = sum(kb.category_ms.values()) or 1.0
            parts = ", ".join(f"{c} {100 * ms / total:.0f}%"
                              for c, ms in sorted(kb.category_ms.items(), key=lambda kv: -kv[1]))
            out.append(f"  kernels [{kb.tier}, {kb.device}, {kb.calls} calls]: {parts or 'none'}; "
                       f"busy {kb.busy_pct:.0f}% of {kb.wall_ms:.2f} ms")
            for name, category, ms, count in kb.top_kernels[:5]:
                out.append(f"      {ms:9.3f} ms  {count:4d}x  {category:<20} {name}")
    return "\n".join(out) + "\n"


def _row_adder(rows: list[list[str]]) -> Any:
    def row(label: str, x: float | None, y: float | None, unit: str = "s") -> None:
        if x is None and y is None:
            return
        ratio = f"{y / x:.2f}x" if x and y is not None else ""
        fmt = "{:.3f}" if unit == "s" else "{:.4f}"
        rows.append([label, "" if x is None else fmt.format(x),
                     "" if y is None else fmt.format(y), ratio])

    return row


def compare_report(a: Iterable[Any], b: Iterable[Any], *, names: tuple[str, str] = ("A", "B"),
                   ) -> str:
    """Per graph (matched by id): stage seconds, compile categories and tier medians of two
    runs, with B/A ratios."""
    run_a, ga = summarize(a)
    run_b, gb = summarize(b)
    out = [f"compare {names[0]} -> {names[1]} (ratio = {names[1]} / {names[0]})"]
    if run_a is not None and run_b is not None and run_a.argv != run_b.argv:
        out.append(f"warning: the runs ran different commands ({' '.join(run_a.argv)} | "
                   f"{' '.join(run_b.argv)}); graphs are matched by id (g1, g2, ...), which "
                   "names the n-th graph of a run, not the same graph")
    for graph_id in [g for g in ga if g in gb]:
        sa, sb = ga[graph_id], gb[graph_id]
        out += ["", f"graph {graph_id}"]
        rows: list[list[str]] = []
        row = _row_adder(rows)
        row("first call -> final (s)", sa.time_to_final_s, sb.time_to_final_s)
        for key in sorted(set(sa.stages_s) | set(sb.stages_s)):
            row(f"{key[0]}/{key[1]} (s)", sa.stages_s.get(key), sb.stages_s.get(key))
        for key in sorted(set(sa.compile_s) | set(sb.compile_s)):
            row(f"{key[0]}/compile:{key[1]} (s)", sa.compile_s.get(key), sb.compile_s.get(key))
        ma = {t[0]: float(t[1]) for t in _bench_rows(sa.benches)}
        mb = {t[0]: float(t[1]) for t in _bench_rows(sb.benches)}
        for tier in [*ma, *(t for t in mb if t not in ma)]:
            row(f"{tier} median (ms)", ma.get(tier), mb.get(tier), unit="ms")
        out.extend(_table(["", names[0], names[1], "ratio"], rows))
    only = sorted(set(ga) ^ set(gb))
    if only:
        out.append(f"\ngraphs in one run only: {', '.join(only)}")
    return "\n".join(out) + "\n"


def plot_latency(records: Iterable[Any], path: str | os.PathLike[str]) -> bool:
    """A PNG of per-call latency over wall time, one colour per tier, swaps marked.

    Returns False (and writes nothing) when matplotlib is not installed:
    ``pip install 'hotswap[plot]'``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    records = list(records)
    run = next((r for r in records if isinstance(r, RunInfo)), None)
    calls = [r for r in records if isinstance(r, Call)]
    base = run.started_s if run else min((c.start_s for c in calls), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    tiers: dict[str, list[Call]] = {}
    for call in calls:
        tiers.setdefault(call.tier, []).append(call)
    for tier, group in tiers.items():
        ax.scatter([c.start_s - base for c in group], [(c.end_s - c.start_s) * 1e3 for c in group],
                   s=6, label=f"{tier} ({len(group)})")
    for swap in (r for r in records if isinstance(r, Swap) and r.reason == "swap"):
        ax.axvline(swap.time_s - base, color="black", linestyle=":", linewidth=0.8)
        ax.annotate(f"{swap.graph_id} -> {swap.new_tier}", (swap.time_s - base, 0.98),
                    xycoords=("data", "axes fraction"), rotation=90, fontsize=7, va="top")
    ax.set_xlabel("wall time since start (s)")
    ax.set_ylabel("call latency (ms)")
    if calls:
        ax.set_yscale("log")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_title("hotswap: per-call latency by serving tier")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True


def write_outputs(records: Iterable[Any], out_dir: str | os.PathLike[str], *,
                  torch_trace: str | None = None) -> dict[str, str]:
    """Write ``trace.json`` (chrome/Perfetto), ``report.txt`` and ``latency.png`` (when
    matplotlib is installed) into ``out_dir``; with ``torch_trace`` (a torch.profiler chrome
    trace of the same run) also ``trace_merged.json``. Returns what was written, by kind."""
    from hotswap.profiles.trace import chrome_trace, merge_torch_trace, write_chrome_trace

    records = list(records)
    os.makedirs(out_dir, exist_ok=True)
    written: dict[str, str] = {}
    trace = chrome_trace(records)
    written["trace"] = os.path.join(out_dir, "trace.json")
    write_chrome_trace(written["trace"], trace)
    if torch_trace is not None:
        written["merged_trace"] = os.path.join(out_dir, "trace_merged.json")
        write_chrome_trace(written["merged_trace"], merge_torch_trace(trace, torch_trace))
    written["report"] = os.path.join(out_dir, "report.txt")
    with open(written["report"], "w") as f:
        f.write(text_report(records))
    plot = os.path.join(out_dir, "latency.png")
    if plot_latency(records, plot):
        written["plot"] = plot
    return written
