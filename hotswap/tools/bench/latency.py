"""What ``hotswap bench --service`` makes of its requests: windows of p50/p99/max, the time
until p99 settles, the printed table, the raw JSON and the latency-over-time plot.

Every time is on the user's clock: seconds since the server process was launched. A request
belongs to the window in which it was sent (its scheduled send time: an open-loop client does
not wait for earlier answers, so a request the server is slow to take keeps its place).

- A window's p50, p99 and max are over the requests of that window that were answered (HTTP
  200); the others (refused before the server listened, timed out, an error status) are
  counted as ``failed``. Percentiles are nearest-rank: p of n sorted values is the
  ``ceil(p * n)``-th.
- ``final`` p99 is the p99 of the answered requests of the last ``FINAL_WINDOWS`` windows
  together (the last 30 s of a 120 s run with 10 s windows).
- ``settled`` is the start of the earliest window from which on every window answered all its
  requests and had a p99 no more than 10 % above the final p99 (lower is settled too). It is
  read off the table: a window granularity, from process start. None: the last windows
  themselves failed a request or stood above the final p99.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["FINAL_WINDOWS", "SETTLE_TOLERANCE", "Request", "Summary", "Window", "percentile",
           "plot", "report", "settled_s", "summarize", "windows", "write_json"]

FINAL_WINDOWS = 3
SETTLE_TOLERANCE = 0.10


@dataclass(frozen=True)
class Request:
    """One request the client sent. ``sent_s``: its scheduled send time, s from the server
    process's launch; ``latency_s``: from then to the answer (None: no answer); ``status``: the
    HTTP status (None: none came); ``error``: why it failed ("refused": the server was not
    listening yet, "timeout", "HTTP 500", an exception's name), None when answered 200."""

    sent_s: float
    latency_s: float | None
    status: int | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.latency_s is not None


@dataclass(frozen=True)
class Window:
    """The requests sent in ``[start_s, end_s)``: how many, answered and failed; p50, p99
    and max latency of the answered ones (None when none was)."""

    start_s: float
    end_s: float
    sent: int
    answered: int
    failed: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None


@dataclass(frozen=True)
class Summary:
    """One variant's run: when it first answered, its windows, its final p99 and when its p99
    settled (all from the server process's launch)."""

    variant: str
    first_answer_s: float | None
    refused: int
    failed: int
    final_p99_ms: float | None
    settled_s: float | None
    max_ms: float | None
    windows: tuple[Window, ...]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def windows(requests: Sequence[Request], window_s: float, duration_s: float) -> list[Window]:
    """The requests in consecutive windows of ``window_s`` from 0 to ``duration_s`` (the last
    one shorter when ``window_s`` does not divide it)."""
    count = max(1, math.ceil(duration_s / window_s - 1e-9))
    bins: list[list[Request]] = [[] for _ in range(count)]
    for r in requests:
        bins[min(count - 1, int(r.sent_s // window_s))].append(r)
    out = []
    for i, group in enumerate(bins):
        ms = [r.latency_s * 1e3 for r in group if r.ok and r.latency_s is not None]
        out.append(Window(i * window_s, min((i + 1) * window_s, duration_s), len(group), len(ms),
                          len(group) - len(ms), percentile(ms, 0.5) if ms else None,
                          percentile(ms, 0.99) if ms else None, max(ms) if ms else None))
    return out


def final_p99_ms(requests: Sequence[Request], spans: Sequence[Window],
                 final_windows: int = FINAL_WINDOWS) -> float | None:
    """p99 of the answered requests sent in the last ``final_windows`` windows."""
    since = spans[-min(final_windows, len(spans))].start_s
    ms = [r.latency_s * 1e3 for r in requests
          if r.ok and r.latency_s is not None and r.sent_s >= since]
    return percentile(ms, 0.99) if ms else None


def settled_s(spans: Sequence[Window], final_ms: float | None,
              tolerance: float = SETTLE_TOLERANCE) -> float | None:
    """The start of the earliest window from which on every window answered all it was sent
    and had a p99 at most ``(1 + tolerance) * final_ms``; None if the last window did not."""
    if final_ms is None:
        return None
    start = None
    for span in reversed(spans):
        calm = (span.failed == 0 and span.p99_ms is not None
                and span.p99_ms <= (1 + tolerance) * final_ms)
        if not calm:
            break
        start = span.start_s
    return start


def summarize(variant: str, requests: Sequence[Request], window_s: float,
              duration_s: float) -> Summary:
    spans = windows(requests, window_s, duration_s)
    final = final_p99_ms(requests, spans)
    answered = [r for r in requests if r.ok and r.latency_s is not None]
    return Summary(
        variant=variant,
        first_answer_s=min((r.sent_s + (r.latency_s or 0.0) for r in answered), default=None),
        refused=sum(r.error == "refused" for r in requests),
        failed=sum(not r.ok for r in requests), final_p99_ms=final,
        settled_s=settled_s(spans, final),
        max_ms=max((r.latency_s or 0.0) * 1e3 for r in answered) if answered else None,
        windows=tuple(spans))


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(summaries: Sequence[Summary], notes: dict[str, str]) -> list[str]:
    """Per variant its windows, then one line per variant side by side. ``notes``: a line
    per variant from its server (when compiled code served; why it stopped)."""
    lines: list[str] = []
    for s in summaries:
        lines += [f"{s.variant}: first answer {_fmt(s.first_answer_s)} s, {s.refused} refused "
                  f"before it listened, {s.failed - s.refused} other failures"
                  + (f"; {notes[s.variant]}" if notes.get(s.variant) else ""),
                  f"  {'window s':<12}{'sent':>6}{'ok':>6}{'failed':>7}{'p50 ms':>9}"
                  f"{'p99 ms':>9}{'max ms':>9}"]
        for w in s.windows:
            lines.append(f"  {f'{w.start_s:g}-{w.end_s:g}':<12}{w.sent:>6}{w.answered:>6}"
                         f"{w.failed:>7}{_fmt(w.p50_ms):>9}{_fmt(w.p99_ms):>9}"
                         f"{_fmt(w.max_ms, 1):>9}")
    lines += ["", f"{'variant':<30}{'first answer s':>15}{'p99 settled s':>14}"
              f"{'final p99 ms':>13}{'max ms':>9}{'failed':>7}"]
    for s in summaries:
        settle = "never" if s.settled_s is None else f"{s.settled_s:g}"
        lines.append(f"{s.variant:<30}{_fmt(s.first_answer_s):>15}{settle:>14}"
                     f"{_fmt(s.final_p99_ms):>13}{_fmt(s.max_ms, 1):>9}{s.failed:>7}")
    lines.append(f"  (settled: from that window on, every window answered all its requests "
                 f"with p99 <= {1 + SETTLE_TOLERANCE:g}x the final p99, that of the last "
                 f"{FINAL_WINDOWS} windows)")
    return lines


def write_json(path: str, meta: dict[str, Any], runs: dict[str, dict[str, Any]],
               summaries: Sequence[Summary]) -> None:
    """Every request of every variant, beside its summary and what its server said."""
    by_name = {s.variant: s for s in summaries}
    body = {**meta, "variants": {
        name: {**run, "summary": asdict(by_name[name]),
               "requests": [{"sent_s": round(r.sent_s, 6),
                             "latency_ms": None if r.latency_s is None
                             else round(r.latency_s * 1e3, 4),
                             "status": r.status, "error": r.error}
                            for r in run["requests"]]}
        for name, run in runs.items()}}
    with open(path, "w") as f:
        json.dump(body, f, indent=1)


def plot(path: str, title: str, runs: dict[str, Sequence[Request]],
         summaries: Sequence[Summary]) -> None:
    """Latency over time, log y: each answered request a faint dot, each window's p99 a
    line, and where p99 settled a dashed vertical line, one colour per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.5))
    for i, summary in enumerate(summaries):
        color = f"C{i}"
        answered = [r for r in runs[summary.variant] if r.ok and r.latency_s is not None]
        ax.scatter([r.sent_s for r in answered], [(r.latency_s or 0.0) * 1e3 for r in answered],
                   s=4, alpha=0.4, color=color, linewidths=0)
        spans = [(w.start_s, w.end_s, w.p99_ms) for w in summary.windows if w.p99_ms is not None]
        xs = [x for start, end, _ in spans for x in (start, end)]
        ys = [p99 for _, _, p99 in spans for _ in (0, 1)]
        settle = "never" if summary.settled_s is None else f"{summary.settled_s:g} s"
        ax.plot(xs, ys, color=color, linewidth=1.6,
                label=f"{summary.variant}: first answer {_fmt(summary.first_answer_s, 1)} s, "
                      f"p99 settled {settle}")
        if summary.settled_s is not None:
            ax.axvline(summary.settled_s, color=color, linestyle="--", linewidth=0.8)
    ax.set_xlim(0, max((w.end_s for s in summaries for w in s.windows), default=1.0))
    ax.set_yscale("log")
    ax.set_xlabel("request sent at (s since the server process was launched)")
    ax.set_ylabel("latency (ms): dots each request, lines each window's p99")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
