"""Profiles: stage timelines, chrome traces, tier benchmarks, gate decisions, kernel breakdowns.

Standalone: this package imports neither the engine nor the workers; they call it.
"""

from hotswap.profiles.bench import DEFAULT_BUDGET_MS, benchmark, compare_tiers, gate_decision
from hotswap.profiles.kernels import kernel_breakdown, kernel_category
from hotswap.profiles.records import (
    BenchResult,
    Call,
    GateDecision,
    GraphInfo,
    KernelBreakdown,
    RunInfo,
    Span,
    Swap,
    TierBench,
)
from hotswap.profiles.report import (
    compare_report,
    plot_latency,
    summarize,
    text_report,
    write_outputs,
)
from hotswap.profiles.timeline import Timeline, category_of, read_records, self_time_by_category
from hotswap.profiles.trace import chrome_trace, merge_torch_trace, write_chrome_trace

__all__ = [
    "DEFAULT_BUDGET_MS",
    "BenchResult",
    "Call",
    "GateDecision",
    "GraphInfo",
    "KernelBreakdown",
    "RunInfo",
    "Span",
    "Swap",
    "TierBench",
    "Timeline",
    "benchmark",
    "category_of",
    "chrome_trace",
    "compare_report",
    "compare_tiers",
    "gate_decision",
    "kernel_breakdown",
    "kernel_category",
    "merge_torch_trace",
    "plot_latency",
    "read_records",
    "self_time_by_category",
    "summarize",
    "text_report",
    "write_chrome_trace",
    "write_outputs",
]
