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
    PROCESS,
    Call,
    GateDecision,
    GraphInfo,
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
               "cache_load", "first_run", "inprocess_compile", "gate_bench", "swap",
               "first_call")
COMPILE_ORDER = ("aot_autograd", "lowering", "codegen", "autotuning", "kernel_compile",
                 "artifact_save", "load", "inductor_other")


@dataclass
class GraphSummary:
    graph_id: str
    signature: str = ""                                               # GraphInfo's, when recorded
    origin: str = ""
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
        if getattr(record, "graph_id", None) == PROCESS:
            continue  # the process's own stages: no graph's
        if isinstance(record, RunInfo):
            run = run or record
        elif isinstance(record, GraphInfo):
            summary = graph(record.graph_id)
            summary.signature, summary.origin = record.signature, record.origin
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
             b.result.benchmarker + (f" (contended: {b.contended} of {b.rounds} rounds)"
                                     if b.contended else "")]
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
        out.append(f"graph {summary.graph_id}"
                   + (f": {summary.origin}" if summary.origin else ""))
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
            if any("(contended" in r[6] for r in rows):
                out.append("  contended: another task held a CPU this measurement's threads "
                           "waited for; its figures are upper bounds, not the tier's speed")
        for gate in summary.gates:
            verdict = ("undecided, measured again" if gate.outcome == "undecided"
                       else "adopted" if gate.adopt else "kept out")
            contended = (f" [contended: {gate.contended} of {gate.rounds} rounds]"
                         if gate.contended else "")
            out.append(f"  gate: {gate.candidate} vs {gate.serving} {verdict}{contended} "
                       f"({gate.reason})")
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


def _pairs(ga: dict[str, GraphSummary], gb: dict[str, GraphSummary],
           ) -> tuple[list[tuple[GraphSummary, GraphSummary]], bool]:
    """The graphs of two runs paired by signature (the n-th graph of a signature in A with the
    n-th in B), or by id where a run recorded none (older files); True when by id."""
    if not all(g.signature for g in (*ga.values(), *gb.values())):
        return [(ga[g], gb[g]) for g in ga if g in gb], True
    waiting: dict[str, list[GraphSummary]] = {}
    for summary in gb.values():
        waiting.setdefault(summary.signature, []).append(summary)
    pairs = []
    for summary in ga.values():
        others = waiting.get(summary.signature)
        if others:
            pairs.append((summary, others.pop(0)))
    return pairs, False


def _graph_title(a: GraphSummary, b: GraphSummary) -> str:
    ids = a.graph_id if a.graph_id == b.graph_id else f"{a.graph_id} (A) = {b.graph_id} (B)"
    return f"graph {ids}" + (f": {a.origin or b.origin}" if a.origin or b.origin else "")


def compare_report(a: Iterable[Any], b: Iterable[Any], *, names: tuple[str, str] = ("A", "B"),
                   ) -> str:
    """Per graph (matched by signature: same code, same input shapes): stage seconds, compile
    categories and tier medians of two runs, with B/A ratios."""
    run_a, ga = summarize(a)
    run_b, gb = summarize(b)
    pairs, by_id = _pairs(ga, gb)
    out = [f"compare {names[0]} -> {names[1]} (ratio = {names[1]} / {names[0]})"]
    if by_id:
        out.append("warning: a run has no graph signatures (recorded by an older hotswap); "
                   "graphs are matched by id (g1, g2, ...), which names the n-th graph of a "
                   "run, not the same graph")
    if run_a is not None and run_b is not None and run_a.argv != run_b.argv:
        out.append(f"note: the runs ran different commands ({' '.join(run_a.argv)} | "
                   f"{' '.join(run_b.argv)})")
    for sa, sb in pairs:
        out += ["", _graph_title(sa, sb)]
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
    for name, graphs, paired in ((names[0], ga, {id(p[0]) for p in pairs}),
                                 (names[1], gb, {id(p[1]) for p in pairs})):
        alone = [g.graph_id + (f" ({g.origin})" if g.origin else "")
                 for g in graphs.values() if id(g) not in paired]
        if alone:
            out.append(f"\nonly in {name} (no graph with the same signature in the other run): "
                       + ", ".join(alone))
    if not pairs and ga and gb:
        out.append("\nwarning: no graph of one run matches a graph of the other: these runs "
                   "compiled different models or input shapes")
    return "\n".join(out) + "\n"


# Spans drawn as a tier's compile window on the plot.
_COMPILE_SPANS = ("inductor_compile", "inprocess_compile")


def plot_latency(records: Iterable[Any], path: str | os.PathLike[str]) -> bool:
    """A PNG of the run: above, each tier's compile windows, with a mark where a tier swapped
    in, was kept out or failed; below, per-call latency over wall time, one colour per tier,
    swaps as dotted lines through both. Labels sit in the upper panel and the legend outside
    the axes, so neither hides the other on a long run.

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
    swaps = [r for r in records if isinstance(r, Swap)]
    windows = [r for r in records if isinstance(r, Span) and r.name in _COMPILE_SPANS]
    base = run.started_s if run else min((c.start_s for c in calls), default=0.0)
    tiers: dict[str, list[Call]] = {}
    for call in calls:
        tiers.setdefault(call.tier, []).append(call)
    lanes: list[str] = []  # one row per (graph, tier) that compiled or was decided on
    for lane in [f"{w.graph_id} {w.tier}" for w in windows] + [
            f"{s.graph_id} {s.new_tier}" for s in swaps if s.new_tier != "eager"]:
        if lane not in lanes:
            lanes.append(lane)
    fig, (top, ax) = plt.subplots(
        2, 1, sharex=True, figsize=(11, 3.2 + 0.25 * len(lanes)), dpi=110,
        gridspec_kw={"height_ratios": [max(1.0, 0.35 * len(lanes)), 3.0]})
    colours = {tier: f"C{i}" for i, tier in enumerate(
        dict.fromkeys([*tiers, *(w.tier for w in windows), *(s.new_tier for s in swaps)]))}
    for window in windows:
        top.broken_barh([(window.start_s - base, window.duration_s)],
                        (lanes.index(f"{window.graph_id} {window.tier}") - 0.35, 0.7),
                        color=colours[window.tier], alpha=0.6)
    marks = {"swap": ("v", "swapped in"), "kept": ("x", "kept out"), "failed": ("X", "failed")}
    ranks: dict[str, int] = {}  # each graph's tiers in the order they first served
    for swap in swaps:
        if swap.reason not in marks and swap.reason != "dropped":
            continue
        at = swap.time_s - base
        back = f"{swap.graph_id} {swap.new_tier}"
        demoted = swap.reason == "dropped" or (  # back to eager, or to a tier that served first
            swap.reason in ("swap", "kept") and swap.old_tier != "eager"
            and (swap.new_tier == "eager" or ranks.get(back, len(ranks)) < ranks.get(
                f"{swap.graph_id} {swap.old_tier}", -1)))
        if demoted:  # gave way (the gate), or dropped (it raised): marked on the tier that left
            lane = f"{swap.graph_id} {swap.old_tier}"
            if lane in lanes:
                top.scatter([at], [lanes.index(lane)], marker="^", color="red", s=30, zorder=3)
            ax.axvline(at, color="red", linestyle=":", linewidth=0.8)
            top.axvline(at, color="red", linestyle=":", linewidth=0.8)
            continue
        if swap.new_tier == "eager":
            continue
        lane = f"{swap.graph_id} {swap.new_tier}"
        ranks.setdefault(lane, len(ranks))
        shape, _ = marks[swap.reason]
        top.scatter([at], [lanes.index(lane)], marker=shape, color="black", s=30, zorder=3)
        if swap.reason == "swap":
            ax.axvline(at, color="black", linestyle=":", linewidth=0.8)
            top.axvline(at, color="black", linestyle=":", linewidth=0.8)
    for gate in (r for r in records if isinstance(r, GateDecision) and r.contended):
        lane = f"{gate.graph_id} {gate.candidate}"
        if lane in lanes and gate.time_s:  # a measurement another task's work slowed
            top.scatter([gate.time_s - base], [lanes.index(lane)], marker="o",
                        facecolors="none", edgecolors="orange", s=40, zorder=3)
    top.set_yticks(range(len(lanes)), lanes, fontsize=7)
    top.set_ylim(-0.7, max(0.7, len(lanes) - 0.3))
    top.invert_yaxis()
    top.set_title("hotswap: compile windows (bars), tiers swapped in (v), kept out (x), "
                  "failed (X), given way or dropped (red ^), contended gate measurements "
                  "(orange o); per-call latency below", fontsize=8)
    for tier, group in tiers.items():
        ax.scatter([c.start_s - base for c in group], [(c.end_s - c.start_s) * 1e3 for c in group],
                   s=6, color=colours[tier], label=f"{tier} ({len(group)} calls)")
    ax.set_xlabel("wall time since start (s)")
    ax.set_ylabel("call latency (ms)")
    if calls:
        ax.set_yscale("log")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
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
